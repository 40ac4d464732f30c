"""The confirmatory study's planning and decisions (studies/confirm.py, and the power functions of
studies/stats.py), pinned against scipy's own tests, simulation and the published G*Power value."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
from conftest import ROOT

from config import NOT_DECIDING
from errors import ConfigError
from studies import confirm, plan, report, stats

# ----------------------------------------------------------------------------------------------
# Power, against simulation


def simulated_paired_power(effect: float, sd: float, n: int, alpha: float, trials: int = 20000) -> float:
    diffs = np.random.default_rng(1).normal(effect, sd, size=(trials, n))
    return float(np.mean(scipy.stats.ttest_1samp(diffs, 0.0, axis=1).pvalue < alpha))


@pytest.mark.parametrize("effect, sd, n, alpha", [(0.5, 1.0, 10, 0.05), (0.1, 0.08, 8, 0.01), (0.05, 0.05, 16, 0.01)])
def test_paired_power_is_the_rejection_rate_of_the_t_test(effect, sd, n, alpha):
    assert stats.paired_power(effect, sd, n, alpha) == pytest.approx(
        simulated_paired_power(effect, sd, n, alpha), abs=0.012
    )


def test_paired_power_gives_the_published_sample_size():
    # G*Power 3 (Faul et al. 2007), a priori, matched pairs: d = 0.5, alpha 0.05 two-sided, power 0.8 -> 34 pairs,
    # actual power 0.8078
    assert stats.seeds_for_power(0.5, 1.0, 0.05, 0.8) == 34
    assert stats.paired_power(0.5, 1.0, 34, 0.05) == pytest.approx(0.8078, abs=1e-4)
    assert stats.paired_power(0.5, 1.0, 33, 0.05) < 0.8


def test_power_stays_a_number_far_out_in_the_tails():
    # scipy's lower tail of a far-shifted noncentral t is NaN (nct.cdf(-2, 40, 30)); its mirror image is 0
    assert stats.paired_power(0.1, 0.001, 41, 0.01) == 1.0 and stats.paired_power(1e-9, 1.0, 41, 0.01) < 0.011
    assert stats.welch_power(1.0, 0.01, 16, 0.01, 8, 0.01) == 1.0


def test_welch_power_is_the_rejection_rate_of_welchs_test():
    rng = np.random.default_rng(2)
    a = rng.normal(0.4, 0.09, size=(20000, 16))
    b = rng.normal(0.5, 0.05, size=(20000, 8))
    simulated = np.mean(scipy.stats.ttest_ind(b, a, axis=1, equal_var=False).pvalue < 0.01)
    assert stats.welch_power(0.1, 0.09, 16, 0.05, 8, 0.01) == pytest.approx(simulated, abs=0.015)


def test_the_upper_limit_of_a_pilots_sd_covers_the_true_sd_as_often_as_it_says():
    samples = np.random.default_rng(3).normal(0.0, 1.0, size=(40000, 3))
    bounds = [stats.sd_upper_limit(sd, 3, 0.8) for sd in samples.std(axis=1, ddof=1)]
    assert np.mean(np.asarray(bounds) >= 1.0) == pytest.approx(0.8, abs=0.01)


def test_the_smallest_detectable_effect_has_the_power_asked_for():
    def power_at(effect):
        return stats.paired_power(effect, 0.1, 8, 0.01)

    smallest = stats.smallest_detectable(power_at, 0.8, 0.1)
    assert power_at(smallest) == pytest.approx(0.8, abs=1e-6) and power_at(0.99 * smallest) < 0.8


def test_welch_and_the_rank_sum_test_agree_with_scipy():
    a, b = [0.41, 0.47, 0.39, 0.52, 0.45], [0.55, 0.61, 0.49, 0.66]
    difference, se, p = stats.welch_p(a, b)
    ours = scipy.stats.ttest_ind(b, a, equal_var=False)
    assert difference == pytest.approx(np.mean(b) - np.mean(a)) and p == pytest.approx(ours.pvalue, rel=1e-9)
    assert difference / se == pytest.approx(ours.statistic, rel=1e-9)
    assert stats.rank_sum_p(a, b) == pytest.approx(scipy.stats.mannwhitneyu(a, b, method="exact").pvalue)
    assert stats.rank_sum_p([1, 2, 3], [4, 5, 6, 7]) == pytest.approx(stats.smallest_rank_sum_p(3, 4))


# ----------------------------------------------------------------------------------------------
# Decisions on planted results


def fake_result(early: float, late: float, document_losses: np.ndarray, marker: bool = True) -> dict:
    """A run's result: positions 0-1023 scored twice each at the band's loss; documents of 50 tokens each at
    their own loss, the first one predicted from the marker at loss 2.0."""
    by_position = [early] * 16 + [(early + late) / 2] * 240 + [late] * 768
    counts = np.full(len(document_losses), 50.0)
    sums = document_losses * counts
    first = np.full(len(document_losses), 2.0) if marker else np.zeros(len(document_losses))
    result = {
        "val_doc_loss": float(sums.sum() / counts.sum()),
        "val_doc_loss_from_second": float((sums - first).sum() / (counts - marker).sum()),
        "val_doc_loss_sum_by_position": [2 * x for x in by_position],
        "val_doc_count_by_position": [2] * 1024,
        "val_doc_loss_sum_by_document": sums.tolist(),
        "val_doc_count_by_document": counts.astype(int).tolist(),
        "offset_loss": {"1": 5.0, "64": 5.0, "512": 5.0},
        "after_other": 5.0,
        "val_loss": 5.0,
        "wall_seconds": 1.0,
        "useful_tokens_per_sec": 1000.0,
    }
    if marker:
        result["val_first_token_loss"] = 2.0
        result["val_doc_first_token_loss_by_document"] = first.tolist()
    return result


def planted(cells: dict, seeds: range, rng) -> dict:
    """runs[pos][variant][seed] with the planted (early, late, whole-document) effects and per-seed noise."""
    runs: dict = {}
    for (pos, variant), (d_early, d_late, d_doc, noise) in cells.items():
        for seed in seeds:
            base = 4.0 + 0.03 * (seed % 5)  # a seed moves every cell alike
            documents = base + d_doc + np.linspace(-0.5, 0.5, 40) + noise * rng.normal(0, 0.05, 40)
            e, late = base + d_early + noise * rng.normal(0, 0.04), base + d_late + noise * rng.normal(0, 0.01)
            runs.setdefault(pos, {}).setdefault(variant, {})[seed] = fake_result(
                e, late, documents, variant != "no_bos"
            )
    return runs


STUDY = plan.Study(late_band=[256, 1024])
SETTINGS = {  # what each planted study runs: the seeds of every cell its runs hold
    "rung3": dataclasses.replace(STUDY, first_seed=400, seeds=8, invariance_seeds=1,
                                 variants=["reference", "no_doc_mask", "no_reset_position_ids"]),
    "rung2": dataclasses.replace(STUDY, first_seed=500, seeds=16, pos_embs=["learned"],
                                 variants=["reference", "no_doc_mask", "no_bos"]),
    "rounding": dataclasses.replace(STUDY, first_seed=400, seeds=1, invariance_seeds=1, pos_embs=["rope"],
                                    variants=["reference", "no_reset_position_ids"]),
}  # fmt: skip
OFFSETS = [1, 64, 512]


@pytest.fixture(scope="module")
def decided():
    rng = np.random.default_rng(5)
    rung3 = planted(
        {
            ("learned", "reference"): (0, 0, 0, 0),
            ("learned", "no_doc_mask"): (0.5, 0.1, 0.1, 1),
            ("learned", "no_reset_position_ids"): (0.06, 0.001, 0.01, 1),
            ("rope", "reference"): (0, 0, 0, 0),
            ("rope", "no_doc_mask"): (0.02, 0.0, 0.0, 1),
        },
        range(400, 408),
        rng,
    )
    rung3["rope"]["no_reset_position_ids"] = {400: fake_result(4.0 + 1e-3, 4.0 - 4e-3, np.linspace(3.5, 4.5, 40))}
    rung2 = planted(
        {("learned", "reference"): (0, 0, 0, 0), ("learned", "no_doc_mask"): (0.3, 0.05, 0.05, 1)}, range(500, 516), rng
    )
    rung2["learned"]["no_bos"] = planted({("learned", "no_bos"): (0.0, 0.0, 0.0, 1)}, range(500, 516), rng)["learned"][
        "no_bos"
    ]
    rounding = {"rope": {"reference": {400: fake_result(4.0 + 5e-4, 4.0 + 1e-3, np.linspace(3.5, 4.5, 40) + 1e-3)}}}
    rounding["rope"]["no_reset_position_ids"] = {400: fake_result(4.0 - 5e-4, 4.0, np.linspace(3.5, 4.5, 40))}
    read = {
        name: (SETTINGS[name], runs, OFFSETS)
        for name, runs in (("rung3", rung3), ("rung2", rung2), ("rounding", rounding))
    }
    tests = [
        confirm.Test("mask, learned", "rung3", "learned", "no_doc_mask", "early", 0.1),
        confirm.Test("mask, rope", "rung3", "rope", "no_doc_mask", "early", 0.1),
        confirm.Test("reset, learned", "rung3", "learned", "no_reset_position_ids", "early", 0.05),
        confirm.Test("marker", "rung2", "learned", "no_bos", "early", 0.05),
        confirm.Test("growth", "rung3", "learned", "no_doc_mask", "early", 0.1, growth_from="rung2"),
    ]
    equivalence = [confirm.Test("reset late", "rung3", "learned", "no_reset_position_ids", "late", 0, margin=0.02)]
    registration = confirm.Registration(
        {"rung3": "", "rung2": "", "rounding": ""},
        tests,
        equivalence,
        {"study": "rung3", "pos": "rope", "variant": "no_reset_position_ids", "rounding": "rounding"},
        bootstrap_resamples=500,
    )
    return registration, read, confirm.decide(registration, read)


def effects(read, study, pos, variant, endpoint):
    _, runs, _ = read[study]
    seeds = sorted(runs[pos][variant])
    value = {
        v: [report.endpoints(runs[pos][v][s], STUDY, OFFSETS)[endpoint] for s in seeds] for v in (variant, "reference")
    }
    return np.asarray(value[variant]), np.asarray(value["reference"])


def test_each_paired_test_is_scipys_paired_t_test_and_signed_rank_test(decided):
    registration, read, result = decided
    for test in registration.primary[:4]:
        variant, reference = effects(read, test.study, test.pos, test.variant, "early")
        entry = result["primary"][test.name]
        assert entry["estimate"] == pytest.approx(np.mean(variant - reference))
        assert entry["p"] == pytest.approx(scipy.stats.ttest_rel(variant, reference).pvalue, rel=1e-6)
        assert entry["p_rank"] == pytest.approx(scipy.stats.wilcoxon(variant - reference).pvalue)
        ci = scipy.stats.ttest_rel(variant, reference).confidence_interval(0.95)
        assert entry["ci95"] == pytest.approx([ci.low, ci.high])
        whole_variant, whole_reference = effects(read, test.study, test.pos, test.variant, "from_second")
        assert entry["whole"] == pytest.approx(np.mean(whole_variant - whole_reference))
        assert entry["percent"] == pytest.approx(100 * entry["estimate"] / np.mean(reference))


def test_growth_is_welchs_test_of_the_per_seed_effects(decided):
    registration, read, result = decided
    after = np.subtract(*effects(read, "rung3", "learned", "no_doc_mask", "early"))
    before = np.subtract(*effects(read, "rung2", "learned", "no_doc_mask", "early"))
    ours = scipy.stats.ttest_ind(after, before, equal_var=False)
    entry = result["primary"]["growth"]
    assert entry["estimate"] == pytest.approx(after.mean() - before.mean())
    assert entry["p"] == pytest.approx(ours.pvalue, rel=1e-6)
    ci = ours.confidence_interval(0.95)
    assert entry["ci95"] == pytest.approx([ci.low, ci.high])
    assert entry["p_rank"] == pytest.approx(scipy.stats.mannwhitneyu(after, before, method="exact").pvalue)
    assert entry["verdict"] == "grows"  # planted: +0.5 at rung 3 against +0.3 at rung 2


def test_the_verdicts_are_holms_step_down_rejections(decided):
    registration, _, result = decided
    primary = result["primary"]
    ordered = sorted(primary, key=lambda name: primary[name]["p"])
    rejected = set()
    for i, name in enumerate(ordered):  # Holm (1979): reject while p_(i) <= alpha / (m - i + 1), then stop
        if primary[name]["p"] > registration.alpha / (len(ordered) - i):
            break
        rejected.add(name)
    assert {name for name, r in primary.items() if r["verdict"] != "unresolved"} == rejected
    assert "mask, learned" in rejected and "marker" not in rejected and "mask, rope" not in rejected
    assert primary["mask, learned"]["verdict"] == "hurts"


def test_a_rank_test_no_data_could_pass_is_marked_so():
    results = {
        "few": {"p": 0.001, "p_rank": 0.25, "smallest_p_rank": 0.25, "estimate": 1.0},
        "many": {"p": 0.001, "p_rank": 0.0001, "smallest_p_rank": 1e-5, "estimate": 1.0},
    }
    confirm.decide_family(results, 0.05, set())
    assert results["few"]["robust"] is None and results["many"]["robust"] is True
    # four seeds: the smallest p, 1/8, times a family of 5 cannot fall below 0.05 for anyone
    results = {f"t{i}": {"p": 0.001, "p_rank": 0.125, "smallest_p_rank": 0.125, "estimate": 1.0} for i in range(5)}
    confirm.decide_family(results, 0.05, set())
    assert all(r["robust"] is None and r["verdict"] == "hurts" for r in results.values())
    # one test alone could pass (5 x 0.001), but the others' best Holm step is 4 x 0.04 = 0.16
    results = {"strong": {"p": 0.001, "p_rank": 0.001, "smallest_p_rank": 0.001, "estimate": 1.0}}
    results |= {f"t{i}": {"p": 0.001, "p_rank": 0.04, "smallest_p_rank": 0.04, "estimate": 1.0} for i in range(4)}
    confirm.decide_family(results, 0.05, set())
    assert results["strong"]["robust"] is True
    assert all(results[f"t{i}"]["robust"] is None for i in range(4))


def test_the_report_gives_an_unpassable_rank_tests_best_holm_p_and_no_robustness_beside_unresolved():
    results = {f"t{i}": {"p": 0.001, "p_rank": 0.01, "smallest_p_rank": 0.0078, "estimate": 1.0} for i in range(10)}
    results["weak"] = {"p": 0.5, "p_rank": 0.5, "smallest_p_rank": 1e-5, "estimate": 1.0}
    confirm.decide_family(results, 0.05, set())
    for r in results.values():
        r.update(seeds=8, ci95=[0, 1], percent=1.0, whole=0.0, whole_ci95=[0, 0], whole_percent=0.0)
        r["whole_bootstrap95"] = [0, 0]
    rows = {row[0]: row for row in confirm.primary_rows({"primary": results}, 0.05)}
    assert rows["t0"][6] == "cannot pass (at best 0.078)"  # 10 x 0.0078: what Holm leaves the best case
    assert results["weak"]["robust"] is False and rows["weak"][6] == "0.5"  # unresolved: nothing to be robust


def test_a_nan_p_is_not_decided_and_leaves_the_others_their_verdicts():
    results = {"nan": {"p": math.nan, "p_rank": math.nan, "smallest_p_rank": 1e-5, "estimate": math.nan}}
    results |= {f"t{i}": {"p": 0.001, "p_rank": 1e-4, "smallest_p_rank": 1e-5, "estimate": 1.0} for i in range(6)}
    confirm.decide_family(results, 0.05, set())
    assert results["nan"]["verdict"].startswith("not decided: a value is not a number")
    results["nan"].update(seeds=8, ci95=[0, 1], percent=1.0, whole=0.0, whole_ci95=[0, 0], whole_percent=0.0)
    results["nan"]["whole_bootstrap95"] = [0, 0]
    row = confirm.primary_rows({"primary": {"nan": results["nan"]}}, 0.05)[0]
    assert row[6] == "nan"  # no robustness beside what was not decided
    assert all(results[f"t{i}"]["verdict"] == "hurts" for i in range(6))
    assert all(results[f"t{i}"]["p_holm"] == pytest.approx(0.007) for i in range(6))  # 7 x 0.001: the NaN counts


def effect_cell(effects: list[float], first_seed: int) -> confirm.Cell:
    """A cell whose per-seed effect (on every endpoint, and on each of 20 documents alike) is `effects`."""
    documents = {first_seed + s: np.stack([np.full(20, 4.0 * 49), np.full(20, 49.0)]) for s in range(len(effects))}
    mine = {first_seed + s: np.stack([np.full(20, (4.0 + e) * 49), np.full(20, 49.0)]) for s, e in enumerate(effects)}
    values = {first_seed + s: {"early": 4.0 + e, "from_second": 4.0 + e} for s, e in enumerate(effects)}
    reference = {first_seed + s: {"early": 4.0, "from_second": 4.0} for s in range(len(effects))}
    return confirm.Cell(values, reference, mine, documents)


@pytest.mark.parametrize(
    "before, after, words, percent",
    [
        ([0.05, 0.04, 0.06], [0.10, 0.11, 0.09], "grows", 100.0),
        ([-0.05, -0.04, -0.06], [-0.01, -0.02, 0.0], "shrinks", -80.0),  # a rising difference, a falling size
        ([-0.02, -0.03, -0.01], [0.05, 0.04, 0.06], "shrinks, past 0", -350.0),  # the test decides: +0.07
        ([0.0, 0.0, 0.0], [0.10, 0.11, 0.09], "grows", math.inf),
    ],
)
def test_a_growth_verdict_reads_the_change_against_the_earlier_effects_sign(before, after, words, percent):
    test = confirm.Test("trend", "after", "rope", "naive", "early", 0.03, growth_from="before")
    results = {"trend": confirm.growth_test(effect_cell(before, 0), effect_cell(after, 10), test, 50)}
    confirm.decide_family(results, 0.05, {"trend"})
    assert results["trend"]["verdict"] == words and results["trend"]["p"] < 0.05
    assert results["trend"]["percent"] == pytest.approx(percent) == results["trend"]["whole_percent"]


def test_equivalence_is_tost_in_a_family_of_its_own(decided):
    registration, read, result = decided
    variant, reference = effects(read, "rung3", "learned", "no_reset_position_ids", "late")
    entry = result["equivalence"]["reset late"]
    diffs = variant - reference
    upper = scipy.stats.ttest_1samp(diffs, 0.02, alternative="less").pvalue
    lower = scipy.stats.ttest_1samp(diffs, -0.02, alternative="greater").pvalue
    assert entry["p"] == pytest.approx(max(upper, lower), rel=1e-6)
    assert entry["verdict"] == ("negligible" if max(upper, lower) < 0.05 else "not shown negligible")


def test_the_document_bootstrap_collapses_without_document_variation_and_resamples_every_run_alike():
    documents = np.stack([np.full(30, 4.0 * 49), np.full(30, 49.0)])
    shifted = np.stack([np.full(30, 4.1 * 49), np.full(30, 49.0)])
    one = confirm.Cell({0: {}, 1: {}}, {0: {}, 1: {}}, {0: shifted, 1: shifted}, {0: documents, 1: documents})
    low, high = confirm.bootstrap_interval([one], [1.0], 200)
    assert low == pytest.approx(0.1) and high == pytest.approx(0.1)
    # documents that differ: the interval has width, and with weights all 1 a run's loss is its own
    varied = np.stack([np.linspace(3, 5, 30) * 49, np.full(30, 49.0)])
    assert confirm.resampled_losses(varied, np.ones((1, 30)))[0] == pytest.approx(4.0)
    one = confirm.Cell({0: {}}, {0: {}}, {0: varied + np.stack([np.linspace(0, 9.8, 30), np.zeros(30)])}, {0: varied})
    low, high = confirm.bootstrap_interval([one], [1.0], 500)
    assert low < 0.1 < high and high - low > 0.02


def test_the_invariance_is_read_against_the_rerun_at_another_thread_count(decided):
    _, _, result = decided
    early = result["invariance"]["early"]
    assert early["differences"] == pytest.approx([1e-3, -1e-3]) and early["rounding"] == pytest.approx([5e-4])
    assert early["verdict"] == "within rounding"  # 1e-3 <= 3 x 5e-4
    late = result["invariance"]["late"]
    assert late["differences"] == pytest.approx([-4e-3, -1e-3]) and late["rounding"] == pytest.approx([1e-3])
    assert late["verdict"] == "beyond rounding"  # 4e-3 > 3 x 1e-3


def test_an_endpoint_the_runs_lack_is_one_line_and_the_invariance_reports_it_empty(decided, monkeypatch):
    """Studies without a late band (or with one no validation document reaches): a test on it cannot be decided,
    and the invariance check reports it as not measured, beside the endpoints it has."""
    registration, read, before = decided
    unbanded = {
        name: (dataclasses.replace(study, late_band=[]), runs, offsets) for name, (study, runs, offsets) in read.items()
    }
    words = "learned/no_reset_position_ids: not every run and its reference has a late value"
    with pytest.raises(ConfigError, match=words):
        confirm.decide(registration, unbanded)  # its equivalence test is on the late band
    checks = confirm.invariance(registration, unbanded)
    assert checks["late"] == {"differences": [], "rounding": [], "verdict": "not measured: no scored target"}
    assert checks["early"] == before["invariance"]["early"]
    monkeypatch.setattr(confirm, "plan_lines", lambda registration: [])  # its studies have no configs here
    assert "| late band |  |  | not measured: no scored target |" in confirm.report(
        registration, {**before, "invariance": checks}
    )


def test_a_registration_without_equivalence_tests_reports_no_equivalence_section(decided, monkeypatch):
    registration, read, _ = decided
    monkeypatch.setattr(confirm, "plan_lines", lambda registration: [])  # its studies have no configs here
    without = dataclasses.replace(registration, equivalence=[])
    assert "## Equivalence" not in confirm.report(without, confirm.decide(without, read))
    assert "## Equivalence (a family of its own)" in confirm.report(registration, confirm.decide(registration, read))


def test_a_diverged_run_is_never_within_rounding(decided):
    registration, read, _ = decided
    study, rounding, offsets = read["rounding"]
    diverged = fake_result(math.nan, 4.0, np.linspace(3.5, 4.5, 40))
    rerun = {"rope": {**rounding["rope"], "no_reset_position_ids": {400: diverged}}}
    checks = confirm.invariance(registration, {**read, "rounding": (study, rerun, offsets)})
    assert math.isnan(checks["early"]["differences"][1])  # after the finite one, where max() would skip it
    assert checks["early"]["verdict"] == "beyond rounding"


# ----------------------------------------------------------------------------------------------
# The registration


STUDIES_WITH_QUICK = '[studies]\nquick = "configs/compare.toml"\n'  # RoPE, naive, no late band


def registration_text(n_primary: int, study: str = "rung3", extra: str = "") -> str:
    tests = "".join(
        f'[[primary]]\nname = "t{i}"\nstudy = "{study}"\npos = "learned"\nvariant = "no_doc_mask"\n'
        'endpoint = "early"\nplan_effect = 0.1\nplan_sd = 0.05\n'
        for i in range(n_primary)
    )
    invariance = 'study = "rung3"\npos = "rope"\nvariant = "no_reset_position_ids"\nrounding = "rung3"\n'
    return f'{extra}[studies]\nrung3 = "configs/confirm_rung3.toml"\n[invariance]\n{invariance}{tests}'


@pytest.mark.parametrize(
    "text, words",
    [
        (registration_text(13), "the primary family holds 13 tests; register 1 to 12"),
        (registration_text(0), "the primary family holds 0 tests"),
        (registration_text(2, study="rung9"), "names study 'rung9'"),
        (registration_text(1, extra="alpah = 0.05\n"), "unexpected keyword argument 'alpah'"),
        (registration_text(1).replace("plan_effect = 0.1", 'plan_effect = "big"'), "must be numbers, 0 or more"),
        (registration_text(1).replace("plan_sd = 0.05", "plan_sd = -1"), "must be numbers, 0 or more"),
        (registration_text(1).replace('rounding = "rung3"', 'rounding = "r9"'), "and its rounding study, got"),
        (
            registration_text(1, extra='invariance = "rung3"\n').replace(
                '[invariance]\nstudy = "rung3"\npos = "rope"\nvariant = "no_reset_position_ids"\nrounding = "rung3"\n',
                "",
            ),
            "invariance must be a table",
        ),
        (registration_text(1).replace('rung3 = "configs/confirm_rung3.toml"', "rung3 = 3"), "hold text values only"),
        # a cell its study does not run, named by a test, the study it grows from, or the invariance check
        (registration_text(1).replace('variant = "no_doc_mask"', 'variant = "pad"'), "names learned/pad, a cell that"),
        (
            registration_text(1)
            .replace("[studies]\n", '[studies]\nrung2 = "configs/confirm_rung2.toml"\n')  # learned positions only
            .replace('pos = "learned"', 'pos = "rope"')
            .replace("plan_sd = 0.05\n", 'plan_sd = 0.05\ngrowth_from = "rung2"\n'),
            "names rope/no_doc_mask, a cell that study 'rung2' .configs/confirm_rung2.toml. does not run",
        ),
        (
            registration_text(1).replace('variant = "no_reset_position_ids"', 'variant = "no_bos"'),
            r"\[invariance\] names rope/no_bos, a cell that study",
        ),
        (
            registration_text(1, study="quick")
            .replace("[studies]\n", STUDIES_WITH_QUICK)
            .replace('"early"', '"late"')
            .replace('pos = "learned"\nvariant = "no_doc_mask"', 'pos = "rope"\nvariant = "naive"'),
            "is on the late band, which study 'quick' does not measure",
        ),
        (registration_text(1).replace("plan_sd = 0.05", 'plan_sd_from = "learned"'), "is not pos/variant"),
        # a setting or a test's name of the wrong kind: TOML gives any
        (registration_text(1, extra='alpha = "0.05"\n'), "alpha is '0.05', not a number between 0 and 1"),
        (registration_text(1, extra="power = 1.5\n"), "power is 1.5, not a number between 0 and 1"),
        (registration_text(1, extra="bootstrap_resamples = 0\n"), "bootstrap_resamples is 0, not a whole number"),
        (registration_text(1, extra="most_seeds = { rung3 = 1.5 }\n"), "most_seeds is {'rung3': 1.5}, not a table"),
        (registration_text(1, extra="pilot = 3\n"), "pilot is 3, not text"),
        (registration_text(1).replace('variant = "no_doc_mask"', 'variant = ["no_doc_mask"]'), "variant is \\['no_"),
        (registration_text(1).replace("plan_sd = 0.05", "plan_sd_from = 5"), "test 't0': plan_sd_from is 5, not text"),
    ],
)
def test_a_registration_that_cannot_be_decided_is_refused_in_one_line(tmp_path, capsys, text, words):
    path = tmp_path / "confirm.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        confirm.read_registration(path)
    assert confirm.main([str(path), "--plan"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1


def test_a_pilot_that_cannot_plan_a_test_is_one_line(tmp_path, capsys):
    """--plan reads the pilot's runs for a test without plan_sd: no pilot named, a run without its reference, or
    an endpoint whose band holds no scored target there, each is one line."""
    path, text = tmp_path / "confirm.toml", registration_text(1).replace("plan_sd = 0.05", "plan_sd = 0.0")
    path.write_text(text)
    assert confirm.main([str(path), "--plan"]) == 1
    assert "names no pilot and pilot_config" in capsys.readouterr().err
    path.write_text(f'pilot = "{tmp_path / "absent"}"\npilot_config = "configs/confirm_rung3.toml"\n{text}')
    assert confirm.main([str(path), "--plan"]) == 1  # it once read as a pilot of 0 finished runs
    assert (
        capsys.readouterr().err
        == f"error: pilot={tmp_path / 'absent'} is not a folder: give the study folder that holds the pilot's runs\n"
    )
    pilot = tmp_path / "pilot" / "learned"
    for seed in (0, 1):
        (pilot / "no_doc_mask" / f"seed{seed}").mkdir(parents=True)
        (pilot / "no_doc_mask" / f"seed{seed}" / "result.json").write_text(
            json.dumps({"result": fake_result(4.0, 4.0, np.full(40, 4.0))})
        )
    path.write_text(f'pilot = "{tmp_path / "pilot"}"\npilot_config = "configs/confirm_rung3.toml"\n{text}')
    for missing in ("its reference", "its early band's targets"):
        if missing == "its early band's targets":  # the reference there, but no position below 16 scored
            unscored = fake_result(4.0, 4.0, np.full(40, 4.0))
            unscored["val_doc_count_by_position"][:16] = [0] * 16
            for seed in (0, 1):
                (pilot / "reference" / f"seed{seed}").mkdir(parents=True)
                (pilot / "reference" / f"seed{seed}" / "result.json").write_text(json.dumps({"result": unscored}))
        assert confirm.main([str(path), "--plan"]) == 1, missing
        error = capsys.readouterr().err
        assert error.startswith("error: the pilot's ") and "give no early to plan with" in error, error
        assert error.count("\n") == 1
    cut = fake_result(4.0, 4.0, np.full(40, 4.0))
    del cut["val_doc_loss_sum_by_position"][20:]  # planned from part of its sums, before
    for seed in (0, 1):
        (pilot / "reference" / f"seed{seed}" / "result.json").write_text(json.dumps({"result": cut}))
    assert confirm.main([str(path), "--plan"]) == 1
    error = capsys.readouterr().err  # the damaged file named
    assert (
        f"give no early to plan with (ValueError: {pilot / 'reference' / 'seed0' / 'result.json'}: its lists differ"
        in error
    )


def test_unknown_options_and_missing_results_are_one_line_errors(tmp_path, capsys):
    path = tmp_path / "confirm.toml"
    path.write_text(registration_text(1))
    assert confirm.main([str(path), "--plna"]) == 1
    assert "unknown option(s) plna" in capsys.readouterr().err
    assert confirm.main([str(path), "--plan", "--seeds=2"]) == 1
    assert capsys.readouterr().err == "error: --plan reads the studies' configs as registered: drop --seeds=2\n"
    assert confirm.main([str(path), "--sedes=2"]) == 1  # a study's setting: its config's parser knows them
    assert "unknown config key 'sedes'" in capsys.readouterr().err
    for arguments, words in (
        (["--studies_dir"], "--studies_dir needs a folder: --studies_dir=DIR"),
        (["--studies_dir", "results"], "--studies_dir needs a folder: --studies_dir=DIR"),
        (["results"], "'results': give each option as --key=value"),
        (["--run=false"], "--run takes no value: give --run alone"),
        (["--plan", "--run"], "--plan reads no runs and writes nothing: drop --run"),  # it ran nothing, silently
        (["--plan", f"--out_dir={tmp_path}"], "--plan reads no runs and writes nothing: drop --out_dir"),
        (["--run", f"--studies_dir={tmp_path}"], "--run decides from the runs it trains"),  # decided from elsewhere
        ([f"--studies_dir={tmp_path / 'none'}"], f"--studies_dir={tmp_path / 'none'} is not a folder"),
    ):
        assert confirm.main([str(path), *arguments]) == 1
        assert capsys.readouterr().err.startswith(f"error: {words}")
    assert confirm.main(["--plan", str(path)]) == 1
    assert (
        capsys.readouterr().err
        == "error: give the registration first: python -m studies.confirm REGISTRATION.toml --plan\n"
    )
    assert confirm.main([str(tmp_path), "--plan"]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path} is a folder, not a config file\n"
    assert confirm.main([str(path), f"--studies_dir={tmp_path}", f"--out_dir={tmp_path / 'out'}"]) == 1
    error = capsys.readouterr().err
    assert "confirm_rung3/results.json not found" in error and not (tmp_path / "out").exists()
    assert f"(or copy its folder into {tmp_path})" in error


def test_a_study_decided_elsewhere_reports_effects_without_verdicts(decided):
    _, read, _ = decided
    _, runs, _ = read["rung3"]
    summary = report.summarise(runs, plan.Study(late_band=[256, 1024], decided_in="configs/confirm.toml"), OFFSETS)
    mask = summary["learned/no_doc_mask"]["endpoints"]["early"]
    assert mask["verdict"] == "decided in configs/confirm.toml" and "hurts" not in report.describe_effect(mask)
    reset = summary["rope/no_reset_position_ids"]["endpoints"]["early"]
    assert report.describe_effect(reset).startswith("decided in configs/confirm.toml (max")
    rules = report.decision_rule_lines(summary, plan.Study(late_band=[256, 1024], decided_in="x.toml"), OFFSETS)
    assert rules[3].startswith("- decided in x.toml, with other studies' tests")
    assert not report.decision_rule_lines(summary, STUDY, OFFSETS)[3].startswith("- decided in")
    # on its own, the same study decides: the mask's planted +0.5 hurts
    assert report.summarise(runs, STUDY, OFFSETS)["learned/no_doc_mask"]["endpoints"]["early"]["verdict"] == "hurts"


def test_seeds_are_sized_by_the_registered_rule_within_the_budget():
    def paired(name, study, effect, sd):
        return confirm.Test(name, study, "learned", "no_doc_mask", "early", effect, plan_sd=sd)

    tests = [
        paired("large", "rung3", 0.1, 0.02),  # 4 seeds give power 0.8 at 0.0125
        paired("small", "rung3", 0.05, 0.05),  # 15 would: the budget's 8 is all it gets
        paired("marker", "rung2", 0.1, 0.03),
        confirm.Test("growth", "rung3", "learned", "no_doc_mask", "early", 0.1, plan_sd=9.0, growth_from="rung2"),
    ]
    registration = confirm.Registration({"rung3": "", "rung2": ""}, tests, [], {}, most_seeds={"rung3": 8})
    level = 0.05 / 4
    assert stats.paired_power(0.1, 0.03, 5, level) >= 0.8 > stats.paired_power(0.1, 0.03, 4, level)
    assert stats.paired_power(0.05, 0.05, 8, level) < 0.8
    assert confirm.sized_seeds(registration) == {"rung3": 8, "rung2": 5}
    registration.most_seeds = {"rung3": 20}
    assert confirm.sized_seeds(registration)["rung3"] == stats.seeds_for_power(0.05, 0.05, level, 0.8) > 8


# ----------------------------------------------------------------------------------------------
# End to end: three tiny studies, one of them run by two processes at once, then the decisions


def tiny_study(tmp_path: Path, corpus: Path, name: str, table: str, steps: int = 2, threads: int = 1) -> Path:
    config = tmp_path / f"{name}.toml"
    config.write_text(
        f'dataset = "{corpus}"\ndata_dir = "{tmp_path / "data"}"\ntokenizer_vocab_size = 320\nseq_len = 64\n'
        f"n_layer = 1\nn_head = 2\nn_embd = 32\nbatch_size = 4\nmax_iters = {steps}\neval_interval = {steps}\n"
        "eval_tokens = 512\nlog_interval = 1\nwarmup_iters = 1\nbos = true\n"
        f'[ablate]\nout_dir = "{tmp_path / name}"\ndecided_in = "confirm.toml"\nthreads = {threads}\nprobe_docs = 8\n'
        f"probe_offsets = [16]\nlate_band = [32, 64]\n{table}\n"
    )
    return config


@pytest.mark.slow
def test_three_tiny_studies_are_decided_together(tiny_corpus, tmp_path):
    longer = tiny_study(
        tmp_path, tiny_corpus, "longer",
        'seeds = 2\ninvariance_seeds = 1\nvariants = ["reference", "no_doc_mask", "no_reset_position_ids"]',
        steps=4,
    )  # fmt: skip
    shorter = tiny_study(tmp_path, tiny_corpus, "shorter", 'first_seed = 10\nseeds = 2\npos_embs = ["learned"]\n'
                         'variants = ["reference", "no_doc_mask", "no_bos"]')  # fmt: skip
    rounding = tiny_study(
        tmp_path, tiny_corpus, "rounding",
        'seeds = 1\ninvariance_seeds = 1\npos_embs = ["rope"]\n'
        'variants = ["reference", "no_reset_position_ids"]',
        steps=4,
        threads=2,
    )  # fmt: skip
    command = [sys.executable, "-m", "studies.ablate"]
    subprocess.run(
        [*command, str(shorter)], cwd=ROOT, check=True, capture_output=True, timeout=600
    )  # prepares the data
    both = [subprocess.Popen([*command, str(longer)], cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in both]
    assert [p.returncode for p in both] == [0, 0]
    trained = [o.count("=== study:") for o in outputs]
    # 11 runs, each trained once, by one process or the other (how they split depends on the machine's timing;
    # test_ablate.py pins the sharing itself with a held lock)
    assert sum(trained) == 11
    subprocess.run([*command, str(rounding)], cwd=ROOT, check=True, capture_output=True, timeout=600)
    registration = tmp_path / "confirm.toml"
    registration.write_text(
        f'[studies]\nlonger = "{longer}"\nshorter = "{shorter}"\nrounding = "{rounding}"\n'
        '[invariance]\nstudy = "longer"\npos = "rope"\nvariant = "no_reset_position_ids"\nrounding = "rounding"\n'
        + "".join(
            f'[[primary]]\nname = "{name}"\nstudy = "{study}"\npos = "{pos}"\nvariant = "{variant}"\n'
            f'endpoint = "early"\nplan_effect = 0.1\nplan_sd = 0.1\n{extra}'
            for name, study, pos, variant, extra in [
                ("mask", "longer", "learned", "no_doc_mask", ""),
                ("reset", "longer", "learned", "no_reset_position_ids", ""),
                ("marker", "shorter", "learned", "no_bos", ""),
                ("growth", "longer", "learned", "no_doc_mask", 'growth_from = "shorter"\nplan_sd_before = 0.1\n'),
            ]
        )
        + '[[equivalence]]\nname = "reset late"\nstudy = "longer"\npos = "learned"\nvariant = "no_reset_position_ids"\n'
        'endpoint = "late"\nplan_effect = 0.0\nmargin = 0.02\n'
    )
    assert confirm.main([str(registration), f"--out_dir={tmp_path / 'decided'}"]) == 0
    decided = json.loads((tmp_path / "decided" / "confirm.json").read_text())
    assert list(decided["primary"]) == ["mask", "reset", "marker", "growth"]
    assert decided["primary"]["growth"]["seeds"] == "2 + 2" and decided["primary"]["mask"]["seeds"] == 2
    assert all(r["robust"] is None for r in decided["primary"].values())  # 2 seeds: no rank test can pass
    assert len(decided["invariance"]["early"]["differences"]) == 2 and decided["equivalence"]["reset late"]
    markdown = (tmp_path / "decided" / "confirm.md").read_text()
    assert "| marker | 2 |" in markdown and "cannot pass" in markdown
    results = json.loads((tmp_path / "longer" / "results.json").read_text())
    assert "decided in confirm.toml" in json.dumps(results["summary"]["learned/no_doc_mask"])


def test_the_registered_studies_train_alike_where_the_registration_says_they_do():
    rung3, base3 = plan.parse_args(["configs/confirm_rung3.toml"])
    rung2, base2 = plan.parse_args(["configs/confirm_rung2.toml"])
    rounding, base_rounding = plan.parse_args(["configs/confirm_rounding.toml"])
    assert base_rounding == base3 and (rounding.threads, rung3.threads) == (2, 1)
    assert rounding.first_seed == rung3.first_seed  # the same runs, another thread count
    assert dataclasses.replace(base2, max_iters=4500, eval_interval=1500) == base3
    seeds3 = {s for seeds in plan.seeds_of_cells(rung3).values() for s in seeds}
    seeds2 = {s for seeds in plan.seeds_of_cells(rung2).values() for s in seeds}
    assert not seeds3 & seeds2 and min(seeds3 | seeds2) >= 400 and max(seeds3 | seeds2) < 1300  # the pilot's: 1300+
    for study in (rung3, rung2, rounding):
        assert study.decided_in == "configs/confirm.toml"
    registration = confirm.read_registration(Path("configs/confirm.toml"))
    assert len(registration.primary) <= 5 and set(registration.studies.values()) == {
        "configs/confirm_rung3.toml",
        "configs/confirm_rung2.toml",
        "configs/confirm_rounding.toml",
    }
    _, piloted = plan.parse_args([registration.pilot_config])  # the recipe the pilot chose trains rung 3
    recipe = ("lr", "min_lr", "warmup_iters", "max_iters", "n_layer", "n_embd", "batch_size", "seq_len", "dataset")
    assert all(getattr(piloted, key) == getattr(base3, key) for key in recipe)
    assert confirm.sized_seeds(registration) == {"rung3": rung3.seeds, "rung2": rung2.seeds}  # the power rule


def test_runs_from_another_machine_or_thread_count_are_refused_by_name(decided):
    registration, read, _ = decided
    one = {name: (study, {p: {v: dict(s) for v, s in kinds.items()} for p, kinds in runs.items()}, offsets)
           for name, (study, runs, offsets) in read.items()}  # fmt: skip
    moved = dict(one["rung3"][1]["learned"]["no_doc_mask"][401], trained_on="CPU: Intel Xeon, 2 cores")
    one["rung3"][1]["learned"]["no_doc_mask"][401] = moved
    with pytest.raises(ConfigError, match=r"2 machines .*rung3: learned/no_doc_mask/seed401 \(CPU: Intel Xeon"):
        confirm.decide(registration, one)
    for by_seed in (s for kinds in one["rung3"][1].values() for s in kinds.values()):
        by_seed.update({seed: dict(result, threads=1) for seed, result in by_seed.items()})
    one["rung3"][1]["learned"]["no_doc_mask"][401] = dict(moved, trained_on="unknown", threads=2)
    one["rung3"] = (dataclasses.replace(SETTINGS["rung3"], threads=1), *one["rung3"][1:])
    with pytest.raises(ConfigError, match="^rung3: learned/no_doc_mask/seed401 ran on 2 threads, not the study's 1$"):
        confirm.decide(registration, one)


def copied(read: dict) -> dict:
    return {name: (study, {p: {v: dict(s) for v, s in kinds.items()} for p, kinds in runs.items()}, offsets)
            for name, (study, runs, offsets) in read.items()}  # fmt: skip


def test_with_same_machine_seed_a_seeds_runs_share_a_machine_and_seeds_may_differ(decided):
    """same_machine = "seed": a paired effect compares two runs of one machine; another seed may come from
    another machine (a study that spans sessions), but a seed split across two is refused by name."""
    registration, read, _ = decided
    per_seed = dataclasses.replace(registration, same_machine="seed")
    one = copied(read)
    for variant in ("reference", "no_doc_mask", "no_reset_position_ids"):  # seed 401's learned runs moved
        one["rung3"][1]["learned"][variant][401] = dict(one["rung3"][1]["learned"][variant][401], trained_on="B")
    confirm.decide(per_seed, one)
    with pytest.raises(ConfigError, match="2 machines"):
        confirm.decide(registration, one)  # the whole study on one, as the confirmatory study registered
    one["rung3"][1]["learned"]["reference"][401] = dict(one["rung3"][1]["learned"]["reference"][401], trained_on="C")
    with pytest.raises(ConfigError, match=r"^rung3: learned/seed401's runs were trained on 2 machines \(B, C\)"):
        confirm.decide(per_seed, one)


def test_a_cell_missing_a_seed_its_config_runs_is_refused_by_name_on_either_arm(decided):
    registration, read, _ = decided
    for arm in ("no_doc_mask", "reference"):
        one = copied(read)
        del one["rung3"][1]["learned"][arm][403]
        words = rf"^out/ablate: learned/{arm} has no run of seed\(s\) 403 of the 8 its study runs: finish the study"
        with pytest.raises(ConfigError, match=words):
            confirm.decide(registration, one)


def test_an_in_context_test_shows_and_bootstraps_whole_documents_in_context(decided):
    registration, read, before = decided
    one = copied(read)
    for variant, shift in (("reference", 0.0), ("no_doc_mask", -0.3)):  # the mask's cost, 0.3 lower in context
        for seed, result in one["rung3"][1]["learned"][variant].items():
            sums, counts = confirm.by_document(result)
            in_context = sums + shift * counts
            one["rung3"][1]["learned"][variant][seed] = dict(
                result,
                val_doc_loss_in_context=float(in_context.sum() / counts.sum()),
                val_doc_loss_in_context_sum_by_document=in_context.tolist(),
            )
    test = confirm.Test("mask, in context", "rung3", "learned", "no_doc_mask", "in_context", 0.1)
    only = dataclasses.replace(registration, primary=[test], equivalence=[], invariance={})
    entry = confirm.decide(only, one)["primary"][test.name]
    alone = before["primary"]["mask, learned"]
    assert entry["whole"] == pytest.approx(entry["estimate"]) == pytest.approx(alone["whole"] - 0.3)
    assert entry["whole_bootstrap95"] == pytest.approx([end - 0.3 for end in alone["whole_bootstrap95"]])
    del one["rung3"][1]["learned"]["reference"][404]["val_doc_loss_in_context_sum_by_document"]
    with pytest.raises(
        ConfigError, match=r"no_doc_mask or its reference has runs not scored in context \(no val_doc_loss_in"
    ):
        confirm.decide(only, one)
    del one["rung3"][1]["learned"]["reference"][405]["val_doc_loss_sum_by_document"]  # a traceback before
    with pytest.raises(ConfigError, match=r"runs not scored document by document \(no val_doc_loss_sum_by_document\)$"):
        confirm.decide(only, one)


def test_a_rounding_rerun_on_another_machine_than_its_first_run_is_refused(decided):
    registration, read, _ = decided
    one = copied(read)
    one["rounding"][1]["rope"]["reference"][400] = dict(one["rounding"][1]["rope"]["reference"][400], trained_on="B")
    rerun_only = dataclasses.replace(registration, invariance={}, rounding={"study": "rung3", "rerun": "rounding"})
    words = r"^rounding: rope/reference/seed400 was trained on another machine than its first run \(B and unknown\)"
    with pytest.raises(ConfigError, match=words):
        confirm.rounding(rerun_only, one)


def test_the_rounding_rerun_reports_how_far_it_moved_each_reference_and_invariance_may_be_absent(decided):
    registration, read, _ = decided
    rerun_only = dataclasses.replace(registration, invariance={}, rounding={"study": "rung3", "rerun": "rounding"})
    result = confirm.decide(rerun_only, read)
    assert "invariance" not in result
    first = report.endpoints(read["rung3"][1]["rope"]["reference"][400], STUDY, OFFSETS)
    again = report.endpoints(read["rounding"][1]["rope"]["reference"][400], STUDY, OFFSETS)
    assert result["rounding"]["rope/seed400"]["early"] == pytest.approx(again["early"] - first["early"])
    assert result["rounding"]["rope/seed400"]["from_second"] == pytest.approx(
        again["from_second"] - first["from_second"]
    )
    assert confirm.invariance_lines(rerun_only, result) == []
    assert confirm.rounding_lines(result)[0] == "## Rounding: how far the rerun moved the reference"


@pytest.mark.slow
def test_the_gpu_registration_trains_and_decides_end_to_end_at_a_tiny_size_on_the_cpu(tiny_corpus, tmp_path):
    """configs/practitioner_gpu.toml with one command: its three studies trained (the sizes, the device and the
    precision overridden; every other setting, compile and the analysis as registered), then its ten tests."""
    tiny = [
        f"--dataset={tiny_corpus}", f"--data_dir={tmp_path / 'data'}", "--device=cpu", "--dtype=float32",
        "--tokenizer_vocab_size=300", "--val_fraction=0.1", "--seq_len=128", "--n_layer=1", "--n_head=2", "--n_embd=16",
        "--batch_size=2", "--max_iters=2", "--warmup_iters=1", "--eval_interval=2", "--eval_tokens=512",
        "--seeds=2", "--probe_docs=4", "--late_band=64,127",
    ]  # fmt: skip
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    out = tmp_path / "decided"
    done = subprocess.run(
        [sys.executable, "-m", "studies.confirm", "configs/practitioner_gpu.toml", "--run", f"--out_dir={out}", *tiny],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    decided = json.loads((out / "confirm.json").read_text())
    assert len(decided["primary"]) == 10 and all("verdict" in r for r in decided["primary"].values())
    assert decided["primary"]["trend, 13M to 42M, alone"]["seeds"] == "2 + 2"
    again = subprocess.run(  # deciding again from the same runs: read with the same settings
        [sys.executable, "-m", "studies.confirm", "configs/practitioner_gpu.toml", f"--out_dir={tmp_path / 'again'}",
         *tiny],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "again" / "confirm.json").read_text()) == decided
    for size in ("13m", "42m", "110m"):
        results = json.loads((tmp_path / "out" / f"practitioner_gpu_{size}" / "results.json").read_text())
        runs = list((tmp_path / "out" / f"practitioner_gpu_{size}").rglob("result.json"))
        assert len(runs) == 4 and "rope/naive" in results["summary"]
        config = tomllib.loads((ROOT / "configs" / f"practitioner_gpu_{size}.toml").read_text())
        for run in runs:  # the config's own settings but the tiny ones, compiled (Inductor, on the CPU)
            saved = json.loads(run.read_text())
            recorded = saved["decided_by"]["config"]
            overridden = {a[2:].split("=")[0] for a in tiny} | set(NOT_DECIDING) | {"ablate"}
            kept = {k: v for k, v in config.items() if k not in overridden}
            assert kept and {k: recorded[k] for k in kept} == kept
            assert recorded["compile"] and "val_doc_loss_in_context" in saved["result"]


def test_a_study_that_fails_under_run_is_its_own_one_line_error_and_exit_code(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "studies.confirm", "configs/practitioner_gpu.toml", "--run", f"--out_dir={tmp_path}",
         "--n_layer=0"], cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (1, "error: n_layer=0: must be at least 1\n")
    assert "===== study gpu_13m" in done.stdout and not (tmp_path / "confirm.json").exists()


STUDY_STAND_IN = """
import pathlib, signal, sys, time
got = []
for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda signum, frame: got.append(signum))
pathlib.Path(sys.argv[1]).write_text("training")
while not got:
    time.sleep(0.01)
