"""``freeze_step: auto``: the detector's rule and bounds, the same decision on every rank,
an automatic freeze equal to the fixed freeze_step it chose (1-bit LAMB and 1-bit Adam),
the decision restored on resume, and config checks. (A pretraining run with it, killed and
resumed, is in tests/core/optim/test_onebit_adam.py.)"""

from __future__ import annotations

import pytest
import torch

from onebit_bert.config import ConfigError, from_dict
from onebit_bert.optim import OneBitAdam, OneBitLamb
from onebit_bert.optim.auto_freeze import AutoFreezeConfig, FreezeDetector
from pretrain.config import PretrainConfig
from tests.helpers.compression import init_params, load_toy_state, param_groups, toy_steps
from tests.helpers.distributed_harness import run_ranks


def _feed(detector, norms_by_step, steps, first=1):
    """Observe steps first..steps with two layers: v of layer 0 has the given norm at each
    step (1.0 where none is given), layer 1 stays at norm 1."""
    decided = []
    for step in range(first, steps + 1):
        v = [torch.tensor([norms_by_step.get(step, 1.0)]), torch.tensor([0.6, 0.8])]
        if detector.observe(step, v):
            decided.append(step)
    return decided


# checks every 2 steps; relative changes 1.0, 0.05, 0.024, 0.0046 at steps 4, 6, 8, 10
NORMS = {2: 1.0, 4: 2.0, 6: 2.1, 8: 2.15, 10: 2.16, 12: 2.16}


def test_freezes_after_patience_calm_checks():
    detector = FreezeDetector(window=2, threshold=0.1, patience=2, min_step=1, max_step=100)
    assert _feed(detector, NORMS, 12) == [8]
    assert detector.freeze_step == 8
    assert detector.statistic == pytest.approx(0.05 / 2.1, rel=1e-5)


def test_waits_for_the_minimum_and_stops_at_the_maximum():
    late = FreezeDetector(window=2, threshold=0.1, patience=2, min_step=9, max_step=100)
    assert _feed(late, NORMS, 12) == [10]  # calm since step 8, allowed from step 9
    restless = FreezeDetector(window=2, threshold=0.1, patience=2, min_step=1, max_step=7)
    assert _feed(restless, {s: 2.0**s for s in range(1, 12)}, 12) == [7]  # not a check step


def test_a_jump_resets_the_calm_count_and_zero_layers_count_as_calm():
    detector = FreezeDetector(window=1, threshold=0.1, patience=2, min_step=1, max_step=100)
    norms = {1: 1.0, 2: 1.01, 3: 2.0, 4: 2.01, 5: 2.02}
    assert _feed(detector, norms, 6) == [5]  # calm at 2, restless at 3, calm at 4 and 5
    zero = FreezeDetector(window=1, threshold=0.1, patience=1, min_step=1, max_step=100)
    assert not zero.observe(1, [torch.zeros(3)])
    assert zero.observe(2, [torch.zeros(3)]) and zero.statistic == 0.0
    moving = FreezeDetector(window=1, threshold=0.1, patience=1, min_step=1, max_step=100)
    moving.observe(1, [torch.zeros(3)])
    assert not moving.observe(2, [torch.ones(3)]) and moving.statistic == float("inf")


def test_detector_state_round_trip_decides_the_same():
    straight = FreezeDetector(window=2, threshold=0.1, patience=2, min_step=1, max_step=100)
    expected = _feed(straight, NORMS, 12)
    first = FreezeDetector(window=2, threshold=0.1, patience=2, min_step=1, max_step=100)
    _feed(first, {k: v for k, v in NORMS.items() if k <= 6}, 6)
    second = FreezeDetector(window=2, threshold=0.1, patience=2, min_step=1, max_step=100)
    second.load_state_dict(first.state_dict())
    assert _feed(second, NORMS, 12, first=7) == expected
    assert second.statistic == straight.statistic


def test_bias_correction_sees_through_v_filling_up_from_zero():
    """Gradients of constant size: v = (1 - beta2^t) g^2 grows for thousands of steps at
    beta2 = 0.999, while v / (1 - beta2^t) stays put. The corrected detector freezes after
    its patience; the uncorrected one cannot before about step 1,170."""

    def run(corrected):
        detector = FreezeDetector(100, 0.05, 3, 1, 10_000, bias_corrected=corrected)
        for step in range(1, 3001):
            v = [torch.full((4,), (1 - 0.999**step) * 2.5)]
            if detector.observe(step, v, beta2=0.999):
                return step
        return None

    assert run(True) == 400  # checks at 100 (first), 200, 300, 400: three calm ones
    late = run(False)
    assert late is not None and late > 1170


