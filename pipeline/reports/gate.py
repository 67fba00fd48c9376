"""The parity gate: a target fixed from the reference runs, samples to target per run, and a
one-sided non-inferiority verdict with its power.

**Target.** MLPerf trains every run to one fixed quality and compares the samples it took.
Here the target is a validation MLM loss that *every* reference seed reaches before its run
ends: the worst (highest) reference seed's loss at ``fraction`` of the run
(:func:`pipeline.target.select_target`; 0.8 by default), fixed once the reference arm has run
and before any other arm runs. The worst seed then reaches it at ``fraction`` of the run and
the others earlier, so every reference seed has a samples-to-target.

**Samples to target** (:func:`samples_to_target`): the samples seen when the validation loss
first reaches the target, linear between the two validation points around the crossing;
``None`` when the run never reaches it.

**Paired gate** (:func:`paired_gate`, the primary test when the arms are seed-matched: seed
k of both arms shares its initialisation and data order): is the candidate's samples to
target at most ``1 + margin`` times its twin's? A one-sided paired t-test of
non-inferiority on the per-seed ``d_k = log(candidate_k / reference_k)`` against
``log(1 + margin)``, with n - 1 degrees of freedom. Pairing removes what the two arms of one
seed share (when that seed leaves the plateau), which Welch's test leaves in its standard
error. Outcomes as below; the number of pairs is fixed in advance (one look), the power and
the pairs needed come from the noncentral t distribution.

**Welch gate** (:func:`gate`, the secondary line): is the candidate's mean samples-to-target
at most ``1 + margin`` times the reference's? A one-sided Welch t-test of non-inferiority on
the difference ``D = mean(candidate) - (1 + margin) * mean(reference)``. (MLPerf's
``rcp_checker`` also uses Student's t on an olympic mean, but to reject submissions that
converge *faster* than its reference points: the other direction.)

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
from pathlib import Path
from statistics import NormalDist

from pipeline.reports.stats import correlation, mean_std, t_cdf, t_quantile

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


# ---------------------------------------------------------------------------- curves


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


# ---------------------------------------------------------------------------- the paired gate

PAIRED_TEST = (
    "one-sided paired t-test of non-inferiority on per-seed log(samples_candidate / "
    "samples_reference) over seed-matched pairs, n - 1 degrees of freedom: pass when the "
    "upper 1 - alpha confidence bound of the mean log ratio is below log(1 + margin), fail "
    "when the lower bound is above it or a candidate seed never reaches the target, "
    "otherwise undecided; one look at the pre-registered number of pairs"
)


def olympic_mean(values: list[float]) -> float:
    """The mean without the single lowest and highest value (MLPerf's olympic mean; the
    plain mean below 3 values)."""
    if not values:
        raise ValueError("olympic_mean of no values")
    ordered = sorted(values)
    kept = ordered[1:-1] if len(ordered) >= 3 else ordered
    return sum(kept) / len(kept)


def paired_power(
    n: int, sd: float, true_log_ratio: float, margin: float = MARGIN, alpha: float = ALPHA
) -> float:
    """The chance that :func:`paired_gate` with ``n`` pairs decides correctly when the true
    mean log ratio is ``true_log_ratio`` and its spread between pairs ``sd``: the chance to
    pass when the truth lies below log(1 + margin), to fail when above (noncentral t)."""
    from scipy.stats import nct
    from scipy.stats import t as student_t

    if n < 2 or sd <= 0:
        raise ValueError(f"paired_power needs n >= 2 and sd > 0, got n={n}, sd={sd}")
    df = n - 1
    q = float(student_t.ppf(1 - alpha, df))
    shift = (true_log_ratio - math.log1p(margin)) * math.sqrt(n) / sd
    if shift <= 0:
        return float(nct.cdf(-q, df, shift))
    return float(nct.sf(q, df, shift))


def pairs_needed(
    sd: float,
    true_log_ratio: float = 0.0,
    margin: float = MARGIN,
    alpha: float = ALPHA,
    power: float = POWER,
    most: int = 10_000,
) -> int | None:
    """The fewest pairs for which :func:`paired_power` reaches ``power`` (None when even
    ``most`` pairs do not: the truth sits at the margin)."""
    if sd <= 0:
        return 2
    if math.isclose(true_log_ratio, math.log1p(margin), rel_tol=0.0, abs_tol=1e-12):
        return None

    def enough(n: int) -> bool:
        return paired_power(n, sd, true_log_ratio, margin, alpha) >= power

    if not enough(most):
        return None
    low, high = 1, 2  # enough(high), not enough(low) once the doubling stops
    while not enough(high):
        low, high = high, min(2 * high, most)
    while high - low > 1:  # power grows with n: bisect
        mid = (low + high) // 2
        low, high = (low, mid) if enough(mid) else (mid, high)
    return max(2, high)


@dataclass(frozen=True)
class PairedGateResult:
    """What :func:`paired_gate` decided, with everything needed to check it by hand."""

    verdict: str
    """pass, fail or undecided"""
    reason: str
    test: str
    margin: float
    alpha: float
    seeds: list[int]
    """The pairs' seeds, ascending."""
    n_pairs: int
    planned_pairs: int | None
    log_ratios: list[float | None]
    """log(candidate / reference) per seed (None: the candidate never reached the target)."""
    mean_log_ratio: float | None = None
    sd_log_ratio: float | None = None
    ratio: float | None = None
    """exp(mean log ratio): the geometric mean of the per-seed ratios."""
    ratio_low: float | None = None
    ratio_high: float | None = None
    """The one-sided 1 - alpha bounds of the ratio (together a 1 - 2 alpha interval)."""
    t: float | None = None
    """(mean log ratio - log(1 + margin)) / its standard error."""
    df: int | None = None
    p_pass: float | None = None
    p_fail: float | None = None
    power: float | None = None
    """Chance to pass with these pairs if the true ratio were 1.00 at the observed spread."""
    pairs_needed: int | None = None
    """Pairs that decide with ``POWER`` if the observed mean and spread are the truth."""
    pairs_needed_at_parity: int | None = None
    """Pairs that pass with ``POWER`` if the true ratio is 1.00 at the observed spread."""
    correlation: float | None = None
    """Pearson correlation of the arms' samples to target across pairs (what pairing
    removes)."""

    def as_dict(self) -> dict:
        return asdict(self)


