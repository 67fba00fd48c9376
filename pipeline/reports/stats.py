"""Small-sample statistics for comparing runs: mean ± std and Welch's t-test.

Student's t distribution is scipy's (``scipy.stats.t``), a dependency of the pipeline
extra.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from scipy import special
from scipy.stats import t as student_t


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        raise ValueError("mean_std of no values")
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) for a, b > 0, 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must lie in [0, 1], got {x}")
    return float(special.betainc(a, b, x))


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    return float(2.0 * student_t.sf(abs(t), df))


@dataclass(frozen=True)
class WelchResult:
    """The outcome of :func:`welch_t_test`: difference of means, its standard error, the t
    statistic, the Welch-Satterthwaite degrees of freedom and the two-sided p-value."""

    difference: float
    """mean(b) - mean(a)"""
    standard_error: float
    t: float
    df: float
    p: float


def welch_t_test(a: list[float], b: list[float]) -> WelchResult:
    """Welch's unequal-variance t-test of mean(a) = mean(b), two-sided.

    Needs at least two values per side. When both sides have no spread at all the test is
    degenerate: p is 1 for equal means and 0 otherwise.
    """
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"Welch's t-test needs >= 2 values per side, got {len(a)} and {len(b)}")
    mean_a, std_a = mean_std(a)
    mean_b, std_b = mean_std(b)
    va, vb = std_a**2 / len(a), std_b**2 / len(b)
    difference = mean_b - mean_a
    se = math.sqrt(va + vb)
    if se == 0.0:
        same = math.isclose(mean_a, mean_b, rel_tol=0.0, abs_tol=1e-15)
        return WelchResult(
            difference, 0.0, 0.0 if same else math.inf, math.inf, 1.0 if same else 0.0
        )
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    t = difference / se
    return WelchResult(difference, se, t, df, t_two_sided_p(t, df))


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    return float(student_t.cdf(t, df))


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile (0 < p < 1) of Student's t with ``df`` degrees of freedom."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    return float(student_t.ppf(p, df))


def correlation(a: list[float], b: list[float]) -> float | None:
    """Pearson's r of two equal-length lists; None when either has no spread."""
    if len(a) < 2:
        return None
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    sab = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    saa = sum((x - ma) ** 2 for x in a)
    sbb = sum((y - mb) ** 2 for y in b)
    return None if saa == 0 or sbb == 0 else sab / math.sqrt(saa * sbb)
