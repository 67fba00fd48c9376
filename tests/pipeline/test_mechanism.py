"""The mechanism analysis: the noise-scale estimator on gradients with a known noise, and
the per-layer figures of a checkpoint against the optimizers' own numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from onebit_bert.optim import Lamb
from onebit_bert.optim.build import weight_decay_groups
from pipeline.reports.mechanism import estimate_noise_scale, layer_statistics, pairs


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