def paired_gate(
    reference: dict[int, float | None],
    candidate: dict[int, float | None],
    margin: float = MARGIN,
    alpha: float = ALPHA,
    planned_pairs: int | None = None,
    with_power: bool = True,
) -> PairedGateResult:
    """The paired gate on per-seed samples to target, keyed by seed (``None``: never
    reached). Seed k of both arms must be twins (same initialisation and data order): a seed
    in one arm only is refused, as are more pairs than ``planned_pairs`` (the test was fixed
    for that many); fewer give no pass or fail. See the module docstring for the test.
    ``with_power=False`` leaves out the power and pairs needed (the verdict is the same;
    for simulations)."""
    from scipy.stats import t as student_t

    only_ref = sorted(set(reference) - set(candidate))
    only_cand = sorted(set(candidate) - set(reference))
    if only_ref or only_cand:
        raise ValueError(
            "the arms are not seed-matched: "
            + "; ".join(
                f"{what} seed(s) {seeds} have no twin in the other arm"
                for what, seeds in (("reference", only_ref), ("candidate", only_cand))
                if seeds
            )
            + " (the paired test needs every seed in both arms)"
        )
    seeds = sorted(reference)
    missing_ref = [s for s in seeds if reference[s] is None]
    if missing_ref:
        raise ValueError(
            f"reference seed(s) {missing_ref} never reached the target: the target must be "
            f"one that every reference seed reaches (select_target)"
        )
    if planned_pairs is not None and len(seeds) > planned_pairs:
        raise ValueError(
            f"{len(seeds)} pairs, but the test was fixed for {planned_pairs}: pairs added "
            f"after the fact inflate the error rate; report the first {planned_pairs} "
            f"(seeds {seeds[:planned_pairs]}) or fix a new test before new runs"
        )
    if any(v is not None and v <= 0 for v in [*reference.values(), *candidate.values()]):
        raise ValueError("samples to target must be positive")
    logs = [None if candidate[s] is None else math.log(candidate[s] / reference[s]) for s in seeds]
    n = len(seeds)
    base = {
        "test": PAIRED_TEST,
        "margin": margin,
        "alpha": alpha,
        "seeds": seeds,
        "n_pairs": n,
        "planned_pairs": planned_pairs,
        "log_ratios": logs,
    }
    unreached = [s for s, d in zip(seeds, logs, strict=True) if d is None]
    if unreached:
        return PairedGateResult(
            "fail",
            f"candidate seed(s) {unreached} never reached the target (every run must reach it)",
            **base,
        )
    if n < 2:
        return PairedGateResult("undecided", f"the test needs >= 2 pairs (has {n})", **base)
    mean, sd = mean_std(logs)
    limit = math.log1p(margin)
    refs = [reference[s] for s in seeds]
    cands = [candidate[s] for s in seeds]
    stats = {
        "mean_log_ratio": mean,
        "sd_log_ratio": sd,
        "ratio": math.exp(mean),
        "df": n - 1,
        "correlation": correlation(refs, cands),
    }
    if sd == 0.0:
        verdict = "pass" if mean < limit else "fail" if mean > limit else "undecided"
        return PairedGateResult(verdict, "no spread between pairs: decided by the mean", **base,
                                **stats)  # fmt: skip
    se = sd / math.sqrt(n)
    q = float(student_t.ppf(1 - alpha, n - 1))
    t = (mean - limit) / se
    stats |= {
        "ratio_low": math.exp(mean - q * se),
        "ratio_high": math.exp(mean + q * se),
        "t": t,
        "p_pass": float(student_t.cdf(t, n - 1)),
        "p_fail": float(student_t.sf(t, n - 1)),
    }
    if with_power:
        stats["power"] = paired_power(n, sd, 0.0, margin, alpha)
        stats["pairs_needed_at_parity"] = pairs_needed(sd, 0.0, margin, alpha)
    interval = (
        f"ratio {stats['ratio']:.3f}, {1 - 2 * alpha:.0%} interval "
        f"[{stats['ratio_low']:.3f}, {stats['ratio_high']:.3f}] against the margin "
        f"{1 + margin:.3f}"
    )
    early = planned_pairs is not None and n < planned_pairs
    if early:
        return PairedGateResult(
            "undecided",
            f"{n} of the {planned_pairs} pre-registered pairs: no verdict before all ran "
            f"({interval})",
            **base,
            **stats,
        )
    if stats["ratio_high"] < 1 + margin:
        reason = f"{interval}: upper bound below it (p = {stats['p_pass']:.3g})"
        return PairedGateResult("pass", reason, **base, **stats)
    if stats["ratio_low"] > 1 + margin:
        reason = f"{interval}: lower bound above it (p = {stats['p_fail']:.3g})"
        return PairedGateResult("fail", reason, **base, **stats)
    need = pairs_needed(sd, mean, margin, alpha) if with_power else None
    stats["pairs_needed"] = need
    reason = f"{interval}: it straddles the margin; " + (
        "no number of pairs decides (the mean sits at the margin)"
        if need is None
        else f"{need} pairs decide with power {POWER:.0%} if the observed mean and spread hold"
    )
    return PairedGateResult("undecided", reason, **base, **stats)


