"""stats.py against known cases: Student's t (closed forms and table values), paired effects, the
difference and equivalence tests, Holm's correction, the verdicts, and their error rates by simulation."""

import math

import numpy as np
import pytest
import scipy.stats

from studies import stats


def test_t_distribution_closed_forms_and_table_values():
    for t in (-3.0, -0.5, 0.0, 0.7, 2.0, 10.0):
        assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)  # Cauchy
        assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
    # two-sided 95% and one-sided 95% quantiles from standard tables
    for df, q975, q95 in (
        (1, 12.706, 6.314),
        (2, 4.303, 2.920),
        (5, 2.571, 2.015),
        (10, 2.228, 1.812),
        (30, 2.042, 1.697),
    ):
        assert stats.t_quantile(0.975, df) == pytest.approx(q975, abs=1e-3)
        assert stats.t_quantile(0.95, df) == pytest.approx(q95, abs=1e-3)
    assert stats.t_quantile(0.975, 10**6) == pytest.approx(1.95996, abs=1e-4)  # the normal limit
    assert stats.t_quantile(0.025, 4) == pytest.approx(-stats.t_quantile(0.975, 4))
    with pytest.raises(ValueError):
        stats.t_quantile(1.0, 3)


def test_paired_effect_interval_and_difference_test():
    effect = stats.paired_effect([1.5, 2.5, 3.5], reference=[0.5, 0.5, 0.5])  # differences 1, 2, 3
    assert (effect.estimate, effect.df) == (2.0, 2) and effect.se == pytest.approx(1 / math.sqrt(3))
    low, high = effect.interval(0.95)
    assert low == pytest.approx(2 - 4.3027 / math.sqrt(3), abs=1e-4) and high == pytest.approx(
        2 + 4.3027 / math.sqrt(3), abs=1e-4
    )
    # t = 2 sqrt(3) on 2 df: two-sided p = 1 - t / sqrt(2 + t^2)
    t = 2 * math.sqrt(3)
    assert effect.p_difference() == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
    assert stats.paired_effect([0.3]).interval(0.95) == (-math.inf, math.inf)
    assert stats.paired_effect([0.3]).p_difference() == 1.0


@pytest.mark.parametrize("t", [1e4, 1e9])
def test_far_tail_p_values_keep_their_digits(t):
    # on 2 df the two-sided p is 1 - t / sqrt(2 + t^2); written without the subtraction that loses them:
    exact = 2 / (math.sqrt(2 + t * t) * (math.sqrt(2 + t * t) + t))
    assert stats.Effect(t, 1.0, 2).p_difference() == pytest.approx(exact, rel=1e-9, abs=0)
    assert stats.Effect(0.0, 1 / t, 2).p_equivalence(1.0) == pytest.approx(exact / 2, rel=1e-9, abs=0)
    a, b = [0.0, 0.001, 0.002, 0.0015], [5.0, 5.002, 5.001, 5.003, 5.0005]
    expected = scipy.stats.ttest_ind(b, a, equal_var=False).pvalue
    assert 0 < expected < 1e-15 and stats.welch_p(a, b)[2] == pytest.approx(expected, rel=1e-6, abs=0)


@pytest.mark.parametrize(
    "diffs", [[0.001, 0.004, -0.002, 0.003], [0.012, 0.019, 0.015], [-0.01, 0.03, 0.0, 0.02, 0.01]]
)
@pytest.mark.parametrize("margin", [0.01, 0.02, 0.05])
def test_equivalence_rejects_exactly_when_the_90_percent_interval_is_within_the_margin(diffs, margin):
    effect = stats.paired_effect(diffs)
    low, high = effect.interval(0.90)
    assert (effect.p_equivalence(margin) < 0.05) == (-margin < low and high < margin)


def test_equivalence_p_and_bound_on_two_degrees_of_freedom_in_closed_form():
    """Differences 1, 2, 3: mean 2, se 1/sqrt(3), 2 df, where P(T <= t) = 1/2 + t / (2 sqrt(2 + t^2)) and the
    q-quantile is (2q - 1) / sqrt(2q(1 - q)). TOST against a margin of 3 is the larger one-sided p, that of
    "effect >= 3" at t = -sqrt(3): 1/2 - sqrt(3/20) (the sum of both would be 0.1192)."""
    effect = stats.paired_effect([1.0, 2.0, 3.0])
    assert effect.p_equivalence(3.0) == pytest.approx(0.5 - math.sqrt(3 / 20), rel=1e-9)
    t_95 = 0.9 / math.sqrt(2 * 0.95 * 0.05)  # 2.91999
    assert effect.bound() == pytest.approx(2 + t_95 / math.sqrt(3), rel=1e-9)  # the 90% interval's far end
    assert stats.paired_effect([-1.0, -2.0, -3.0]).bound() == pytest.approx(2 + t_95 / math.sqrt(3), rel=1e-9)


def test_holm_adjusts_step_down_and_keeps_the_order():
    adjusted = stats.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    assert adjusted == pytest.approx({"d": 0.02, "a": 0.03, "c": 0.06, "b": 0.06})
    assert stats.holm({"x": 0.6, "y": 0.7}) == pytest.approx({"x": 1.0, "y": 1.0})  # capped at 1


