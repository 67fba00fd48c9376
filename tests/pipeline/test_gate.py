"""The parity gate and the target selection on synthetic numbers."""

from __future__ import annotations

import json
import math
import random

import pytest

from pipeline.reports import gate
from pipeline.reports.stats import t_cdf, t_quantile
from pipeline.target import parse_utc, select_target


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
    target = select_target(curves, at=800)
    assert target["value"] == 3.2 and target["worst"] == "seed2"
    # every reference seed reaches it by the point it was taken at
    for points in curves.values():
        reached = gate.samples_to_target(points, target["value"])
        assert reached is not None and reached <= 800
    # interpolated between validation points
    assert select_target({"a": [(0, 4.0), (1000, 2.0)]}, at=800)["value"] == pytest.approx(2.4)
    with pytest.raises(ValueError, match="let every reference run finish"):
        select_target({"short": [(0, 8.0), (500, 4.0)]}, at=800)


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


# ---------------------------------------------------------------------------- the paired gate


def _pairs(log_ratios, base=500_000.0, spread=0.05):
    """Seed-matched samples to target whose log ratios are exactly ``log_ratios``; the
    reference varies from seed to seed as real seeds do."""
    reference = {k: base * (1 + spread * math.sin(k)) for k in range(1, len(log_ratios) + 1)}
    candidate = {k: reference[k] * math.exp(d) for k, d in zip(reference, log_ratios, strict=True)}
    return reference, candidate


def test_paired_gate_known_t_interval_and_verdicts():
    logs = [0.0, 0.01, -0.01, 0.02, -0.02]  # mean 0, sd sqrt(2.5e-4)
    result = gate.paired_gate(*_pairs(logs), planned_pairs=5)
    se = math.sqrt(2.5e-4) / math.sqrt(5)
    assert result.mean_log_ratio == pytest.approx(0.0, abs=1e-12)
    assert result.sd_log_ratio == pytest.approx(math.sqrt(2.5e-4))
    assert result.t == pytest.approx(-math.log(1.05) / se)
    assert result.df == 4
    q = 2.131847  # t(0.95, 4)
    assert result.ratio_high == pytest.approx(math.exp(q * se), rel=1e-6)
    assert result.ratio_low == pytest.approx(math.exp(-q * se), rel=1e-6)
    assert result.verdict == "pass"
    assert result.p_pass == pytest.approx(t_cdf(result.t, 4), abs=1e-9)
    # the same spread around a 10 % slowdown fails; around 5 % it is undecided
    assert gate.paired_gate(*_pairs([d + 0.1 for d in logs])).verdict == "fail"
    undecided = gate.paired_gate(*_pairs([d + math.log(1.05) for d in logs]))
    assert undecided.verdict == "undecided" and "straddles" in undecided.reason


def test_paired_gate_sees_what_welch_cannot():
    # Seeds vary by 10 % together; the candidate is 3 % slower than each of its twins.
    reference = {k: 500_000 * (1 + 0.1 * math.sin(3 * k)) for k in range(1, 6)}
    candidate = {k: v * math.exp(0.03 + 0.005 * (-1) ** k) for k, v in reference.items()}
    paired = gate.paired_gate(reference, candidate, planned_pairs=5)
    welch = gate.gate(list(reference.values()), list(candidate.values()))
    assert paired.verdict == "pass"
    assert welch.verdict == "undecided"
    assert paired.correlation > 0.99


def test_paired_gate_power_matches_simulation():
    rng = random.Random(0)
    n, sd = 5, 0.035
    stated = gate.paired_power(n, sd, 0.0)
    trials = 4000
    passed = 0
    for _ in range(trials):
        logs = [rng.gauss(0.0, sd) for _ in range(n)]
        passed += (
            gate.paired_gate(*_pairs(logs), planned_pairs=n, with_power=False).verdict == "pass"
        )
    assert stated == pytest.approx(0.817, abs=0.01)  # the planning figure in the config
    assert passed / trials == pytest.approx(stated, abs=0.025)  # 3.5 binomial sds
    # a true 10 % slowdown is failed with the power stated for it
    stated_fail = gate.paired_power(n, sd, 0.1)
    failed = sum(
        gate.paired_gate(*_pairs([rng.gauss(0.1, sd) for _ in range(n)]), with_power=False).verdict
        == "fail"
        for _ in range(trials)
    )
    assert failed / trials == pytest.approx(stated_fail, abs=0.025)


def test_pairs_needed_is_the_smallest_n_with_the_power():
    n = gate.pairs_needed(0.035)
    assert n == 5
    assert gate.paired_power(n, 0.035, 0.0) >= 0.8 > gate.paired_power(n - 1, 0.035, 0.0)
    assert gate.pairs_needed(0.07) > 10  # twice the spread: about four times the pairs
    assert gate.pairs_needed(0.035, math.log(1.05)) is None  # truth at the margin


def test_paired_gate_refuses_a_mismatched_pairing():
    reference, candidate = _pairs([0.0, 0.01, 0.02])
    candidate[7] = candidate.pop(3)
    with pytest.raises(ValueError, match=r"not seed-matched.*reference seed\(s\) \[3\].*"
                       r"candidate seed\(s\) \[7\]"):  # fmt: skip
        gate.paired_gate(reference, candidate)


def test_paired_gate_unreached_seed_fails_and_extra_pairs_are_refused():
    reference, candidate = _pairs([0.0, 0.01, -0.01, 0.02, -0.02])
    candidate[4] = None
    result = gate.paired_gate(reference, candidate, planned_pairs=5)
    assert result.verdict == "fail" and "[4]" in result.reason
    assert result.log_ratios[3] is None
    with pytest.raises(ValueError, match="fixed for 4"):
        gate.paired_gate(*_pairs([0.0, 0.01, -0.01, 0.02, -0.02]), planned_pairs=4)
    early = gate.paired_gate(*_pairs([-0.2, -0.2, -0.21]), planned_pairs=5)
    assert early.verdict == "undecided" and "3 of the 5 pre-registered" in early.reason


def test_olympic_mean_drops_one_best_and_one_worst():
    assert gate.olympic_mean([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert gate.olympic_mean([4.0, 6.0]) == 5.0


def test_parse_utc_accepts_utc_only():
    assert parse_utc("2026-11-28T21:41:00Z").hour == 21
    for bad in ("2026-11-28 21:41", "2026-11-28T21:41:00+01:00", "yesterday"):
        with pytest.raises(ValueError, match="UTC"):
            parse_utc(bad, "report.preregistered")


def test_reanalysis_of_a_report_is_labelled_post_hoc(tmp_path):
    reference, candidate = _pairs([0.09, 0.14, 0.12, 0.06, 0.06])
    report = {
        "gate": {
            "margin": 0.05,
            "alpha": 0.05,
            "per_seed": {
                "lamb": [{"seed": k, "samples_to_target": v} for k, v in reference.items()],
                "onebit": [{"seed": k, "samples_to_target": v} for k, v in candidate.items()],
            },
        }
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    out = tmp_path / "post_hoc.json"
    assert gate.main(["--report", str(path), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["post_hoc"] is True and result["reference"] == "lamb"
    assert result["arms"]["onebit"]["paired"]["verdict"] == "fail"
    assert result["arms"]["onebit"]["paired"]["planned_pairs"] is None
    assert result["arms"]["onebit"]["welch"]["verdict"] in ("fail", "undecided")
    assert gate.main(["--report", str(tmp_path / "absent.json")]) == 2