# ---------------------------------------------------------------------------- re-analysis


def reanalyse(report: dict, margin: float | None = None, alpha: float | None = None) -> dict:
    """The paired test applied to a parity ``report.json``'s per-seed samples to target,
    every arm against the first. Labelled post hoc: a test chosen after the runs it judges
    is a reading, never the report's verdict."""
    gate_data = report.get("gate") or {}
    per_seed = gate_data.get("per_seed")
    if not per_seed:
        raise ValueError("the report has no gate (per-seed samples to target): nothing to test")
    margin = gate_data.get("margin", MARGIN) if margin is None else margin
    alpha = gate_data.get("alpha", ALPHA) if alpha is None else alpha
    names = list(per_seed)
    reference = {r["seed"]: r["samples_to_target"] for r in per_seed[names[0]]}
    out = {"post_hoc": True, "test": PAIRED_TEST, "reference": names[0], "arms": {}}
    for name in names[1:]:
        candidate = {r["seed"]: r["samples_to_target"] for r in per_seed[name]}
        paired = paired_gate(reference, candidate, margin, alpha)
        ref_values, cand_values = list(reference.values()), list(candidate.values())
        welch = gate(ref_values, cand_values, margin, alpha, min_seeds=2)
        reached = [v for v in cand_values if v is not None]
        out["arms"][name] = {
            "paired": paired.as_dict(),
            "welch": welch.as_dict(),
            "olympic_ratio": olympic_mean(reached) / olympic_mean(ref_values)
            if len(reached) == len(cand_values)
            else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.reports.gate --report REPORT.json [--out FILE.json]``: the paired test
    on an existing parity report, labelled post hoc."""
    import argparse
    import sys

    from onebit_bert.io import atomic_write_json

    parser = argparse.ArgumentParser(
        prog="python -m pipeline.reports.gate",
        description="Apply the paired non-inferiority test to a parity report.json's per-seed "
        "samples to target (every arm against the first), labelled post hoc.",
    )
    parser.add_argument("--report", required=True, help="a parity report.json with a gate")
    parser.add_argument("--margin", type=float, help="default: the report's")
    parser.add_argument("--alpha", type=float, help="default: the report's")
    parser.add_argument("--out", help="write the re-analysis here (JSON)")
    args = parser.parse_args(argv)
    try:
        result = reanalyse(json.loads(Path(args.report).read_text()), args.margin, args.alpha)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, arm in result["arms"].items():
        p, w = arm["paired"], arm["welch"]
        print(f"{name} vs {result['reference']} (post hoc): paired {p['verdict']}: {p['reason']}")
        print(f"  Welch (secondary): {w['verdict']}: {w['reason']}")
    if args.out:
        atomic_write_json(Path(args.out), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
