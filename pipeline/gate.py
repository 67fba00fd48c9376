"""The parity gate: a target fixed from the reference runs, samples to target per run, and an
MLPerf-style verdict with its power.

**Target.** MLPerf trains every run to one fixed quality and compares the samples it took.
Here the target is a validation MLM loss that *every* reference seed reaches before its run
ends: the worst (highest) reference seed's loss at ``fraction`` of the run
(:func:`select_target`; 0.8 by default), fixed once the reference arm has run and before any
other arm runs. The worst seed then reaches it at ``fraction`` of the run and the others
earlier, so every reference seed has a samples-to-target.

**Samples to target** (:func:`samples_to_target`): the samples seen when the validation loss
first reaches the target, linear between the two validation points around the crossing;
``None`` when the run never reaches it.

**Gate** (:func:`gate`): is the candidate's mean samples-to-target at most ``1 + margin``
times the reference's? A one-sided Welch t-test of non-inferiority on the difference
``D = mean(candidate) - (1 + margin) * mean(reference)`` (MLPerf's reference-convergence
check compares a mean with a one-sided t-test at alpha = 0.05 in the same way):

* **pass**: the one-sided upper ``1 - alpha`` confidence bound of D is below 0 (the data
  show, at level alpha, that the candidate needs at most ``margin`` more samples);
* **fail**: the one-sided lower bound is above 0 (the data show that it needs more), or a
  candidate seed never reached the target (every run must converge, as in MLPerf);
* **undecided**: neither. The verdict then gives the seeds per arm that a test at this
  alpha needs to decide with the given power if the observed means and spreads are the true
  ones (:func:`seeds_needed`, normal approximation); "no significant difference" is never a
  verdict.

The power stated beside a verdict is the chance that the gate passes with this many seeds
when the two arms really need the same samples and spread as observed (normal
approximation): ``Phi(margin * mean(ref) / se - z(1 - alpha))``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from statistics import NormalDist

from pipeline.stats import mean_std, t_cdf, t_quantile

TEST = (
    "one-sided Welch t-test of non-inferiority on per-seed samples to target: pass when the "
    "upper 1 - alpha confidence bound of mean(candidate) - (1 + margin) mean(reference) is "
    "below 0, fail when the lower bound is above 0 or a candidate seed never reaches the "
    "target, otherwise undecided with the seeds per arm needed (power 80 %)"
)
ALPHA = 0.05
MARGIN = 0.05
POWER = 0.8
MIN_SEEDS = 5
TARGET_FRACTION = 0.8

_NORMAL = NormalDist()


def parse_utc(text: str, what: str = "time") -> datetime:
    """An ISO 8601 time in UTC ("2026-11-28T21:41:00Z" or with "+00:00") as an aware
    datetime; anything else is one clear error naming ``what``."""
    try:
        when = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        when = None
    if when is None or when.utcoffset() is None or when.utcoffset().total_seconds() != 0:
        raise ValueError(
            f"{what} must be an ISO 8601 time in UTC such as \"2026-11-28T21:41:00Z\", "
            f"got {text!r}"
        )
    return when.astimezone(UTC)


# ---------------------------------------------------------------------------- curves


def value_at(points: list[tuple[float, float]], x: float) -> float:
    """The curve ``points`` (x ascending) at ``x``, linear between points; an ``x`` outside
    the points is an error (no extrapolation)."""
    if not points:
        raise ValueError("value_at of an empty curve")
    if not points[0][0] <= x <= points[-1][0]:
        raise ValueError(
            f"x = {x} lies outside the curve's range [{points[0][0]}, {points[-1][0]}]"
        )
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def samples_to_target(points: list[tuple[float, float]], target: float) -> float | None:
    """The x (samples) where the loss curve ``points`` first reaches ``target``: linear
    between the validation points around the crossing; ``None`` if it never does."""
    previous = None
    for x, y in points:
        if y <= target:
            if previous is None:
                return float(x)
            x0, y0 = previous
            return x0 + (x - x0) * (y0 - target) / (y0 - y)
        previous = (x, y)
    return None


def select_target(
    reference_curves: dict[str, list[tuple[float, float]]],
    at: float,
) -> dict:
    """The target: the highest of the reference seeds' validation losses at ``at`` (the
    same x unit as the curves: samples, or steps), so that every reference seed reaches it
    by ``at``. ``reference_curves``: seed label → [(x, validation loss), ...]."""
    if len(reference_curves) < 1:
        raise ValueError("select_target needs at least one reference curve")
    values = {}
    for label, points in reference_curves.items():
        if not points or points[-1][0] < at:
            last = points[-1][0] if points else None
            raise ValueError(
                f"reference run {label!r} ends at {last}, before the target's point {at}: "
                f"let every reference run finish before fixing the target"
            )
        values[label] = value_at(points, at)
    worst = max(values, key=values.get)
    return {"value": values[worst], "at": at, "worst": worst, "values_at": values}


def read_target(path: str | Path) -> dict | None:
    """A target file (:mod:`pipeline.target`); None when it is absent, damaged or has no
    value."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("value"), int | float) else None