def test_a_nan_p_in_holms_family_ranks_last_and_stays_nan_wherever_it_stands():
    for order in (["nan", "a", "c"], ["a", "nan", "c"], ["a", "c", "nan"]):
        given = {"a": 0.001, "c": 0.02, "nan": math.nan}
        adjusted = stats.holm({key: given[key] for key in order})
        assert adjusted["a"] == pytest.approx(0.003) and adjusted["c"] == pytest.approx(0.04)  # m = 3, as with p = 1
        assert math.isnan(adjusted["nan"])


def test_verdicts():
    up, down = stats.Effect(0.2, 0.01, 5), stats.Effect(-0.2, 0.01, 5)
    assert stats.primary_verdict(up, 0.001, 1.0) == "hurts"
    assert stats.primary_verdict(down, 0.001, 1.0) == "helps"
    assert stats.primary_verdict(stats.Effect(0.001, 0.001, 5), 0.5, 0.001) == "negligible"
    assert stats.primary_verdict(stats.Effect(0.01, 0.02, 5), 0.3, 0.2) == "unresolved"
    # many seeds: a tiny effect both different from 0 and within the margin is negligible, not "hurts"
    assert stats.primary_verdict(stats.Effect(0.004, 0.0005, 39), 1e-6, 1e-6) == "negligible"
    assert stats.invariance([1.0, 2.0], [1.0, 2.0], 1e-4) == ("invariant", 0.0, True)
    verdict, worst, bitwise = stats.invariance([1.0, 2.00005], [1.0, 2.0], 1e-4)
    assert verdict == "invariant" and worst == pytest.approx(5e-5) and not bitwise
    assert stats.invariance([0.1, 0.0], None, 1e-4)[0] == "not invariant"


def simulated_verdicts(true_effect: float, margin: float, n_seeds: int, sd: float, trials: int = 3000) -> dict:
    rng = np.random.default_rng(0)
    counts: dict = {}
    for _ in range(trials):
        effect = stats.paired_effect(list(rng.normal(true_effect, sd, n_seeds)))
        verdict = stats.primary_verdict(effect, effect.p_difference(), effect.p_equivalence(margin))
        counts[verdict] = counts.get(verdict, 0) + 1
    return {k: v / trials for k, v in counts.items()}


def test_the_tests_keep_their_error_rates():
    """A single test (no correction) at level 0.05: "hurts"/"helps" for a null effect, and "negligible" for
    an effect at the margin, each about 5% of the time; a large effect is found."""
    null = simulated_verdicts(0.0, margin=0.01, n_seeds=6, sd=0.02)
    assert null.get("hurts", 0) + null.get("helps", 0) < 0.065
    at_margin = simulated_verdicts(0.03, margin=0.03, n_seeds=12, sd=0.01)
    assert at_margin.get("negligible", 0) < 0.065
    large = simulated_verdicts(0.1, margin=0.02, n_seeds=5, sd=0.02)
    assert large.get("hurts", 0) > 0.99


def test_signed_rank_p_is_the_exact_two_sided_tail():
    # five positive differences: only the all-positive and all-negative sign patterns are as extreme, 2 of 32
    assert stats.signed_rank_p([1, 2, 3, 4, 5], [0] * 5) == pytest.approx(2 / 32)
    # ranks 1..5 with rank 2 negative: W- = 2; sign patterns with W- <= 2 are {}, {1}, {2}: twice 3 of 32
    assert stats.signed_rank_p([1, -2, 3, 4, 5], [0] * 5) == pytest.approx(6 / 32)
    assert stats.signed_rank_p([0.1, 0.2], [0.1, 0.2]) == 1.0  # no difference at all


def test_equivalence_uses_the_90_percent_interval_where_the_95_percent_one_would_say_otherwise():
    effect = stats.paired_effect([0.010, 0.016, 0.022, 0.013, 0.019])  # mean 0.016
    low90, high90 = effect.interval(0.90)
    low95, high95 = effect.interval(0.95)
    margin = (high90 + high95) / 2  # between the two upper ends
    assert high90 < margin < high95
    assert effect.p_equivalence(margin) < 0.05  # TOST at 5% is the 90% interval inside the margin
    assert effect.p_equivalence(high90 * 0.999) > 0.05


def test_the_smallest_signed_rank_p_is_what_the_test_gives_when_every_difference_agrees():
    import scipy.stats

    for n in (3, 4, 8):
        assert stats.smallest_signed_rank_p(n) == pytest.approx(scipy.stats.wilcoxon(np.arange(1.0, n + 1)).pvalue)
    assert stats.smallest_signed_rank_p(0) == 1.0


def test_a_missing_value_fails_an_invariance_wherever_it_sits():
    for values in ([1.0, math.nan], [math.nan, 1.0], [1.0, math.inf]):
        verdict, worst, bitwise = stats.invariance(values, [1.0, 1.0], 1e-4)
        assert verdict == "not invariant" and not bitwise and worst == math.inf
    assert stats.invariance([1.0, 1.0 + 1e-6], [1.0, 1.0], 1e-4)[0] == "invariant"
