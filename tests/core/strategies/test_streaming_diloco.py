"""Streaming DiLoCo: the fragment rule and schedule, one fragment without delay or mixing
is DiLoCo to the bit, several fragments with delay and mixing against a one-process
simulation built on torch.optim.SGD (2 gloo ranks), config rules, and an exact resume of a
run killed with a fragment's average in flight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from onebit_bert.config import from_dict
from onebit_bert.strategies import LocalSteps, StrategyConfig, StreamingDiLoCo
from onebit_bert.strategies.streaming import fragments_due, split_fragments
from pretrain.config import PretrainConfig
from tests.helpers.checkpoints import assert_same_local_step_runs, load_checkpoint
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import (
    dist_context,
    run_killing_after_checkpoints,
    tiny_config,
    torchrun_to_end,
    write_cfg,
)
from tests.helpers.toy import STRATEGY_TOY as TOY
from tests.helpers.toy import build_model, diloco_inner, flat_params, toy_loss


def test_fragments_are_contiguous_runs_of_whole_tensors_cut_by_size():
    sizes = [4, 4, 4, 4, 4, 4, 4, 4]
    assert split_fragments(sizes, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_fragments(sizes, 1) == [(0, 8)]
    # a cut at the first boundary past k/F of the elements, at least one tensor each
    assert split_fragments([10, 10, 10, 10, 100, 5, 5], 3) == [(0, 5), (5, 6), (6, 7)]
    assert split_fragments([100, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="between 1 and the number of parameter tensors"):
        split_fragments([1, 2], 3)


@pytest.mark.parametrize(("every", "count"), [(12, 4), (8, 2), (6, 6), (5, 1)])
def test_every_fragment_is_synchronised_once_per_round(every, count):
    rounds = 3
    seen: dict[int, list[int]] = {k: [] for k in range(count)}
    for step in range(1, rounds * every + 1):
        for k in fragments_due(step, every, count):
            seen[k].append(step)
    period = every // count
    for k, steps in seen.items():
        assert len(steps) == rounds
        assert steps[0] == (k + 1) * period  # staggered by H/F
        assert all(b - a == every for a, b in zip(steps, steps[1:], strict=False))
    assert seen[count - 1] == [every * (r + 1) for r in range(rounds)]  # DiLoCo's steps
    assert fragments_due(0, every, count) == []


def _train(comm, cfg: StrategyConfig, steps: int) -> dict:
    torch.set_num_threads(1)
    model = build_model(TOY)
    opt = diloco_inner(model)
    ctx = dist_context(comm)
    if cfg.name == "streaming_diloco":
        strategy = StreamingDiLoCo(model, model, opt, ctx, cfg)
    else:
        strategy = LocalSteps(model, model, opt, ctx, cfg, cfg.name)
    params, anchors = [], []
    for step in range(steps):
        toy_loss(model, comm.rank, step).backward()
        strategy.step()
        opt.zero_grad(set_to_none=True)
        strategy.after_step(step + 1)
        params.append(flat_params(model).clone())
        anchors.append(strategy.anchor.clone())
    return {"params": params, "anchors": anchors}


STREAMING = {"name": "streaming_diloco", "outer_every": 4, "fragments": 2,
             "fragment_sync_delay": 1, "fragment_mix": 0.5}  # fmt: skip


def _runs(comm, steps: int) -> dict:
    return {
        "diloco": _train(comm, StrategyConfig(name="diloco", outer_every=3), steps),
        "one_fragment": _train(
            comm,
            StrategyConfig(
                name="streaming_diloco",
                outer_every=3,
                fragments=1,
                fragment_sync_delay=0,
                fragment_mix=0.0,
            ),  # fmt: skip
            steps,
        ),
        "streaming": _train(comm, StrategyConfig(**STREAMING), steps),
    }


def _simulate(world: int, steps: int, every: int, count: int, delay: int, mix: float) -> list:
    """One process: ``world`` models with their own AdamW; fragment k's values averaged at
    its due steps and, ``delay`` steps later, torch.optim.SGD (Nesterov, lr 0.7, momentum
    0.9) on (anchor - that average), then the merge. The parameters after every step."""
    workers = [build_model(TOY) for _ in range(world)]
    inner = [diloco_inner(m) for m in workers]
    tensors = [list(m.parameters()) for m in workers]
    bounds = split_fragments([p.numel() for p in tensors[0]], count)
    anchors = [[nn.Parameter(p.detach().clone()) for p in tensors[0][a:b]] for a, b in bounds]
    outer = [torch.optim.SGD(a, lr=0.7, momentum=0.9, nesterov=True) for a in anchors]
    pending: dict[int, tuple[int, list[torch.Tensor]]] = {}
    out = []
    for step in range(1, steps + 1):
        for rank, (model, opt) in enumerate(zip(workers, inner, strict=True)):
            toy_loss(model, rank, step - 1).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        landing = [k for k, (at, _) in pending.items() if at == step]
        due = fragments_due(step, every, count)
        for k in due:
            a, b = bounds[k]
            mean = [torch.stack([t[i].detach() for t in tensors]).mean(0) for i in range(a, b)]
            pending[k] = (step + delay, mean)
        for k in sorted(landing) + ([k for k in due if delay == 0]):
            _, mean = pending.pop(k)
            for anchor, m in zip(anchors[k], mean, strict=True):
                anchor.grad = anchor.detach() - m
            outer[k].step()
            a, b = bounds[k]
            with torch.no_grad():
                for t in tensors:
                    for anchor, p in zip(anchors[k], t[a:b], strict=True):
                        p.mul_(mix).add_(anchor, alpha=1 - mix)
        out.append(flat_params(workers[0]).clone())
    return out


def test_one_fragment_is_diloco_and_fragments_follow_the_simulation():
    steps = 12
    ranks = run_ranks(_runs, 2, steps)
    for rank in ranks:
        for a, b in zip(rank["diloco"]["params"], rank["one_fragment"]["params"], strict=True):
            assert torch.equal(a, b)
    want = _simulate(2, steps, 4, 2, 1, 0.5)
    for step, (got, expected) in enumerate(zip(ranks[0]["streaming"]["params"], want,
                                               strict=True)):  # fmt: skip
        torch.testing.assert_close(got, expected, rtol=0, atol=3e-6, msg=f"step {step + 1}")
    # the anchors agree on every rank; the ranks' models differ (mixing keeps local parts)
    for a, b in zip(ranks[0]["streaming"]["anchors"], ranks[1]["streaming"]["anchors"],
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)
    assert not torch.equal(ranks[0]["streaming"]["params"][-1], ranks[1]["streaming"]["params"][-1])
    # and delay or mixing change the trajectory
    assert not torch.allclose(want[-1], _simulate(2, steps, 4, 2, 0, 0.0)[-1], atol=1e-4)


def _pretrain(corpus, run_dir, **extra) -> dict:
    overrides = {"optimizer.name": "adamw", "optimizer.lr": 0.003,
                 "strategy.name": "streaming_diloco", "strategy.outer_every": 4,
                 "strategy.fragments": 2, "strategy.fragment_sync_delay": 1,
                 "schedule.max_steps": 12, "checkpoint.every": 4,
                 "data.validation_every": 5, **extra}  # fmt: skip
    return tiny_config(corpus, run_dir, **overrides)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"strategy.outer_every": 6, "strategy.fragments": 4}, "multiple of strategy.fragments"),
        ({"strategy.fragment_sync_delay": 2}, r"fragment_sync_delay must be in \[0, "),
        ({"strategy.fragment_mix": 1.0}, r"fragment_mix must be in \[0, 1\)"),
        ({"strategy.inner_state": "reset"}, "keeps the inner optimizer's state"),
        ({"strategy.name": "diloco"}, "fragments"),
        ({"optimizer.name": "sgd"}, "needs optimizer.name lamb or adamw"),
    ],
)
def test_bad_streaming_configs_fail_at_load(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        from_dict(PretrainConfig, _pretrain(tmp_path, tmp_path / "run", **overrides))


@pytest.mark.slow
def test_killed_run_resumes_with_a_fragment_in_flight_bit_exact(tiny_corpus, tmp_path):
    """Fragments sync at steps 2, 4, 6, ..., each landing a step later; the checkpoint at
    step 8 holds fragment 1's average, started at step 8. Kill -9 after it, resume: the
    same weights, anchors, momentum, inner state and losses as the uninterrupted run."""
    torchrun_to_end(write_cfg(_pretrain(tiny_corpus, tmp_path / "a"), tmp_path / "a.yaml"))
    path_b = write_cfg(_pretrain(tiny_corpus, tmp_path / "b"), tmp_path / "b.yaml")
    run_killing_after_checkpoints(path_b, tmp_path / "b", [8], 12)
    shared, _ = load_checkpoint(tmp_path / "a", 8)
    in_flight = shared["streaming"]["in_flight"]
    assert list(in_flight) == [1] and in_flight[1]["apply_at"] == 9
    assert_same_local_step_runs(
        tmp_path / "a", tmp_path / "b", (8, 12), ("model", "local_steps", "streaming"),
        ("loss", "val_mlm_loss", "fragment_syncs", "outer_momentum_norm"),
    )  # fmt: skip