# ---------------------------------------------------------------------------- the gate


@dataclass(frozen=True)
class GateResult:
    """What :func:`gate` decided, with everything needed to check it by hand."""

    verdict: str
    """pass, fail or undecided"""
    reason: str
    """One sentence: why (the bound, the unreached seeds, or the seeds still needed)."""
    margin: float
    alpha: float
    n_reference: int
    n_candidate: int
    mean_reference: float | None = None
    mean_candidate: float | None = None
    std_reference: float | None = None
    std_candidate: float | None = None
    ratio: float | None = None
    """mean(candidate) / mean(reference)"""
    difference: float | None = None
    """D = mean(candidate) - (1 + margin) mean(reference)"""
    standard_error: float | None = None
    df: float | None = None
    t: float | None = None
    p_pass: float | None = None
    """One-sided p-value of H0 "D >= 0" (small: evidence for pass)."""
    p_fail: float | None = None
    """One-sided p-value of H0 "D <= 0" (small: evidence for fail)."""
    upper_bound: float | None = None
    lower_bound: float | None = None
    power: float | None = None
    """Chance to pass with these seeds if both arms truly had the reference's mean and the
    observed spreads (normal approximation)."""
    seeds_needed: int | None = None
    """Seeds per arm to decide with ``POWER`` at the observed means (undecided only; None
    when no number of seeds decides: the means sit exactly at the margin)."""

    def as_dict(self) -> dict:
        return asdict(self)


def seeds_needed(
    std_reference: float,
    std_candidate: float,
    distance: float,
    scale: float,
    alpha: float = ALPHA,
    power: float = POWER,
) -> int | None:
    """Runs per arm for a one-sided test at ``alpha`` to reject with ``power`` when the true
    difference from the margin is ``distance`` (normal approximation):
    ``n = (z(1-alpha) + z(power))^2 (s_c^2 + scale^2 s_r^2) / distance^2`` with
    ``scale = 1 + margin``. With equal spreads and scale 1 that is the familiar
    ``2 ((z + z) s / distance)^2``. None when ``distance`` is 0."""
    if distance == 0:
        return None
    z = _NORMAL.inv_cdf(1 - alpha) + _NORMAL.inv_cdf(power)
    variance = std_candidate**2 + scale**2 * std_reference**2
    return max(2, math.ceil(z * z * variance / distance**2))


