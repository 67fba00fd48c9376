"""The report's statistics against values from published tables."""

from __future__ import annotations

import math

import pytest

from pipeline.reports.stats import betainc, mean_std, t_two_sided_p, welch_t_test


def test_betainc_matches_binomial_sums():
    # I_x(a, n - a + 1) = P(Binomial(n, x) >= a)
    for a, n, x in ((2, 4, 0.4), (1, 1, 0.3), (5, 9, 0.7), (3, 20, 0.05)):
        tail = sum(math.comb(n, j) * x**j * (1 - x) ** (n - j) for j in range(a, n + 1))
        assert betainc(a, n - a + 1, x) == pytest.approx(tail, rel=1e-12)
    assert betainc(2.0, 3.0, 0.0) == 0.0 and betainc(2.0, 3.0, 1.0) == 1.0
    with pytest.raises(ValueError, match="x must lie"):
        betainc(1.0, 1.0, 1.5)


@pytest.mark.parametrize(
    "t, df, p",
    [
        (12.7062, 1, 0.05),  # two-sided 5 % critical values of Student's t
        (2.7764, 4, 0.05),
        (2.2281, 10, 0.05),
        (4.0321, 5, 0.01),
        (1.0, 1, 0.5),  # Cauchy: P(|T| >= 1) = 1/2
        (0.0, 3, 1.0),
    ],
)
def test_t_two_sided_p(t, df, p):
    assert t_two_sided_p(t, df) == pytest.approx(p, abs=2e-5)
    assert t_two_sided_p(-t, df) == pytest.approx(t_two_sided_p(t, df))


def test_welch_t_test():
    result = welch_t_test([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    assert result.difference == 3.0
    assert result.t == pytest.approx(3.0 / math.sqrt(2 / 3))
    assert result.df == pytest.approx(4.0)
    assert result.p == pytest.approx(0.021312, rel=1e-4)
    # unequal variances and sizes: Welch-Satterthwaite degrees of freedom
    a, b = [10.0, 12.0, 14.0, 16.0], [11.0, 19.0]
    va, vb = mean_std(a)[1] ** 2 / 4, mean_std(b)[1] ** 2 / 2
    result = welch_t_test(a, b)
    assert result.df == pytest.approx((va + vb) ** 2 / (va**2 / 3 + vb**2 / 1))
    assert 0.0 < result.p < 1.0
    # no spread at all: equal means agree, different means differ
    assert welch_t_test([0.5, 0.5], [0.5, 0.5]).p == 1.0
    assert welch_t_test([0.5, 0.5], [0.7, 0.7]).p == 0.0
    with pytest.raises(ValueError, match=">= 2 values"):
        welch_t_test([1.0], [1.0, 2.0])
