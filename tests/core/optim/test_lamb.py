"""LAMB against values worked out by hand and against a scalar re-implementation."""

from __future__ import annotations

import math

import pytest
import torch

from onebit_bert.optim import Lamb


def _one_step(w, g, **kw):
    p = torch.nn.Parameter(torch.tensor(w, dtype=torch.float32))
    opt = Lamb([p], **kw)
    p.grad = torch.tensor(g, dtype=torch.float32)
    opt.step()
    return p.detach(), opt.last_trust_ratios


# Step 1 with g = (1, 1): m = 0.1·g, v = 0.001·g², so u = 0.1/sqrt(0.001) = sqrt(10) per
# element (eps is negligible), ‖u‖ = sqrt(20), and the step is lr·r·sqrt(10).
@pytest.mark.parametrize(
    "w,expected_ratio",
    [
        ([3.0, 4.0], 5 / math.sqrt(20)),  # r = ‖w‖/‖u‖ = sqrt(5)/2
        ([30.0, 40.0], 10.0),  # 50/sqrt(20) = 11.18 -> clamped to max_coeff
        ([0.003, 0.004], 0.01),  # 0.005/sqrt(20) -> clamped to min_coeff
        ([0.0, 0.0], 1.0),  # zero weight norm -> r = 1
    ],
)
def test_first_step_by_hand(w, expected_ratio):
    new, ratios = _one_step(w, [1.0, 1.0], lr=0.1)
    step = 0.1 * expected_ratio * math.sqrt(10)
    torch.testing.assert_close(new, torch.tensor(w) - step, rtol=1e-6, atol=1e-6)
    assert ratios.item() == pytest.approx(expected_ratio, rel=1e-6)


def test_zero_gradient_gives_ratio_one_and_no_nan():
    new, ratios = _one_step([3.0, 4.0], [0.0, 0.0], lr=0.1)
    assert torch.equal(new, torch.tensor([3.0, 4.0]))
    assert ratios.item() == 1.0


def test_weight_decay_by_hand():
    # u = sqrt(10)·(1,1) + 0.1·(3,4); r = 5/‖u‖; w' = w - lr·r·u
    u = [math.sqrt(10) + 0.3, math.sqrt(10) + 0.4]
    r = 5 / math.hypot(*u)
    new, _ = _one_step([3.0, 4.0], [1.0, 1.0], lr=0.1, weight_decay=0.1)
    torch.testing.assert_close(new, torch.tensor([3 - 0.1 * r * u[0], 4 - 0.1 * r * u[1]]))


def test_bias_correction_by_hand():
    # Step 1 with bias correction: m̂ = g, v̂ = g², u = g/|g| + wd·w = (1 + 0.3, -1 + 0.4).
    u = [1.3, -0.6]
    r = 5 / math.hypot(*u)
    new, _ = _one_step([3.0, 4.0], [2.0, -0.5], lr=0.1, weight_decay=0.1, bias_correction=True)
    torch.testing.assert_close(new, torch.tensor([3 - 0.1 * r * u[0], 4 - 0.1 * r * u[1]]))


def _scalar_lamb(ws, grads_per_step, lr, b1, b2, eps, wd, lo, hi, bias_correction):
    """LAMB written with Python floats, one layer at a time."""
    ws = [list(w) for w in ws]
    ms = [[0.0] * len(w) for w in ws]
    vs = [[0.0] * len(w) for w in ws]
    for t, grads in enumerate(grads_per_step, start=1):
        for w, m, v, g in zip(ws, ms, vs, grads, strict=True):
            u = []
            for i in range(len(w)):
                m[i] = b1 * m[i] + (1 - b1) * g[i]
                v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
                mh, vh = (
                    (m[i] / (1 - b1**t), v[i] / (1 - b2**t)) if bias_correction else (m[i], v[i])
                )
                u.append(mh / (math.sqrt(vh) + eps) + wd * w[i])
            wn = math.sqrt(sum(x * x for x in w))
            un = math.sqrt(sum(x * x for x in u))
            r = min(max(wn / un, lo), hi) if wn > 0 and un > 0 else 1.0
            for i in range(len(w)):
                w[i] -= lr * r * u[i]
    return ws


@pytest.mark.parametrize("bias_correction", [False, True])
def test_several_steps_match_scalar_reference(bias_correction):
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (1,)]
    init = [torch.randn(s, generator=g) for s in shapes]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = Lamb(
        [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}],
        lr=0.05,
        weight_decay=0.01,
        bias_correction=bias_correction,
    )
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    for step_grads in grads:
        for p, gr in zip(params, step_grads, strict=True):
            p.grad = gr.clone()
        opt.step()
    common = dict(
        lr=0.05, b1=0.9, b2=0.999, eps=1e-8, lo=0.01, hi=10.0, bias_correction=bias_correction
    )
    flat = lambda ts: [t.reshape(-1).double().tolist() for t in ts]  # noqa: E731
    expected = _scalar_lamb(flat(init[:2]), [flat(s[:2]) for s in grads], wd=0.01, **common)
    expected += _scalar_lamb(flat(init[2:]), [flat(s[2:]) for s in grads], wd=0.0, **common)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(
            p.detach().reshape(-1).double(),
            torch.tensor(e, dtype=torch.float64),
            rtol=1e-5,
            atol=1e-6,
        )


def test_params_without_grad_are_skipped():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(2))
    opt = Lamb([a, b], lr=0.1)
    a.grad = torch.ones(3)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(2)) and b not in opt.state
    assert not opt.syncs_internally


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(eps=0.0), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(min_coeff=2.0, max_coeff=1.0), "min_coeff"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Lamb([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_rejects_integer_params_and_sparse_grads():
    with pytest.raises(TypeError, match="floating-point"):
        Lamb([torch.zeros(3, dtype=torch.long)])
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = Lamb(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse=False"):
        opt.step()


def test_state_of_a_different_model_is_refused():
    a = torch.nn.Parameter(torch.ones(4))
    opt = Lamb([a])
    a.grad = torch.ones(4)
    opt.step()
    with pytest.raises(ValueError, match="different model"):
        Lamb([torch.nn.Parameter(torch.ones(5))]).load_state_dict(opt.state_dict())