def test_bounds_are_fractions_of_the_run():
    detector = AutoFreezeConfig().detector(total_steps=7038)
    assert (detector.min_step, detector.max_step) == (352, 1759)
    assert (detector.window, detector.threshold, detector.patience) == (100, 0.05, 3)
    with pytest.raises(ValueError, match="total_steps=schedule.max_steps"):
        AutoFreezeConfig().detector(total_steps=None)


# ----------------------------------------------------------------------------- optimizers

AUTO = AutoFreezeConfig(window=1, threshold=0.2, patience=2, min_fraction=0.1, max_fraction=0.75)
STEPS = 20


def _train(comm, cls, freeze_step, saves=(), state=None, start=0):
    params = [torch.nn.Parameter(t) for t in init_params()]
    kwargs = dict(comm=comm, lr=0.05, freeze_step=freeze_step, bucket_numel=64)
    if freeze_step == "auto":
        kwargs.update(auto_freeze=AUTO, total_steps=STEPS)
    opt = cls(param_groups(params), **kwargs)
    if state is not None:
        load_toy_state(params, opt, state)
    blobs = toy_steps(comm, params, opt, start, STEPS, saves)
    return [p.detach().clone() for p in params], opt, blobs


def _auto_versus_fixed(comm):
    out = {}
    for cls in (OneBitLamb, OneBitAdam):
        auto, opt, blobs = _train(comm, cls, "auto", saves=(4,))
        chosen = opt.freeze_step
        fixed, _, _ = _train(comm, cls, chosen)
        resumed, again, _ = _train(comm, cls, "auto", state=blobs[4], start=4)
        out[cls.__name__] = {
            "chosen": chosen,
            "statistic": opt.freeze_statistic,
            "same_as_fixed": all(torch.equal(a, b) for a, b in zip(auto, fixed, strict=True)),
            "resumed_same": all(torch.equal(a, b) for a, b in zip(auto, resumed, strict=True)),
            "resumed_chosen": again.freeze_step,
            "params": auto,
        }
    return out


def test_auto_freeze_equals_the_fixed_step_it_chose_on_every_rank():
    ranks = run_ranks(_auto_versus_fixed, 2)
    for name in ("OneBitLamb", "OneBitAdam"):
        mine = [r[name] for r in ranks]
        chosen = mine[0]["chosen"]
        assert 5 <= chosen < 15, (name, chosen)  # chosen by the rule, not by max_fraction
        assert mine[0]["statistic"] < AUTO.threshold
        for r in mine:
            assert r["chosen"] == chosen and r["statistic"] == mine[0]["statistic"]
            assert r["same_as_fixed"], name
            assert r["resumed_same"] and r["resumed_chosen"] == chosen, name
        for a, b in zip(mine[0]["params"], mine[1]["params"], strict=True):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------- configs


def test_auto_in_a_config():
    raw = {"optimizer": {"name": "onebit_lamb", "freeze_step": "auto"}}
    cfg = from_dict(PretrainConfig, raw)
    assert cfg.optimizer.freeze_step == "auto" and cfg.optimizer.auto_freeze.window == 100


@pytest.mark.parametrize(
    "auto_freeze,match",
    [
        ({"window": 0}, r"auto_freeze\.window must be a whole number of steps >= 1"),
        ({"threshold": 0}, r"auto_freeze\.threshold must be > 0"),
        ({"patience": 0}, r"auto_freeze\.patience must be >= 1"),
        ({"min_fraction": 0.3, "max_fraction": 0.2}, "min_fraction <= max_fraction"),
        ({"max_fraction": 1.5}, "max_fraction <= 1"),
    ],
)
def test_bad_auto_freeze_settings_name_the_field(auto_freeze, match):
    raw = {"optimizer": {"name": "onebit_adam", "freeze_step": "auto", "auto_freeze": auto_freeze}}
    with pytest.raises(ConfigError, match=match):
        from_dict(PretrainConfig, raw)
