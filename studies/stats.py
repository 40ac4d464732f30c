"""The statistics of the studies: paired effects over seeds, tests of difference and of equivalence, Holm's
correction, and the verdicts they give; the distributions are scipy's.

The seed is the unit of inference. A study runs each variant with the same seeds as the reference (a
seed fixes both the init and the data order), so an effect is the mean of the per-seed differences to
the reference: a paired, seed-blocked analysis with each cell's own variance and n - 1 degrees of
freedom. (The pilot's paired differences differed 10x in spread between cells, so a variance pooled
across variants would misstate most of them.)

Verdicts of a primary effect, at family-wise level ALPHA (Holm, separately over the difference tests and
over the equivalence tests of the primary family):
    hurts / helps   the two-sided test of "no difference" rejects (the variant raises / lowers the loss)
    negligible      the equivalence test (TOST) rejects "|effect| >= margin": the 90% interval, widened
                    by Holm, lies within +-margin
    unresolved      neither
Secondary effects get only a bound: |effect| < X, X the largest end of their 90% interval.
Predicted invariances are checked value by value, outside the family (`invariance`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.stats

ALPHA = 0.05  # family-wise error of each family of primary tests


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 with one value)."""
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


# ----------------------------------------------------------------------------------------------
# Distributions, from scipy


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom."""
    return float(scipy.stats.t.cdf(t, df))


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    return float(scipy.stats.t.ppf(p, df))


def signed_rank_p(values: list[float], reference: list[float]) -> float:
    """Two-sided p-value of Wilcoxon's signed-rank test of the paired differences (exact for few seeds): the
    pre-registered check, beside the t-test, that a verdict does not rest on one heavy-tailed seed."""
    diffs = np.asarray(values, dtype=float) - np.asarray(reference, dtype=float)
    if not np.any(diffs):
        return 1.0
    return float(scipy.stats.wilcoxon(diffs).pvalue)


def smallest_signed_rank_p(n: int) -> float:
    """The smallest two-sided p the exact signed-rank test can give with n differences: every one of the
    same sign, 2 of the 2^n sign patterns."""
    return min(1.0, 2.0 / 2**n)


# ----------------------------------------------------------------------------------------------
# Paired effects, tests and corrections


@dataclass(frozen=True)
class Effect:
    """The mean of per-seed values (paired differences, or a contrast within each run), with its
    standard error and degrees of freedom."""

    estimate: float
    se: float
    df: int

    def interval(self, level: float) -> tuple[float, float]:
        """Two-sided confidence interval at `level` (e.g. 0.95); infinite with one seed."""
        if self.df < 1:
            return -math.inf, math.inf
        half = t_quantile(0.5 + level / 2, self.df) * self.se
        return self.estimate - half, self.estimate + half

    def p_difference(self) -> float:
        """Two-sided p-value of "the effect is 0"."""
        if self.df < 1:
            return 1.0
        if self.se == 0:
            return 0.0 if self.estimate != 0 else 1.0
        return 2 * t_cdf(-abs(self.estimate) / self.se, self.df)  # the lower tail keeps tiny p's exact

    def p_equivalence(self, margin: float) -> float:
        """Two one-sided tests (TOST) of "|effect| >= margin": the larger of the two one-sided p-values.
        It is below alpha exactly when the (1 - 2 alpha) interval lies within +-margin."""
        if self.df < 1:
            return 1.0
        if self.se == 0:
            return 0.0 if abs(self.estimate) < margin else 1.0
        above = t_cdf(-(self.estimate + margin) / self.se, self.df)  # H0: effect <= -margin
        below = t_cdf((self.estimate - margin) / self.se, self.df)  # H0: effect >= +margin
        return max(above, below)

    def bound(self) -> float:
        """X of the secondary statement |effect| < X: the largest end of the 90% interval."""
        low, high = self.interval(0.90)
        return max(abs(low), abs(high))


def paired_effect(values: list[float], reference: list[float] | None = None) -> Effect:
    """The effect of per-seed `values` (minus the reference's value of the same seed, when given)."""
    diffs = np.asarray(values, dtype=float) - (0.0 if reference is None else np.asarray(reference, dtype=float))
    if len(diffs) == 0:
        raise ValueError("an effect needs at least one seed")
    sd = float(np.std(diffs, ddof=1)) if len(diffs) > 1 else math.inf
    return Effect(float(diffs.mean()), sd / math.sqrt(len(diffs)), len(diffs) - 1)


def holm(p_values: dict) -> dict:
    """Holm's step-down adjusted p-values (family-wise error control, any dependence): the i-th smallest
    of m is multiplied by m - i + 1, then made non-decreasing and capped at 1. A NaN p (a test that could not
    be computed) counts as one of the m, ranks last and stays NaN: it rejects nothing, and costs the others no
    more than a p of 1 would."""
    ordered = sorted(p_values, key=lambda key: (math.isnan(p_values[key]), p_values[key]))
    adjusted, running = {}, 0.0
    for i, key in enumerate(ordered):
        if math.isnan(p_values[key]):
            adjusted[key] = math.nan
            continue
        running = max(running, min(1.0, (len(ordered) - i) * p_values[key]))
        adjusted[key] = running
    return adjusted


def primary_verdict(effect: Effect, p_difference_adjusted: float, p_equivalence_adjusted: float) -> str:
    """hurts / helps / negligible / unresolved, from the Holm-adjusted p-values (see the module docstring).
    Equivalence comes first: an effect shown to lie within the margin is negligible whatever its sign."""
    if p_equivalence_adjusted < ALPHA:
        return "negligible"
    if p_difference_adjusted < ALPHA:
        return "hurts" if effect.estimate > 0 else "helps"
    return "unresolved"


def invariance(values: list[float], reference: list[float] | None, tolerance: float) -> tuple[str, float, bool]:
    """A predicted invariance checked seed by seed: (verdict, max |difference|, bitwise equal). The
    verdict is "invariant" when every difference is within `tolerance` (float rounding), else
    "not invariant". `reference` None: the values themselves must be 0."""
    other = [0.0] * len(values) if reference is None else reference
    diffs = [abs(a - b) for a, b in zip(values, other, strict=True)]
    worst = max(diffs) if all(map(math.isfinite, diffs)) else math.inf  # max() may skip a NaN, by its place
    return ("invariant" if worst <= tolerance else "not invariant"), worst, worst == 0.0


# ----------------------------------------------------------------------------------------------
# Planning: power, seeds, and how far a pilot's spread can be trusted


def paired_power(effect: float, sd: float, n: int, alpha: float) -> float:
    """Power of the two-sided paired t-test at level `alpha` with n seeds, when the true mean difference is
    `effect` and the per-seed differences have standard deviation `sd`: P(|T| > t crit) under the noncentral
    t with n - 1 degrees of freedom and noncentrality effect sqrt(n) / sd."""
    if n < 2:
        return 0.0
    return two_sided_power(n - 1, effect * math.sqrt(n) / sd, alpha)


def welch_df(var_a: float, n_a: int, var_b: float, n_b: int) -> float:
    """Welch-Satterthwaite degrees of freedom of a difference of two means with unequal variances."""
    a, b = var_a / n_a, var_b / n_b
    return (a + b) ** 2 / (a * a / (n_a - 1) + b * b / (n_b - 1))


def welch_power(effect: float, sd_a: float, n_a: int, sd_b: float, n_b: int, alpha: float) -> float:
    """Power of the two-sided Welch test of two independent groups' means (the usual noncentral-t
    approximation, with the planned sds' Welch-Satterthwaite degrees of freedom)."""
    df = welch_df(sd_a**2, n_a, sd_b**2, n_b)
    return two_sided_power(df, effect / math.sqrt(sd_a**2 / n_a + sd_b**2 / n_b), alpha)


def two_sided_power(df: float, shift: float, alpha: float) -> float:
    """P(|T| > t crit) for T noncentral t (df, shift). Each tail as an upper tail: scipy's lower tail of a far
    shifted noncentral t can be NaN where its mirror image is a clean 0."""
    critical = t_quantile(1 - alpha / 2, df)
    power = scipy.stats.nct.sf(critical, df, shift) + scipy.stats.nct.sf(critical, df, -shift)
    if not math.isfinite(power):
        raise ValueError(f"power not computable for df={df}, shift={shift}")
    return float(min(1.0, power))


def seeds_for_power(effect: float, sd: float, alpha: float, power: float, most: int = 200) -> int | None:
    """The fewest seeds whose paired t-test reaches `power` (None if not within `most`)."""
    return next((n for n in range(2, most + 1) if paired_power(effect, sd, n, alpha) >= power), None)


def smallest_detectable(power_at: Callable[[float], float], power: float, sd: float) -> float:
    """The smallest effect that a test reaches `power` for, `power_at(effect)` its power (bisection; power
    grows with the effect)."""
    low, high = 0.0, sd
    while power_at(high) < power:
        low, high = high, 2 * high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if power_at(middle) < power else (low, middle)
    return high


def sd_upper_limit(sd: float, n: int, confidence: float = 0.8) -> float:
    """The one-sided upper confidence limit of a standard deviation measured on n values (chi-square): a
    pilot's few seeds understate the spread as often as not, so a study is planned from this bound."""
    return sd * math.sqrt((n - 1) / scipy.stats.chi2.ppf(1 - confidence, n - 1))


def welch_p(values_a: list[float], values_b: list[float]) -> tuple[float, float, float]:
    """(difference b - a, its standard error, two-sided p) of Welch's test of two independent groups."""
    a, b = np.asarray(values_a, dtype=float), np.asarray(values_b, dtype=float)
    var_a, var_b = a.var(ddof=1), b.var(ddof=1)
    se = math.sqrt(var_a / len(a) + var_b / len(b))
    difference = float(b.mean() - a.mean())
    df = welch_df(var_a, len(a), var_b, len(b))
    return difference, se, 2 * t_cdf(-abs(difference) / se, df)


def rank_sum_p(values_a: list[float], values_b: list[float]) -> float:
    """Two-sided p of the Mann-Whitney rank-sum test (exact for few values): the check, beside Welch's test,
    that a difference between two independent groups does not rest on one heavy-tailed value."""
    return float(scipy.stats.mannwhitneyu(values_b, values_a, alternative="two-sided", method="exact").pvalue)


def smallest_rank_sum_p(n_a: int, n_b: int) -> float:
    """The smallest two-sided p the exact rank-sum test can give: every value of one group above every
    value of the other, 2 of the C(n_a + n_b, n_a) orderings."""
    return min(1.0, 2.0 / math.comb(n_a + n_b, n_a))