time.sleep(0.6)  # the step in flight and its checkpoint: longer than subprocess.run's 0.25 s grace after Ctrl-C
pathlib.Path(sys.argv[1]).write_text(f"saved after {got}")
sys.exit(128 + got[0])
"""


@pytest.mark.parametrize("signum, whole_group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_a_stop_reaches_a_running_study_once_and_waits_for_its_checkpoint(signum, whole_group, tmp_path):
    """Ctrl-C reaches the terminal's whole process group, SIGTERM only the process named: either way the study's
    child gets the signal once and saves before `confirm --run` exits 128 + the signal's number."""
    state = tmp_path / "state"
    harness = (
        "import sys\nfrom cli import run_main\nfrom studies import confirm\n"
        f"run_main(lambda argv: confirm.run_study([sys.executable, '-c', {STUDY_STAND_IN!r}, {str(state)!r}]))"
    )
    confirm_run = subprocess.Popen(
        [sys.executable, "-c", harness], cwd=ROOT, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # Ctrl-C as from a terminal: a test runner
    )  # fmt: skip                                                            # started in the background ignores it
    deadline = time.monotonic() + 60
    while not (state.exists() and state.read_text() == "training") and time.monotonic() < deadline:
        time.sleep(0.05)
    (os.killpg if whole_group else os.kill)(confirm_run.pid, signum)
    assert confirm_run.wait(timeout=60) == 128 + signum
    assert state.read_text() == f"saved after [{int(signum)}]"


def test_a_test_that_no_seed_count_up_to_200_powers_says_so_in_the_plan():
    registration = confirm.read_registration(ROOT / "configs/confirm.toml")
    assert confirm.plan_rows(registration)[0][5] == 38  # as results/decided/confirm/README.md's power table has it
    unreachable = dataclasses.replace(registration.primary[0], plan_effect=0.0)
    rows = confirm.plan_rows(dataclasses.replace(registration, primary=[unreachable, *registration.primary[1:]]))
    assert rows[0][5] == "over 200"
