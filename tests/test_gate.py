"""The parity gate and the target selection on synthetic numbers."""

from __future__ import annotations

import math
import random

import pytest

from pipeline import gate
from pipeline.stats import t_cdf, t_quantile


def test_t_cdf_and_quantile_invert_each_other():
    assert t_quantile(0.95, 4) == pytest.approx(2.1318, abs=1e-4)  # one-sided 5 % critical value
    assert t_quantile(0.05, 4) == pytest.approx(-2.1318, abs=1e-4)
    for df in (1, 3.5, 30):
        for p in (0.1, 0.5, 0.9, 0.99):
            assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-9)


def test_samples_to_target_interpolates_and_reports_a_miss():
    curve = [(0, 8.0), (100, 6.0), (200, 4.0), (300, 3.0)]
    assert gate.samples_to_target(curve, 5.0) == pytest.approx(150.0)
    assert gate.samples_to_target(curve, 6.0) == 100.0
    assert gate.samples_to_target(curve, 9.0) == 0.0
    assert gate.samples_to_target(curve, 2.9) is None


def test_target_is_the_worst_reference_seed_at_the_fraction():
    curves = {
        "seed1": [(0, 8.0), (800, 3.0), (1000, 2.9)],
        "seed2": [(0, 8.0), (800, 3.2), (1000, 3.0)],
        "seed3": [(0, 8.0), (400, 3.1), (800, 3.1), (1000, 3.1)],
    }
    target = gate.select_target(curves, at=800)
    assert target["value"] == 3.2 and target["worst"] == "seed2"
    # every reference seed reaches it by the point it was taken at
    for points in curves.values():
        reached = gate.samples_to_target(points, target["value"])
        assert reached is not None and reached <= 800
    # interpolated between validation points
    assert gate.select_target({"a": [(0, 4.0), (1000, 2.0)]}, at=800)["value"] == pytest.approx(2.4)
    with pytest.raises(ValueError, match="let every reference run finish"):
        gate.select_target({"short": [(0, 8.0), (500, 4.0)]}, at=800)


def test_gate_known_t_statistic_and_undecided_with_seeds_needed():
    reference = [100.0, 110.0, 120.0, 130.0, 140.0]  # mean 120, variance 250
    candidate = [110.0, 115.0, 120.0, 125.0, 130.0]  # mean 120, variance 62.5
    result = gate.gate(reference, candidate, margin=0.05)
    # D = 120 - 1.05 * 120 = -6; se^2 = 1.05^2 * 250 / 5 + 62.5 / 5 = 67.625
    assert result.difference == pytest.approx(-6.0)
    assert result.standard_error == pytest.approx(math.sqrt(67.625))
    assert result.t == pytest.approx(-6.0 / math.sqrt(67.625))
    assert result.df == pytest.approx(67.625**2 / (55.125**2 / 4 + 12.5**2 / 4))
    assert result.verdict == "undecided"
    # n = (1.6449 + 0.8416)^2 (62.5 + 1.05^2 * 250) / 6^2 = 58.07 -> 59
    assert result.seeds_needed == 59
    assert "54 more seed(s) per arm" in result.reason
    assert "no significant difference" not in result.reason


def test_gate_pass_and_fail():
    reference = [1000.0, 1010.0, 990.0, 1005.0, 995.0]
    close = [1000.0, 1002.0, 998.0, 1001.0, 999.0]
    slow = [1100.0, 1102.0, 1098.0, 1101.0, 1099.0]
    passed = gate.gate(reference, close)
    assert passed.verdict == "pass" and passed.upper_bound < 0 and passed.p_pass < 0.05
    failed = gate.gate(reference, slow)
    assert failed.verdict == "fail" and failed.lower_bound > 0 and failed.p_fail < 0.05
    # the same numbers with fewer seeds than the protocol asks for do not decide
    few = gate.gate(reference[:3], close[:3])
    assert few.verdict == "undecided" and "5 seeds per arm" in few.reason


def test_a_run_that_never_reaches_the_target_fails_the_gate():
    reference = [1000.0, 1010.0, 990.0, 1005.0, 995.0]
    result = gate.gate(reference, [1000.0, None, 998.0, 1001.0, 999.0])
    assert result.verdict == "fail"
    assert "1 of 5 candidate seed(s) never reached the target" in result.reason
    with pytest.raises(ValueError, match="every reference seed reaches"):
        gate.gate([1000.0, None], [1000.0, 1000.0])


def test_seeds_needed_matches_the_planning_formula():
    # spec: n = 2 (2.486 sigma / delta)^2: sigma / delta = 1 -> about 12 per arm
    assert gate.seeds_needed(1.0, 1.0, 1.0, scale=1.0) == math.ceil(2 * 2.4865**2)
    assert gate.seeds_needed(0.5, 0.5, 1.0, scale=1.0) == math.ceil(2 * 2.4865**2 / 4)
    assert gate.seeds_needed(1.0, 1.0, 0.0, scale=1.0) is None


def test_stated_power_matches_simulation():
    """Both arms truly equal (mean 1000, std 30): the share of simulated experiments that
    pass the 5 % gate is the stated power (the t-test is a little more conservative than the
    normal approximation, hence the tolerance)."""
    rng = random.Random(7)
    n, mean, std = 8, 1000.0, 30.0
    passes = 0
    trials = 1000
    for _ in range(trials):
        reference = [rng.gauss(mean, std) for _ in range(n)]
        candidate = [rng.gauss(mean, std) for _ in range(n)]
        result = gate.gate(reference, candidate, min_seeds=n)
        passes += result.verdict == "pass"
    # the power at the true values: se = std sqrt((1.05^2 + 1) / n)
    se = std * math.sqrt((1.05**2 + 1) / n)
    expected = gate._NORMAL.cdf(0.05 * mean / se - gate._NORMAL.inv_cdf(0.95))
    assert 0.5 < expected < 0.95
    assert passes / trials == pytest.approx(expected, abs=0.08)
    # and the stated power of one experiment uses the same formula on observed values
    one = gate.gate([mean - std, mean, mean + std] * 2, [mean] * 6, min_seeds=6)
    se_one = math.sqrt(1.05**2 * std**2 * 0.8 / 6)  # sample variance of the reference: 0.8 std^2
    assert one.power == pytest.approx(gate._NORMAL.cdf(0.05 * mean / se_one - 1.6449), abs=1e-3)


def test_difference_interval_covers_the_welch_interval():
    out = gate.difference_interval([3.0, 3.1, 2.9], [3.2, 3.3, 3.1])
    assert out["difference"] == pytest.approx(0.2)
    half = t_quantile(0.975, out["df"]) * math.sqrt(0.01 / 3 + 0.01 / 3)
    assert out["low"] == pytest.approx(0.2 - half) and out["high"] == pytest.approx(0.2 + half)
    assert gate.difference_interval([3.0], [3.1])["low"] is None
