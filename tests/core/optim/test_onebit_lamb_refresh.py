"""1-bit LAMB with refreshed coefficients (``coeff_refresh``): the schedule, the rule at a
refresh step, identical ranks, exact resume and the bytes it adds, on real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch

from onebit_bert.optim import OneBitLamb
from onebit_bert.optim.lamb import trust_ratios
from onebit_bert.optim.onebit_lamb import refresh_due
from tests.helpers.distributed_harness import run_ranks

FREEZE = 4


def test_refresh_schedule_doubles_up_to_its_longest_interval():
    due = [k for k in range(1, 3000) if refresh_due(k, 16, 512)]
    assert due[:8] == [16, 48, 112, 240, 496, 1008, 1520, 2032]
    assert all(b - a == 512 for a, b in zip(due[5:], due[6:], strict=False))
    # the authors' regime scaled: 5,200 compression steps refresh 14 times
    assert sum(refresh_due(k, 16, 512) for k in range(1, 5201)) == 14
    assert not any(refresh_due(k, 0, 512) for k in range(1, 100))  # 0: never
    with pytest.raises(ValueError, match="coeff_refresh"):
        OneBitLamb([torch.nn.Parameter(torch.ones(2))], coeff_refresh=8, coeff_refresh_max=4)


def _run(comm, ckpt_dir, steps, refresh, save_at=None, load=False):
    """Data-parallel toy training with 1-bit LAMB (refresh every 2 then 4 steps after the
    freeze); returns parameters, per-step trust ratios, the rule's check and bytes."""
    from tests.helpers.toy import ToyConfig, _batch, _teacher, build_model

    cfg = ToyConfig(seed=5)
    model = build_model(cfg)
    opt = OneBitLamb(model.parameters(), lr=0.02, freeze_step=FREEZE, weight_decay=0.01,
                     comm=comm, coeff_refresh=refresh, coeff_refresh_max=4)  # fmt: skip
    path = os.path.join(ckpt_dir, f"rank{comm.rank}.pt")
    start = 0
    if load:
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        start = saved["step"]
    teacher = _teacher(cfg)
    out = {"trust": {}, "rule": {}, "bytes": {}, "refreshed": []}
    params = list(model.parameters())
    for step in range(start, steps):
        x, y = _batch(cfg, teacher, comm.rank, step, 16)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if not opt.syncs_internally:
            comm.all_reduce_coalesced([p.grad for p in params], op="avg")
        before = [p.detach().clone() for p in params]
        opt.step()
        out["trust"][step + 1] = opt.last_trust_ratios.clone()
        out["bytes"][step + 1] = opt.last_step_bytes
        if opt.last_refreshed:
            out["refreshed"].append(step + 1)
            # the rule: c·f is LAMB's clipped trust ratio of the exact momentum against the
            # frozen second moment, at the weights before the step
            states = [opt.state[p] for p in params]
            updates = [
                st["exp_avg"] / (st["exp_avg_sq"].sqrt() + 1e-8) + 0.01 * w
                for st, w in zip(states, before, strict=True)
            ]
            out["rule"][step + 1] = trust_ratios(before, updates, 0.01, 10.0)
        if save_at == step + 1:
            torch.save(
                {"model": model.state_dict(), "optim": opt.state_dict(), "step": step + 1}, path
            )
    out["params"] = [p.detach().clone() for p in params]
    out["momentum"] = [opt.state[p]["exp_avg"].clone() for p in params]
    return out


def test_refresh_steps_take_lambs_trust_ratio_and_ranks_stay_identical(tmp_path):
    steps = 16
    plain = run_ranks(_run, 2, str(tmp_path), steps, 0)
    fresh = run_ranks(_run, 2, str(tmp_path), steps, 2)
    rank0, rank1 = fresh
    # refreshes 2, 6, 10, 14 steps after the freeze (intervals 2, 4, 4, ...)
    assert rank0["refreshed"] == [FREEZE + k for k in (2, 6, 10)]
    for step, expected in rank0["rule"].items():
        torch.testing.assert_close(rank0["trust"][step], expected, rtol=1e-5, atol=0)
    for a, b in zip(rank0["params"], rank1["params"], strict=True):
        assert torch.equal(a, b)  # ranks identical
    # up to the first refresh the trajectory is the authors' algorithm bit for bit
    for step in range(1, FREEZE + 2):
        assert torch.equal(plain[0]["trust"][step], rank0["trust"][step])
    first = FREEZE + 2
    assert not torch.equal(plain[0]["trust"][first], rank0["trust"][first])
    # a refresh step sends an fp32 all-reduce; the others the 1-bit exchange
    numel = sum(p.numel() for p in rank0["params"])
    assert rank0["bytes"][first] >= 4 * numel  # 2 (p-1)/p x 4 bytes: 4 bytes each on 2 ranks
    assert rank0["bytes"][first + 1] == plain[0]["bytes"][first + 1] < numel / 2


@pytest.mark.parametrize("save_at", [FREEZE + 1, FREEZE + 2, FREEZE + 5])
def test_resume_with_refreshes_equals_the_uninterrupted_run(tmp_path, save_at):
    steps = 14
    straight = run_ranks(_run, 2, str(tmp_path), steps, 2, save_at)
    resumed = run_ranks(_run, 2, str(tmp_path), steps, 2, None, True)
    for a, b in zip(straight, resumed, strict=True):
        for pa, pb in zip(a["params"], b["params"], strict=True):
            assert torch.equal(pa, pb)