def gate(
    reference: list[float | None],
    candidate: list[float | None],
    margin: float = MARGIN,
    alpha: float = ALPHA,
    min_seeds: int = MIN_SEEDS,
) -> GateResult:
    """The gate on per-seed samples-to-target (``None``: the seed never reached the
    target). See the module docstring for the test."""
    base = {"margin": margin, "alpha": alpha}
    missing_ref = sum(v is None for v in reference)
    if missing_ref:
        raise ValueError(
            f"{missing_ref} reference seed(s) never reached the target: the target must be one "
            f"that every reference seed reaches (select_target)"
        )
    n_r, n_c = len(reference), len(candidate)
    base |= {"n_reference": n_r, "n_candidate": n_c}
    unreached = sum(v is None for v in candidate)
    if unreached:
        return GateResult(
            "fail",
            f"{unreached} of {n_c} candidate seed(s) never reached the target "
            f"(every run must reach it)",
            **base,
        )
    if n_r < 2 or n_c < 2:
        return GateResult(
            "undecided",
            f"the test needs >= 2 seeds per arm (has {n_r} and {n_c}); the protocol asks "
            f"for {min_seeds}",
            **base,
        )
    mean_r, std_r = mean_std(reference)
    mean_c, std_c = mean_std(candidate)
    scale = 1.0 + margin
    va, vc = scale**2 * std_r**2 / n_r, std_c**2 / n_c
    se = math.sqrt(va + vc)
    difference = mean_c - scale * mean_r
    stats = {
        "mean_reference": mean_r,
        "mean_candidate": mean_c,
        "std_reference": std_r,
        "std_candidate": std_c,
        "ratio": mean_c / mean_r,
        "difference": difference,
        "standard_error": se,
    }
    if se == 0.0:
        verdict = "pass" if difference < 0 else "fail" if difference > 0 else "undecided"
        return GateResult(verdict, "no spread in either arm: decided by the means", **base, **stats)
    df = (va + vc) ** 2 / (va**2 / (n_r - 1) + vc**2 / (n_c - 1))
    t = difference / se
    half = t_quantile(1 - alpha, df) * se
    z_alpha = _NORMAL.inv_cdf(1 - alpha)
    stats |= {
        "df": df,
        "t": t,
        "p_pass": t_cdf(t, df),
        "p_fail": 1.0 - t_cdf(t, df),
        "upper_bound": difference + half,
        "lower_bound": difference - half,
        "power": _NORMAL.cdf(margin * mean_r / se - z_alpha),
    }
    few = n_r < min_seeds or n_c < min_seeds
    if difference + half < 0 and not few:
        reason = (
            f"mean samples to target {mean_c / mean_r - 1:+.1%} vs the reference; upper "
            f"{1 - alpha:.0%} bound of mean(candidate) - {scale:g} mean(reference) is "
            f"{difference + half:,.0f} < 0 (p = {stats['p_pass']:.3g})"
        )
        return GateResult("pass", reason, **base, **stats)
    if difference - half > 0 and not few:
        reason = (
            f"mean samples to target {mean_c / mean_r - 1:+.1%} vs the reference; lower "
            f"{1 - alpha:.0%} bound of mean(candidate) - {scale:g} mean(reference) is "
            f"{difference - half:,.0f} > 0 (p = {stats['p_fail']:.3g})"
        )
        return GateResult("fail", reason, **base, **stats)
    need = seeds_needed(std_r, std_c, difference, scale, alpha)
    stats["seeds_needed"] = need
    if need is None:
        reason = "the means sit exactly at the margin: no number of seeds decides"
    elif few and need <= max(n_r, n_c):
        reason = f"the protocol asks for {min_seeds} seeds per arm (has {n_r} and {n_c})"
    else:
        more = max(need, min_seeds) - min(n_r, n_c)
        reason = (
            f"{more} more seed(s) per arm needed: {need} per arm decide at alpha = {alpha:g} "
            f"with power {POWER:.0%} if the observed means "
            f"({mean_c / mean_r - 1:+.1%}) and spreads hold"
        )
    return GateResult("undecided", reason, **base, **stats)


def difference_interval(
    reference: list[float], candidate: list[float], level: float = 0.95
) -> dict:
    """mean(candidate) - mean(reference) with its two-sided Welch confidence interval (e.g.
    of the final validation loss); the interval is None with fewer than 2 values per side."""
    mean_r, std_r = mean_std(reference)
    mean_c, std_c = mean_std(candidate)
    out = {"difference": mean_c - mean_r, "level": level, "low": None, "high": None}
    if len(reference) < 2 or len(candidate) < 2:
        return out
    va, vc = std_r**2 / len(reference), std_c**2 / len(candidate)
    se = math.sqrt(va + vc)
    if se == 0.0:
        return out | {"low": mean_c - mean_r, "high": mean_c - mean_r}
    df = (va + vc) ** 2 / (va**2 / (len(reference) - 1) + vc**2 / (len(candidate) - 1))
    half = t_quantile(0.5 + level / 2, df) * se
    return out | {"low": mean_c - mean_r - half, "high": mean_c - mean_r + half, "df": df}
