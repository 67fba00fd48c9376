"""Small-sample statistics for comparing runs: mean ± std and Welch's t-test.

Only the standard library: the two-sided p-value comes from Student's t distribution via
the regularized incomplete beta function, evaluated by its continued fraction.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        raise ValueError("mean_std of no values")
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz evaluation)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 10_000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < eps:
            return result
    raise ArithmeticError(f"incomplete beta did not converge (a={a}, b={b}, x={x})")


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) for a, b > 0, 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must lie in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


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
    tail = t_two_sided_p(t, df) / 2.0
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile (0 < p < 1) of Student's t with ``df`` degrees of freedom
    (bisection on the two-sided tail)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1e6
    tail = 2 * (1 - p)
    for _ in range(80):  # 1e6 / 2^80: far below float precision at any quantile used
        mid = (lo + hi) / 2
        if t_two_sided_p(mid, df) > tail:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
