"""The mechanism analysis: the noise-scale estimator on gradients with a known noise, and
the per-layer figures of a checkpoint against the optimizers' own numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from onebit_bert.optim import Lamb
from onebit_bert.optim.build import weight_decay_groups
from pipeline.reports.mechanism import (
    estimate_noise_scale,
    interval_means,
    layer_statistics,
    pair_cosines,
    pairs,
    plot,
    preconditioner_cosines,
)
from pipeline.reports.mechanism_pairs import analyse, critical_r
from pipeline.reports.mechanism_pairs import main as mechanism_pairs_main


def test_noise_scale_estimator_recovers_a_known_noise():
    torch.manual_seed(0)
    dims, b, k = 2000, 8, 64
    true_grad = torch.full((dims,), 0.05)  # |G|^2 = 5
    per_example_sd = 0.5  # tr(Sigma) = dims * 0.25 = 500, so B_simple = 100
    grads = true_grad + per_example_sd / b**0.5 * torch.randn(k, dims)
    out = estimate_noise_scale(grads, b)
    assert out["big_batch"] == b * k
    assert out["trace_sigma"] == pytest.approx(500, rel=0.05)
    assert out["grad_norm_sq"] == pytest.approx(5, rel=0.1)
    assert out["b_simple"] == pytest.approx(100, rel=0.12)
    with pytest.raises(ValueError, match="micro-batches >= 2"):
        estimate_noise_scale(grads[:1], b)


def test_layer_statistics_give_lambs_own_trust_ratios():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 2))
    groups = weight_decay_groups(model.named_parameters(), 0.01)
    opt = Lamb(groups, lr=0.01, eps=1e-6, weight_decay=0.01, max_coeff=0.3, min_coeff=0.01)
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    # the ratio of the last step: its state (m, v) with the weights it was applied to
    state = {"model": before, "optimizer": opt.state_dict()}
    names = {id(p): n for n, p in model.named_parameters()}
    order = [(names[id(p)], g["weight_decay"]) for g in groups for p in g["params"]]
    rows = layer_statistics(state, order)
    ratios = torch.tensor([rows[n]["lamb_ratio"] for n, _ in order])
    torch.testing.assert_close(ratios, opt.last_trust_ratios, rtol=1e-5, atol=0)
    assert all("cf" not in row for row in rows.values())
    assert all("moved" not in row for row in rows.values())  # no checkpoint before
    sd = opt.state_dict()["state"]
    for index, (n, _) in enumerate(order):  # the second moment's size, in the same order
        assert rows[n]["sqrt_v"] == pytest.approx(float(sd[index]["exp_avg_sq"].sqrt().norm()))
    # how far each layer went from an earlier checkpoint's weights
    earlier = {n: w + 0.5 for n, w in before.items()}
    moved = layer_statistics(state, order, earlier)
    for n, w in before.items():
        expected = float((w - earlier[n]).norm() / earlier[n].norm())
        assert moved[n]["moved"] == pytest.approx(expected, rel=1e-6)
    # a checkpoint of another model is refused, not misread
    with pytest.raises(ValueError, match="was not written by this model"):
        layer_statistics(state, list(reversed(order)))


def _run(name, freeze, batch, layers):
    return {"name": name, "freeze_step": freeze, "global_batch_size": batch,
            "max_steps": 100, "layers": layers}  # fmt: skip


def test_each_onebit_run_is_set_against_the_lamb_run_of_its_batch_by_median_ratios():
    ref = {"a": {"step": 1.0, "mv": 2.0, "w": 1.0}, "b": {"step": 2.0, "mv": 2.0, "w": 1.0},
           "c": {"step": 4.0, "mv": 0.0, "w": 1.0}}  # fmt: skip
    cand = {"a": {"step": 3.0, "mv": 8.0, "w": 2.0}, "b": {"step": 2.0, "mv": 4.0, "w": 2.0},
            "c": {"step": 40.0, "mv": 5.0, "w": 2.0}}  # fmt: skip
    runs = [
        _run("lamb_b512", None, 512, {"10": ref}),
        _run("lamb", None, 128, {"10": ref, "20": ref}),
        _run("onebit", 5, 128, {"10": cand, "30": cand}),
    ]
    (pair,) = pairs(runs)
    assert (pair["candidate"], pair["reference"]) == ("onebit", "lamb")  # same batch
    assert list(pair["ratios"]) == ["10"]  # only the checkpoints both kept
    row = pair["ratios"]["10"]
    assert row["step"] == 3.0  # median of 3, 1, 10
    assert row["mv"] == 3.0  # median of 4, 2; layer c left out (the reference's 0)
    assert row["w"] == 2.0 and "moved" not in row
    assert pairs(runs[:2]) == []  # no 1-bit LAMB run: nothing to pair


def _state(m: list[torch.Tensor], v: list[torch.Tensor]) -> dict:
    entries = enumerate(zip(m, v, strict=True))
    return {"state": {i: {"exp_avg": a, "exp_avg_sq": b} for i, (a, b) in entries},
            "param_groups": [{"eps": 0.0}]}  # fmt: skip


def test_a_second_moment_that_lags_by_one_factor_per_layer_turns_nothing(tmp_path):
    torch.manual_seed(2)
    m = [torch.randn(30), torch.randn(4, 5)]
    v = [torch.rand(30) + 0.1, torch.rand(4, 5) + 0.1]
    lagging = _state(m, [v[0] / 9, v[1] / 25])  # one factor per layer: no turn
    out = preconditioner_cosines(_state(m, v), lagging, eps=0.0)
    assert out == pytest.approx({"v_cos": 1.0, "v_cos_reference": 1.0})
    # per-coordinate lags turn the direction: the element-weighted mean of the layers' cosines
    turned = [v[0] * torch.linspace(0.1, 10, 30), v[1]]
    cand, ref = _state([m[0] * 2, m[1]], turned), _state(m, v)
    out = preconditioner_cosines(ref, cand, eps=0.0)
    first = m[0] / turned[0].sqrt(), m[0] / v[0].sqrt()
    cos = float((first[0] @ first[1]) / (first[0].norm() * first[1].norm()))
    assert cos < 0.95
    assert out["v_cos"] == pytest.approx((30 * cos + 20 * 1.0) / 50, rel=1e-6)
    assert out["v_cos_reference"] == pytest.approx(out["v_cos"], rel=1e-6)  # m scaled by 2
    with pytest.raises(ValueError, match="not one model"):
        preconditioner_cosines(ref, _state([m[1], m[0]], [v[1], v[0]]), eps=0.0)
    # read from two runs' kept checkpoints after the candidate's freeze, those both kept
    for run, steps in (("lamb", (10, 20, 30)), ("onebit", (10, 20, 40))):
        for step in steps:
            folder = tmp_path / run / "checkpoints" / f"step_{step:08d}"
            folder.mkdir(parents=True)
            (folder / "complete.json").write_text("{}")
            torch.save({"optimizer": ref if run == "lamb" else cand}, folder / "shared.pt")
    reference = {"run_dir": str(tmp_path / "lamb")}
    candidate = {"run_dir": str(tmp_path / "onebit"), "freeze_step": 15}
    assert pair_cosines(reference, candidate) == {20: out}


def test_logged_figures_are_averaged_over_the_steps_since_the_last_checkpoint():
    records = [{"step": s, "compression_error": float(s), "factor_mean": 1.0} for s in range(1, 11)]
    records[2]["compression_error"] = float("nan")  # step 3: a non-finite value is left out
    records[5]["grad_norm"] = 9.0  # step 6: a spike
    records[6]["grad_norm"] = 1.0  # step 7
    records.append({"step": 10, "val_mlm_loss": 3.0})  # a validation record adds nothing
    out = interval_means(records, [4, 10, 12])
    assert out[4] == {"compression_error": (1 + 2 + 4) / 3, "factor_mean": 1.0}
    assert out[10]["compression_error"] == sum(range(5, 11)) / 6
    assert out[10]["grad_norm"] == 5.0 and out[10]["grad_norm_max"] == 9.0
    assert "trust_ratio_mean" not in out[4]  # not logged: not invented
    assert out[12] == {}  # no records in (10, 12]


def _mechanism(seed_moved: dict, seed_error: float) -> dict:
    return {
        "runs": [
            {"name": "lamb", "medians": {"1500": {"lamb_ratio": 0.3}}, "intervals": {}},
            {
                "name": "onebit_lamb",
                "medians": {"1500": {"cf": 0.12}},
                "intervals": {"1500": {"compression_error": seed_error}},
            },
        ],  # fmt: skip
        "pairs": [{"candidate": "onebit_lamb", "reference": "lamb", "ratios": seed_moved}],
    }


def _gate(seeds, logs):
    return {"gate": {"gates": {"onebit_lamb": {"seeds": seeds, "log_ratios": logs}}}}


def test_pair_figures_are_correlated_with_the_gates_log_ratios(tmp_path):
    logs = [0.15, 0.10, -0.04, -0.09, 0.09]
    moved = [1.0 - 0.5 * v for v in logs]  # exactly linear: r = -1
    error = [1.5, 1.9, 1.6, 1.8, 1.7]
    mechs = {
        seed: _mechanism({"1500": {"moved": m, "step": 2.0}, "1250": {"moved": 1.0}}, e)
        for seed, m, e in zip(range(1, 6), moved, error, strict=True)
    }
    turn = [0.91, 0.92, 0.96, 0.93, 0.91]  # the preconditioner cosines, where a report has them
    for mech, c in zip(mechs.values(), turn, strict=True):
        mech["pairs"][0]["cosines"] = {"1500": {"v_cos": c, "v_cos_reference": 0.9}}
    out = analyse(_gate([1, 2, 3, 4, 5], logs), "onebit_lamb", mechs, "onebit_lamb")
    assert out["figures"]["v_cos"][1500]["values"] == turn
    assert out["figures"]["v_cos"][1500]["r"] == pytest.approx(float(np.corrcoef(turn, logs)[0, 1]))
    assert out["figures"]["v_cos_reference"][1500]["r"] is None
    assert out["critical_r"] == pytest.approx(0.8783, abs=1e-4)  # tabled value for n = 5
    assert out["figures"]["moved"][1500]["r"] == pytest.approx(-1.0)
    assert out["figures"]["moved"][1250]["r"] is None  # no spread: no correlation
    assert out["figures"]["step"][1500]["r"] is None
    assert out["figures"]["compression_error"][1500]["r"] == pytest.approx(
        float(np.corrcoef(error, logs)[0, 1])
    )
    assert out["figures"]["lamb_ratio"][1500]["values"] == [0.3] * 5
    # one pair's seed the gate does not have, a gate that is not paired, a missing candidate
    with pytest.raises(ValueError, match=r"no pair for seed\(s\) \[5\]"):
        analyse(_gate([1, 2, 3, 4], logs[:4]), "onebit_lamb", mechs, "onebit_lamb")
    with pytest.raises(ValueError, match="not a paired one"):
        analyse({"gate": {"gates": {"onebit_lamb": {"verdict": "pass"}}}}, "onebit_lamb", mechs,
                "onebit_lamb")  # fmt: skip
    with pytest.raises(ValueError, match="pass --candidate"):
        analyse(_gate([1, 2, 3, 4, 5], logs), "onebit_lamb", mechs, "other")
    with pytest.raises(ValueError, match="at least 3 pairs"):
        critical_r(2)
    # the command line: mechanism reports in folders, a gate report, one table per figure
    for seed, mech in mechs.items():
        (tmp_path / f"p{seed}").mkdir()
        (tmp_path / f"p{seed}" / "mechanism.json").write_text(json.dumps(mech))
    gate = tmp_path / "report.json"
    gate.write_text(json.dumps(_gate([1, 2, 3, 4, 5], logs)))
    argv = ["--gate", str(gate), "--arm", "onebit_lamb", "--out", str(tmp_path / "out")]
    argv += [a for s in mechs for a in ("--run", f"{s}={tmp_path / f'p{s}'}")]
    assert mechanism_pairs_main(argv) == 0
    text = (tmp_path / "out" / "pairs.md").read_text()
    assert "## moved" in text and "| r | | +0.00" not in text and "| 1 | 1.162 |" in text
    assert mechanism_pairs_main(argv[:-2] + ["--run", f"6={tmp_path / 'none'}"]) == 2


def test_the_figures_are_written_for_runs_of_two_batches(tmp_path):
    lamb_rows = {s: {"lamb_ratio": 0.3, "mv": 2.0, "step": 0.5, "moved": 0.1} for s in (250, 500)}
    onebit_rows = {s: {**row, "cf": 0.1} for s, row in lamb_rows.items()}
    runs = [
        {"name": "lamb", "global_batch_size": 128, "freeze_step": None, "medians": lamb_rows,
         "noise": [{"step": 250, "b_simple": 400.0}, {"step": 500, "b_simple": 900.0}]},
        {"name": "onebit_lamb_b512", "global_batch_size": 512, "freeze_step": 100,
         "medians": onebit_rows, "noise": []},
    ]  # fmt: skip
    assert plot(runs, tmp_path) == ["trust.png", "noise.png"]
    assert all((tmp_path / name).stat().st_size > 0 for name in ("trust.png", "noise.png"))
    assert plot([{**runs[1], "noise": []}], tmp_path / ".") == ["trust.png"]  # no noise: one
