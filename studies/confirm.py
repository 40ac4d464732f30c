"""The confirmatory study's registered decisions, taken across the studies it is made of:

    python -m studies.confirm configs/confirm.toml --plan     # the registration's power calculation
    python -m studies.confirm configs/confirm.toml            # the decisions, once its studies have run
    python -m studies.confirm configs/confirm.toml --studies_dir=results/decided --out_dir=results/decided/confirm
                                                              # from the committed studies, into the committed report
    python -m studies.confirm configs/practitioner_gpu.toml --run --dataset=docs.parquet
                                                              # train every study (any --key=value is passed to
                                                              # each, and read with it), then decide
    python -m studies.confirm configs/practitioner_gpu.toml --dataset=docs.parquet
                                                              # decide again from those runs: the same --key=value

The study is several `python -m studies.ablate` studies (two training lengths, and a rerun at another thread
count), decided together by the families that the registration (configs/confirm.toml) names, never by each
study's own report:
  primary      at most five difference tests, Holm at family-wise alpha: a cell against its reference, paired
               by seed (t-test), or the growth of a cell's effect from one study to a longer one (Welch's
               test of the per-seed effects). Each verdict is checked by a rank test (signed-rank; rank-sum
               for growth), Holm over the same family, where the seeds can reach it; the report says where
               they cannot.
  equivalence  a family of its own: TOST against its margin.
  invariance   a cell theory predicts equal to its reference, against a rerun of the reference at another
               thread count: "within rounding" when every difference is at most `invariance_factor` times
               what the rerun moved.
Beside every effect: the whole-document loss from the second token (every target of the validation
documents pooled: a mean over tokens), scored alone, or in context where the test's endpoint is, in nats and
in percent of the reference's loss, and a bootstrap over the validation documents of that whole-document
effect (the seeds held fixed: how much the choice of documents moves it). A study missing a seed its config
runs is refused, not decided without it.

With --plan it reads no results: for each test, the seeds each cell runs (from the studies' configs), the
planned effect and spread (the registration's, or the pilot's spread bounded above), the power, the smallest
effect found with the registered power, and the seeds the registered rule gives each study.
Written to --out_dir (out/confirm unless given): confirm.md and confirm.json.
"""

from __future__ import annotations

import functools
import json
import math
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cli import read_config_file, run_main
from errors import ConfigError, SaveFailed
from run.folder import check_writable_folder, write_atomically
from studies import stats
from studies.plan import DIFFERENCE_ENDPOINTS, Study, parse_args, seeds_of_cells
from studies.report import ENDPOINT_NAMES, endpoints, finite_number, result_problem, saved_runs, settings_changed
from studies.tables import markdown_table

ROUNDING_ENDPOINTS = ("early", "late", "from_second", "in_context")
FLAGS, FOLDERS = ("plan", "run"), ("studies_dir", "out_dir")  # this command's options; others are the studies'
MOST_PRIMARY_TESTS = 12  # Holm keeps the family-wise error at any size; power is what a large family costs


@dataclass
class Test:
    """One registered test: a cell of a study against its reference, or (growth_from) the growth of that
    cell's effect from another study to this one."""

    name: str
    study: str
    pos: str
    variant: str
    endpoint: str
    plan_effect: float  # the smallest effect the test is sized to find (nats)
    plan_sd: float = 0.0  # the per-seed effects' planned sd (0: from the pilot)
    plan_sd_from: str = ""  # the pilot's cell ("pos/variant") whose spread plans this test: its own unless named
    plan_sd_before: float = 0.0  # growth: the same in the study it grows from
    growth_from: str = ""
    margin: float = 0.0  # equivalence tests


@dataclass
class Registration:
    studies: dict[str, str]  # name -> ablate config
    primary: list[Test]
    equivalence: list[Test]
    invariance: dict = field(default_factory=dict)  # study, pos, variant, rounding (a study's name); or none
    rounding: dict = field(default_factory=dict)  # study, rerun: how far a rerun (another thread count or
    # execution path) moves the study's reference runs of the same seeds; or none
    title: str = "The confirmatory study"
    same_machine: str = "study"  # "study": every run on one CPU model; "seed": a seed's runs on one
    pilot: str = ""  # a pilot's runs (ablate's layout) for the planned spreads
    pilot_config: str = ""
    alpha: float = stats.ALPHA
    power: float = 0.8
    invariance_factor: float = 3.0
    bootstrap_resamples: int = 2000
    most_seeds: dict[str, int] = field(default_factory=dict)  # a study's budget: the seeds it may run at most
    notes: dict = field(default_factory=dict)


def read_registration(path: Path) -> Registration:
    """The registration, each field checked, with one line naming what is wrong."""
    values = read_config_file(path, corpus_hint=False)
    try:
        tests = {kind: [Test(**t) for t in values.pop(kind, [])] for kind in ("primary", "equivalence")}
        registration = Registration(**values, **tests)
    except TypeError as e:
        raise ConfigError(f"{path}: {e} (see python -m studies.confirm --help)") from None
    tables = {"studies": registration.studies, "invariance": registration.invariance, "notes": registration.notes}
    tables["rounding"] = registration.rounding
    for name, table in {**tables, "most_seeds": registration.most_seeds}.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {name} must be a table ([{name}] or {name} = {{ ... }}), got {table!r}")
    if not all(isinstance(v, str) for table in tables.values() for v in table.values()):
        raise ConfigError(f"{path}: [studies], [invariance], [rounding] and [notes] hold text values only")
    check_kinds(registration, path)
    if not 1 <= len(registration.primary) <= MOST_PRIMARY_TESTS:
        raise ConfigError(
            f"{path}: the primary family holds {len(registration.primary)} tests; register 1 to {MOST_PRIMARY_TESTS}"
        )
    if registration.same_machine not in ("study", "seed"):
        raise ConfigError(f"{path}: same_machine is 'study' or 'seed', got {registration.same_machine!r}")
    for test in registration.primary + registration.equivalence:
        for name in (test.study, test.growth_from) if test.growth_from else (test.study,):
            if name not in registration.studies:
                raise ConfigError(
                    f"{path}: test {test.name!r} names study {name!r}, not one of {sorted(registration.studies)}"
                )
        if test.endpoint not in DIFFERENCE_ENDPOINTS:
            raise ConfigError(
                f"{path}: test {test.name!r}: endpoint {test.endpoint!r} is not one of {DIFFERENCE_ENDPOINTS}"
            )
        numbers = {k: getattr(test, k) for k in ("plan_effect", "plan_sd", "plan_sd_before", "margin")}
        if any(isinstance(v, bool) or not isinstance(v, int | float) or v < 0 for v in numbers.values()):
            raise ConfigError(f"{path}: test {test.name!r}: {numbers} must be numbers, 0 or more")
    where = registration.invariance
    if where and (
        set(where) != {"study", "pos", "variant", "rounding"}
        or not {where["study"], where["rounding"]} <= set(registration.studies)
    ):
        raise ConfigError(f"{path}: [invariance] names a study, pos, variant and its rounding study, got {where}")
    rounding = registration.rounding
    if rounding and (set(rounding) != {"study", "rerun"} or not set(rounding.values()) <= set(registration.studies)):
        raise ConfigError(f"{path}: [rounding] names a study and its rerun, two of [studies], got {rounding}")
    check_cells(registration, path)
    return registration


def check_kinds(registration: Registration, path: Path) -> None:
    """Each of the registration's settings, and each test's names, of its kind: TOML gives any, and a wrong one
    would fail far from here, in the arithmetic of the plan or the decisions."""
    r, number = registration, finite_number
    fields = [
        ("alpha", r.alpha, "a number between 0 and 1", number(r.alpha) and 0 < r.alpha < 1),
        ("power", r.power, "a number between 0 and 1", number(r.power) and 0 < r.power < 1),
        ("invariance_factor", r.invariance_factor, "a number above 0",
         number(r.invariance_factor) and r.invariance_factor > 0),
        ("bootstrap_resamples", r.bootstrap_resamples, "a whole number of at least 1",
         type(r.bootstrap_resamples) is int and r.bootstrap_resamples >= 1),
        ("most_seeds", r.most_seeds, "a table of whole numbers of at least 1",  # 1: a rerun with no tests
         all(type(n) is int and n >= 1 for n in r.most_seeds.values())),
        *((name, getattr(r, name), "text", isinstance(getattr(r, name), str))
          for name in ("pilot", "pilot_config", "title")),
    ]  # fmt: skip
    for test in r.primary + r.equivalence:
        for name in ("name", "study", "pos", "variant", "endpoint", "growth_from", "plan_sd_from"):
            value = getattr(test, name)
            fields.append((f"test {test.name!r}: {name}", value, "text", isinstance(value, str)))
    for name, value, expected, fits in fields:
        if not fits:
            raise ConfigError(f"{path}: {name} is {value!r}, not {expected}")


def check_cells(registration: Registration, path: Path) -> None:
    """Every cell the registration names is one its study runs (by the study's config), and a late band test's
    study measures that band: refused here, before --plan or the decisions read anything else."""
    studies = {name: parse_args([config])[0] for name, config in registration.studies.items()}
    cells = {name: seeds_of_cells(study) for name, study in studies.items()}
    where = registration.invariance
    named = [
        (f"test {t.name!r}", s, t.pos, t.variant)
        for t in registration.primary + registration.equivalence
        for s in (t.study, t.growth_from)
        if s
    ]
    named += [("[invariance]", where[s], where["pos"], where["variant"]) for s in ("study", "rounding") if where]
    for what, study, pos, variant in named:
        if (pos, variant) not in cells[study]:
            raise ConfigError(
                f"{path}: {what} names {pos}/{variant}, a cell that study {study!r} ({registration.studies[study]}) "
                f"does not run (it runs {', '.join(f'{p}/{v}' for p, v in cells[study])})"
            )
    for test in registration.primary + registration.equivalence:
        if test.endpoint == "late" and not studies[test.study].late_band:
            raise ConfigError(
                f"{path}: test {test.name!r} is on the late band, which study {test.study!r} does not measure"
            )
        if test.plan_sd_from and len(test.plan_sd_from.split("/")) != 2:
            raise ConfigError(f"{path}: test {test.name!r}: plan_sd_from={test.plan_sd_from!r} is not pos/variant")


# ----------------------------------------------------------------------------------------------
# The plan: seeds and power


def pilot_sd(registration: Registration, pilot_cell: str, endpoint: str) -> tuple[float, int]:
    """The sd of a pilot cell's per-seed effects on an endpoint, and its number of seeds."""
    if not (registration.pilot and registration.pilot_config):
        raise ConfigError(
            f"a test is planned with the pilot's {pilot_cell} spread, but the registration names no pilot and "
            "pilot_config: give them, or the test's plan_sd"
        )
    study, base = parse_args([registration.pilot_config])
    offsets = sorted(set(study.probe_offsets) | {1, base.seq_len // 2})  # as studies.ablate probes them
    folder = Path(registration.pilot)
    pos, variant = pilot_cell.split("/")
    if not folder.is_dir():
        raise ConfigError(f"pilot={folder} is not a folder: give the study folder that holds the pilot's runs")
    diffs = []
    for run in sorted((folder / pos / variant).glob("seed*/result.json")):
        reference = folder / pos / "reference" / run.parent.name / "result.json"
        try:
            results = [json.loads(p.read_text())["result"] for p in (run, reference)]
            for path, result in zip((run, reference), results):
                if problem := result_problem(result):
                    raise ValueError(f"{path}: {problem}")
            values = [endpoints(result, study, offsets)[endpoint] for result in results]
        except (OSError, ValueError, KeyError, TypeError) as e:  # a run or its reference missing, damaged, or
            raise ConfigError(  # without the endpoint (a band that holds no scored target)
                f"the pilot's {run.parent} and its reference give no {endpoint} to plan with ({type(e).__name__}: {e})"
            ) from None
        diffs.append(values[0] - values[1])
    if len(diffs) < 2:
        raise ConfigError(f"{folder}: the pilot has {len(diffs)} finished {pilot_cell} run(s); its sd needs 2")
    return float(np.std(diffs, ddof=1)), len(diffs)


def planned_sd(registration: Registration, test: Test) -> tuple[float, str]:
    """The spread a test is planned with, and where it comes from."""
    if test.plan_sd:
        return test.plan_sd, registration.notes.get(test.name, "registered")
    pilot_cell = test.plan_sd_from or f"{test.pos}/{test.variant}"
    sd, n = pilot_sd(registration, pilot_cell, test.endpoint)
    bound = stats.sd_upper_limit(sd, n, 0.8)
    return bound, f"the pilot's {pilot_cell}: sd {sd:.4f} over {n} seeds, at its upper 80% confidence limit"


def study_seeds(registration: Registration) -> dict[str, dict]:
    """Each study's seeds of every cell, from its config."""
    return {name: seeds_of_cells(parse_args([config])[0]) for name, config in registration.studies.items()}


def plan_rows(registration: Registration) -> list[list]:
    """Each primary test's seeds, planned effect and spread, its power at Holm's strictest level, and the
    smallest effect it finds with the registered power."""
    seeds = study_seeds(registration)
    level = registration.alpha / len(registration.primary)  # Holm's first step: every later one is easier
    rows = []
    for test in registration.primary:
        sd, source = planned_sd(registration, test)
        n = len(seeds[test.study][test.pos, test.variant])
        if test.growth_from:
            n_before = len(seeds[test.growth_from][test.pos, test.variant])
            power_at = functools.partial(
                stats.welch_power, sd_a=test.plan_sd_before, n_a=n_before, sd_b=sd, n_b=n, alpha=level
            )
            count, needed = f"{n_before} + {n}", "-"
        else:
            power_at = functools.partial(stats.paired_power, sd=sd, n=n, alpha=level)
            count, needed = str(n), stats.seeds_for_power(test.plan_effect, sd, level, registration.power)
            needed = "over 200" if needed is None else needed  # seeds_for_power looks no further
        smallest = stats.smallest_detectable(power_at, registration.power, sd)
        rows.append([test.name, count, f"{test.plan_effect:g}", f"{sd:.4f}", source, needed])
        rows[-1] += [f"{power_at(test.plan_effect):.3f}", f"{smallest:.3f}"]
    return rows


def sized_seeds(registration: Registration) -> dict[str, int]:
    """The registered rule: each study runs the fewest seeds that give each of its paired tests the registered
    power at Holm's strictest level, and at most its budget (most_seeds)."""
    level = registration.alpha / len(registration.primary)
    sizes = {}
    for test in registration.primary:
        if test.growth_from:
            continue  # it takes the seeds of the two studies
        sd, _ = planned_sd(registration, test)
        needed = stats.seeds_for_power(test.plan_effect, sd, level, registration.power) or math.inf
        sizes[test.study] = max(sizes.get(test.study, 2), needed)
    return {name: min(n, registration.most_seeds.get(name, math.inf)) for name, n in sizes.items()}


def plan_lines(registration: Registration) -> list[str]:
    level = registration.alpha / len(registration.primary)
    header = [
        "test",
        "seeds",
        "planned effect",
        "planned sd",
        "sd from",
        f"seeds for power {registration.power}",
        "power",
        f"smallest effect at power {registration.power}",
    ]
    return [
        f"Power of each primary test at alpha {registration.alpha} / {len(registration.primary)} = {level:g} "
        "(Holm's first step, two-sided; later steps test at a higher level):",
        "",
        *markdown_table(header, plan_rows(registration)),
        "",
        "Seeds by the registered rule (the fewest with that power for each paired test, within the budget): "
        + ", ".join(f"{name} {n}" for name, n in sized_seeds(registration).items()),
    ]


# ----------------------------------------------------------------------------------------------
# Reading the studies


def read_study(config: str, studies_dir: Path | None, overrides: tuple[str, ...] = ()) -> tuple[Study, dict, list[int]]:
    """A study's settings (with the --key=value `overrides` it ran with), its runs (position kind -> variant ->
    seed -> result) and probe offsets, from its results.json (in its out_dir, or in studies_dir under the
    out_dir's last part)."""
    study, base = parse_args([config, *overrides])
    folder = Path(study.out_dir) if studies_dir is None else studies_dir / Path(study.out_dir).name
    path = folder / "results.json"
    if studies_dir is not None and not studies_dir.is_dir():
        raise ConfigError(f"--studies_dir={studies_dir} is not a folder")
    if not path.is_file():
        where = "or give --studies_dir" if studies_dir is None else f"or copy its folder into {studies_dir}"
        raise ConfigError(f"{path} not found: run python -m studies.ablate {config} first ({where})")
    try:
        saved = json.loads(path.read_text())
        runs, offsets, changed = saved_runs(saved), saved["probe_offsets"], settings_changed(saved, study, base)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{path} cannot be read as a study's results ({type(e).__name__}: {e})") from None
    if changed:
        raise ConfigError(f"{path} was written with other settings than {config} ({', '.join(changed)})")
    return study, runs, offsets


@dataclass
class Cell:
    """A cell's runs and its reference's, by seed."""

    values: dict[int, dict]  # seed -> endpoint -> value
    reference: dict[int, dict]
    documents: dict[int, np.ndarray]  # seed -> (2, documents): loss sums from the second token, counts
    reference_documents: dict[int, np.ndarray]
    where: str = "the cell"  # the study's folder and the cell, for an error
    scoring: str = "from_second"  # the documents' scoring, and the whole-document endpoint beside every test

    def measures(self, endpoint: str) -> bool:
        """Whether every run of the cell and its reference has the endpoint (a band that holds no scored target,
        or one the study does not measure, has none)."""
        return all(endpoint in values for values in (*self.values.values(), *self.reference.values()))

    def effects(self, endpoint: str) -> list[float]:
        if not self.measures(endpoint):
            raise ConfigError(
                f"{self.where}: not every run and its reference has a {endpoint} value (a band that holds no scored "
                "target in the validation documents, or one the study does not measure): nothing to decide on"
            )
        return [self.values[s][endpoint] - self.reference[s][endpoint] for s in sorted(self.values)]

    def reference_mean(self, endpoint: str) -> float:
        return float(np.mean([self.reference[s][endpoint] for s in sorted(self.values)]))


def whole_document_scoring(endpoint: str) -> str:
    """The whole-document endpoint shown beside a test, and bootstrapped over documents: its own where the test
    scores whole documents in context, the documents scored alone otherwise."""
    return "in_context" if endpoint.endswith("in_context") else "from_second"


def by_document(result: dict, scoring: str = "from_second") -> np.ndarray:
    """Each validation document's loss sum and count from its second token (the targets with and without the
    start marker share), scored alone or (scoring "in_context") after the documents before it in its row."""
    sums = np.asarray(result["val_doc_loss_sum_by_document"], dtype=float)
    counts = np.asarray(result["val_doc_count_by_document"], dtype=float)
    if "val_doc_first_token_loss_by_document" in result:  # under the marker, the first token is predicted from it
        sums, counts = sums - np.asarray(result["val_doc_first_token_loss_by_document"]), counts - 1
    if scoring == "in_context":  # the same targets, so the same counts
        sums = np.asarray(result["val_doc_loss_in_context_sum_by_document"], dtype=float)
    return np.stack([sums, counts])


def cell(study_runs: tuple[Study, dict, list[int]], pos: str, variant: str, scoring: str = "from_second") -> Cell:
    """The cell's runs and its reference's, for every seed its study's config runs: a missing one is refused
    (a study still running, or a results.json cut short), never decided without."""
    study, runs, offsets = study_runs
    if variant not in runs.get(pos, {}):
        raise ConfigError(f"{study.out_dir} has no {pos}/{variant} runs")
    mine, reference = runs[pos][variant], runs[pos]["reference"]
    seeds = seeds_of_cells(study).get((pos, variant), sorted(mine))
    for arm, by_seed in ((variant, mine), ("reference", reference)):
        if missing := [s for s in seeds if s not in by_seed]:
            raise ConfigError(
                f"{study.out_dir}: {pos}/{arm} has no run of seed(s) {', '.join(map(str, missing))} of the "
                f"{len(seeds)} its study runs: finish the study (python -m studies.ablate with its config)"
            )
    scored = [by_seed[s] for by_seed in (mine, reference) for s in seeds]
    needs = {"val_doc_loss_sum_by_document": "scored document by document"}  # the bootstrap over documents
    if scoring == "in_context":
        needs["val_doc_loss_in_context_sum_by_document"] = "scored in context"
    for key, words in needs.items():
        if not all(key in r for r in scored):
            raise ConfigError(f"{study.out_dir}: {pos}/{variant} or its reference has runs not {words} (no {key})")
    return Cell(
        {s: endpoints(mine[s], study, offsets) for s in seeds},
        {s: endpoints(reference[s], study, offsets) for s in seeds},
        {s: by_document(mine[s], scoring) for s in seeds},
        {s: by_document(reference[s], scoring) for s in seeds},
        f"{study.out_dir}: {pos}/{variant}",
        scoring,
    )


# ----------------------------------------------------------------------------------------------
# The decisions


def resampled_losses(documents: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """A run's whole-document loss under each bootstrap resample (a row of weights: how often each document
    was drawn)."""
    return (weights @ documents[0]) / (weights @ documents[1])


def bootstrap_interval(cells: list[Cell], signs: list[float], resamples: int, seed: int = 0) -> list[float]:
    """The 95% percentile interval of sum_i sign_i * (cell i's mean whole-document effect) when the validation
    documents are drawn again with replacement, the same draw for every run."""
    n_documents = next(iter(cells[0].documents.values())).shape[1]
    draws = np.random.default_rng(seed).integers(0, n_documents, size=(resamples, n_documents))
    weights = np.stack([np.bincount(row, minlength=n_documents) for row in draws]).astype(float)
    total = np.zeros(resamples)
    for one, sign in zip(cells, signs, strict=True):
        effects = [
            resampled_losses(one.documents[s], weights) - resampled_losses(one.reference_documents[s], weights)
            for s in sorted(one.documents)
        ]
        total += sign * np.mean(effects, axis=0)
    return [float(x) for x in np.percentile(total, [2.5, 97.5])]


def percent(effect: float, of: float) -> float:
    return 100 * effect / of


def paired_test(one: Cell, test: Test, resamples: int) -> dict:
    """A cell against its reference, seed by seed: the effect, its interval and p, the rank test's p and the
    smallest p its seeds allow, and the whole-document effect beside it."""
    effect = stats.paired_effect(one.effects(test.endpoint))
    whole = stats.paired_effect(one.effects(one.scoring))
    n = len(one.values)
    return {
        "seeds": n,
        "reference": one.reference_mean(test.endpoint),
        "estimate": effect.estimate,
        "ci95": list(effect.interval(0.95)),
        "percent": percent(effect.estimate, one.reference_mean(test.endpoint)),
        "sd": math.sqrt(n) * effect.se if n > 1 else math.inf,
        "p": effect.p_difference(),
        "p_rank": stats.signed_rank_p(one.effects(test.endpoint), [0.0] * n),
        "smallest_p_rank": stats.smallest_signed_rank_p(n),
        "whole": whole.estimate,
        "whole_ci95": list(whole.interval(0.95)),
        "whole_percent": percent(whole.estimate, one.reference_mean(one.scoring)),
        "whole_bootstrap95": bootstrap_interval([one], [1.0], resamples),
    }


def welch_growth(before: list[float], after: list[float]) -> tuple[float, list[float], float]:
    """The mean per-seed effect's change from `before` to `after`, its 95% interval and Welch's p."""
    growth, se, p = stats.welch_p(before, after)
    df = stats.welch_df(np.var(before, ddof=1), len(before), np.var(after, ddof=1), len(after))
    half = stats.t_quantile(0.975, df) * se
    return growth, [growth - half, growth + half], p


def size_change(before: float, growth: float) -> tuple[str, float]:
    """A growth test's change read against the earlier effect's sign, as the test decides only the change's
    sign: away from 0 it grows, toward 0 it shrinks ("past 0" where the later estimate has the other sign); and
    the change in % of the earlier effect. An effect of -0.05 that moves to -0.01 shrinks by 80%, though the
    difference is +0.04."""
    if before == 0:  # any change is away from 0
        return "grows", math.copysign(math.inf, growth) if growth else 0.0
    if growth * before > 0:
        return "grows", percent(growth, before)
    return "shrinks" + (", past 0" if before * (before + growth) < 0 else ""), percent(growth, before)


def growth_test(before: Cell, after: Cell, test: Test, resamples: int) -> dict:
    """How much a cell's effect grows from one study to another: Welch's test of the per-seed effects (the
    studies' seeds differ, so nothing pairs them), and the rank-sum test beside it."""
    effects_before, effects_after = before.effects(test.endpoint), after.effects(test.endpoint)
    growth, interval, p = welch_growth(effects_before, effects_after)
    whole_before = before.effects(before.scoring)
    whole_growth, whole_interval, _ = welch_growth(whole_before, after.effects(after.scoring))
    effect_before = float(np.mean(effects_before))
    words, size_percent = size_change(effect_before, growth)
    return {
        "seeds": f"{len(effects_before)} + {len(effects_after)}",
        "reference": effect_before,  # what it grows from: the earlier study's effect
        "estimate": growth,
        "ci95": interval,
        "size_change": words,
        "percent": size_percent,
        "p": p,
        "p_rank": stats.rank_sum_p(effects_before, effects_after),
        "smallest_p_rank": stats.smallest_rank_sum_p(len(effects_before), len(effects_after)),
        "whole": whole_growth,
        "whole_ci95": whole_interval,
        "whole_percent": size_change(float(np.mean(whole_before)), whole_growth)[1],
        "whole_bootstrap95": bootstrap_interval([after, before], [1.0, -1.0], resamples),
    }


def decide_family(results: dict[str, dict], alpha: float, growth: set[str]) -> None:
    """Holm over the family's difference tests, and over its rank tests; a rank test that no data could pass
    is marked unreachable. Holm's adjusted p never falls when any p rises, so a rank test's best case is the
    one where every test of the family reaches the smallest p its seeds allow."""
    adjusted = stats.holm({name: r["p"] for name, r in results.items()})
    adjusted_rank = stats.holm({name: r["p_rank"] for name, r in results.items()})
    best_case = stats.holm({name: r["smallest_p_rank"] for name, r in results.items()})
    for name, r in results.items():
        r["p_holm"], r["p_rank_holm"], r["best_p_rank_holm"] = adjusted[name], adjusted_rank[name], best_case[name]
        direction = r["size_change"] if name in growth else ("hurts" if r["estimate"] > 0 else "helps")
        r["verdict"] = direction if adjusted[name] < alpha else "unresolved"
        if math.isnan(adjusted[name]):
            r["verdict"] = "not decided: a value is not a number (a diverged run, or a cell of one seed)"
        r["rank_reachable"] = best_case[name] < alpha
        r["robust"] = bool(adjusted_rank[name] < alpha) if r["rank_reachable"] else None


def check_one_machine(read: dict, same_machine: str = "study") -> None:
    """Every run of every study on one CPU model (same_machine "study"), or the runs of each study's seed on one
    (same_machine "seed": the paired effects then compare runs of one machine, and only the spread between seeds
    holds the machines' rounding); each study's runs on its own thread count. Either difference changes the
    order of float sums, which training amplifies (a seed whose runs span two machines is trained again)."""
    machines: dict[str, list[str]] = {}
    for name, (study, runs, _) in read.items():
        for pos, variants in runs.items():
            for variant, by_seed in variants.items():
                for seed, result in by_seed.items():
                    where = f"{name}: {pos}/{variant}/seed{seed}"
                    machines.setdefault(result.get("trained_on", "unknown"), []).append(where)
                    if study.threads and result.get("threads") != study.threads:
                        raise ConfigError(
                            f"{where} ran on {result.get('threads')} threads, not the study's {study.threads}"
                        )
    if same_machine == "seed":
        for name, (_, runs, _) in read.items():
            for pos, variants in runs.items():
                seeds = {seed for by_seed in variants.values() for seed in by_seed}
                for seed in seeds:
                    on = {r[seed].get("trained_on", "unknown") for r in variants.values() if seed in r}
                    if len(on) > 1:
                        raise ConfigError(
                            f"{name}: {pos}/seed{seed}'s runs were trained on {len(on)} machines "
                            f"({', '.join(sorted(on))}); train the seed's runs again on one"
                        )
        return
    if len(machines) > 1:
        fewest = min(machines, key=lambda m: len(machines[m]))
        raise ConfigError(
            f"the runs were trained on {len(machines)} machines ({', '.join(machines)}); "
            f"train again on the study's machine: {', '.join(machines[fewest])} ({fewest})"
        )


def decide(registration: Registration, read: dict) -> dict:
    """Every registered decision, from the studies' runs (`read`: study name -> read_study's answer)."""
    check_one_machine(read, registration.same_machine)
    primary = {}
    for test in registration.primary:
        scoring = whole_document_scoring(test.endpoint)
        after = cell(read[test.study], test.pos, test.variant, scoring)
        if test.growth_from:
            before = cell(read[test.growth_from], test.pos, test.variant, scoring)
            primary[test.name] = growth_test(before, after, test, registration.bootstrap_resamples)
        else:
            primary[test.name] = paired_test(after, test, registration.bootstrap_resamples)
    decide_family(primary, registration.alpha, {t.name for t in registration.primary if t.growth_from})
    equivalence = {}
    for test in registration.equivalence:
        effect = stats.paired_effect(cell(read[test.study], test.pos, test.variant).effects(test.endpoint))
        equivalence[test.name] = {
            "estimate": effect.estimate,
            "ci90": list(effect.interval(0.90)),
            "margin": test.margin,
            "p": effect.p_equivalence(test.margin),
        }
    adjusted = stats.holm({name: r["p"] for name, r in equivalence.items()})
    for name, r in equivalence.items():
        r["p_holm"] = adjusted[name]
        r["verdict"] = "negligible" if adjusted[name] < registration.alpha else "not shown negligible"
    checks = {"invariance": invariance(registration, read)} if registration.invariance else {}
    if registration.rounding:
        checks["rounding"] = rounding(registration, read)
    return {"primary": primary, "equivalence": equivalence, **checks}


def rounding(registration: Registration, read: dict) -> dict:
    """How far the rerun moved the study's reference runs, per position kind, seed and endpoint. A rerun on
    another machine than its first run is refused: it would add that machine's rounding to what it measures."""
    study, rerun = (read[registration.rounding[k]] for k in ("study", "rerun"))
    moved = {}
    for pos in rerun[1]:
        for seed, result in rerun[1][pos]["reference"].items():
            machines = {run.get("trained_on", "unknown") for run in (study[1][pos]["reference"][seed], result)}
            if len(machines) > 1:
                raise ConfigError(
                    f"{registration.rounding['rerun']}: {pos}/reference/seed{seed} was trained on another machine "
                    f"than its first run ({' and '.join(sorted(machines))}); rerun it on the first one's"
                )
            first = endpoints(study[1][pos]["reference"][seed], study[0], study[2])
            again = endpoints(result, rerun[0], rerun[2])
            moved[f"{pos}/seed{seed}"] = {
                n: again[n] - first[n] for n in ROUNDING_ENDPOINTS if n in first and n in again
            }
    return moved


def invariance(registration: Registration, read: dict) -> dict:
    """The predicted-invariant cell's differences to its reference (in its study and in the rerun at another
    thread count) against how far the rerun moved the reference: within rounding when every one is at most
    invariance_factor times that."""
    where = registration.invariance
    rerun = read[where["rounding"]]
    checks = {}
    for name in ("early", "late", "from_second"):
        found = [
            cell(read[where["study"]], where["pos"], where["variant"]),
            cell(rerun, where["pos"], where["variant"]),
        ]
        if not all(one.measures(name) for one in found):  # reported as empty, as every report does
            checks[name] = {"differences": [], "rounding": [], "verdict": "not measured: no scored target"}
            continue
        differences = [d for one in found for d in one.effects(name)]
        shared = sorted(set(found[0].reference) & set(found[1].reference))
        rounding = [abs(found[1].reference[s][name] - found[0].reference[s][name]) for s in shared]
        bound = registration.invariance_factor * max(rounding)
        checks[name] = {
            "differences": differences,
            "rounding": rounding,
            # written so that a NaN (a diverged run) reads as beyond rounding
            "verdict": "within rounding" if all(abs(d) <= bound for d in differences) else "beyond rounding",
        }
    return checks


# ----------------------------------------------------------------------------------------------
# The report


def signed(value: float, interval: list[float]) -> str:
    return f"{value:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}]"


def primary_rows(decided: dict, alpha: float) -> list[list]:
    rows = []
    for name, r in decided["primary"].items():
        if r["robust"] is None:  # the best case: every test of the family at the smallest p its seeds allow
            rank = f"cannot pass (at best {r['best_p_rank_holm']:.2g})"
        else:
            rank = f"{r['p_rank_holm']:.2g}" + (" (not robust)" if r["robust"] is False and r["p_holm"] < alpha else "")
        rows.append(
            [name, r["seeds"], f"**{r['verdict']}**", f"{signed(r['estimate'], r['ci95'])}", f"{r['percent']:+.1f}%"]
            + [f"{r['p_holm']:.2g}", rank, f"{signed(r['whole'], r['whole_ci95'])} ({r['whole_percent']:+.1f}%)"]
            + ["[{:+.3f}, {:+.3f}]".format(*r["whole_bootstrap95"])]
        )
    return rows


def equivalence_lines(decided: dict) -> list[str]:
    if not decided["equivalence"]:  # a registration without equivalence tests
        return []
    rows = [
        [n, signed(r["estimate"], r["ci90"]), r["margin"], f"{r['p_holm']:.2g}", r["verdict"]]
        for n, r in decided["equivalence"].items()
    ]
    header = ["test", "effect [90% CI]", "margin", "Holm p", "verdict"]
    return ["## Equivalence (a family of its own)", "", *markdown_table(header, rows), ""]


def invariance_lines(registration: Registration, decided: dict) -> list[str]:
    if "invariance" not in decided:
        return []
    rows = [
        [
            ENDPOINT_NAMES[n],
            ", ".join(f"{d:+.2e}" for d in r["differences"]),
            ", ".join(f"{d:.2e}" for d in r["rounding"]),
            r["verdict"],
        ]
        for n, r in decided["invariance"].items()
    ]
    header = ["endpoint", "differences to the reference", "the rerun moved the reference", "verdict"]
    title = f"## Invariance: differences against the thread-count rerun's (x{registration.invariance_factor:g})"
    return [title, "", *markdown_table(header, rows), ""]


def rounding_lines(decided: dict) -> list[str]:
    if "rounding" not in decided:
        return []
    names = [n for n in ROUNDING_ENDPOINTS if any(n in moved for moved in decided["rounding"].values())]
    rows = [[run] + [f"{moved[n]:+.2e}" for n in names] for run, moved in decided["rounding"].items()]
    header = ["reference run", *(ENDPOINT_NAMES[n] for n in names)]
    return ["## Rounding: how far the rerun moved the reference", "", *markdown_table(header, rows), ""]


def report(registration: Registration, decided: dict) -> str:
    header = ["test", "seeds", "verdict", "effect [95% CI], nats", "% of the reference", "Holm p", "rank test, Holm p"]
    header += ["whole documents from the 2nd token [95% CI]", "over documents (bootstrap 95%)"]
    lines = [
        f"# {registration.title}: its registered decisions",
        "",
        f"Primary family: Holm over {len(registration.primary)} difference tests at family-wise alpha "
        f"{registration.alpha}. Effects are the variant's loss minus the reference's (positive: switching "
        "the fix off raises the loss, so the fix helps, and the verdict says the variant hurts); growth is the "
        "later study's effect minus the earlier one's, read against the earlier effect's sign: it grows (away "
        "from 0) or shrinks (toward 0; past 0 where the later estimate has the other sign), in % of the earlier "
        "effect. A rank test that cannot pass gives its best Holm p: every test of the family at the smallest p "
        "its seeds allow.",
        "",
        *markdown_table(header, primary_rows(decided, registration.alpha)),
        "",
        *equivalence_lines(decided),
        *invariance_lines(registration, decided),
        *rounding_lines(decided),
        "## As registered",
        "",
        *plan_lines(registration),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    try:
        if argv[0].startswith("--"):
            raise ConfigError(f"give the registration first: python -m studies.confirm REGISTRATION.toml {argv[0]}")
        options, overrides = read_options(argv[1:])
        if overrides and "plan" in options:
            raise ConfigError(f"--plan reads the studies' configs as registered: drop {' '.join(overrides)}")
        if "plan" in options and (others := sorted(options.keys() - {"plan"})):
            raise ConfigError(f"--plan reads no runs and writes nothing: drop --{others[0]}")
        if {"run", "studies_dir"} <= options.keys():
            raise ConfigError("--run decides from the runs it trains, in each study's out_dir: drop --studies_dir")
        registration = read_registration(Path(argv[0]))
        if "plan" in options:
            print("\n".join(plan_lines(registration)))
            return 0
        studies_dir = Path(options["studies_dir"]) if options.get("studies_dir") else None
        out = Path(options.get("out_dir") or "out/confirm")
        if "run" in options:
            check_writable_folder(out, "out_dir")  # before hours of training, not after
            if failed := run_studies(registration, overrides):
                return failed
        read = {name: read_study(config, studies_dir, overrides) for name, config in registration.studies.items()}
        decided = decide(registration, read)
        text = report(registration, decided)
        check_writable_folder(out, "out_dir")
        write_atomically(out / "confirm.json", json.dumps(decided, indent=1))
        write_atomically(out / "confirm.md", text)
        print(text + f"wrote {out / 'confirm.md'} and confirm.json")
    except (ConfigError, SaveFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def read_options(arguments: list[str]) -> tuple[dict[str, str], tuple[str, ...]]:
    """This command's options (--plan and --run alone, --studies_dir and --out_dir with a folder), and the
    studies' --key=value settings, which each study's config parser checks."""
    options, overrides = {}, []
    for argument in arguments:
        key, has_value, value = argument.removeprefix("--").partition("=")
        if not argument.startswith("--"):
            raise ConfigError(f"{argument!r}: give each option as --key=value (python -m studies.confirm --help)")
        if key in FLAGS and has_value:
            raise ConfigError(f"--{key} takes no value: give --{key} alone")
        if key in FOLDERS and not value:
            raise ConfigError(f"--{key} needs a folder: --{key}=DIR")
        if key not in FLAGS + FOLDERS and not has_value:
            raise ConfigError(f"unknown option(s) {key}: see python -m studies.confirm --help")
        if key in FLAGS + FOLDERS:
            options[key] = value
        else:
            overrides.append(argument)
    return options, tuple(overrides)


def run_studies(registration: Registration, overrides: tuple[str, ...]) -> int:
    """Every study of the registration in turn, each as its own `python -m studies.ablate CONFIG [overrides]`
    (a process of its own: compiled graphs do not pile up past dynamo's limit across studies). Finished runs
    are kept, so the same command continues a stopped registration. Returns the first failed study's exit
    code (0 if none failed): its one-line error, under its `===== study` heading, is the whole message."""
    for name, config in registration.studies.items():
        command = [sys.executable, "-m", "studies.ablate", config, *overrides]
        print(f"\n===== study {name}: {' '.join(command[1:])}", flush=True)
        if returncode := run_study(command):
            return returncode if returncode > 0 else 128 - returncode  # killed by signal N: the shell's 128 + N
    return 0


def run_study(command: list[str]) -> int:
    """A study in a child process of its own session, which a stop signal reaches once, from here: it finishes
    its step and saves its checkpoint before this process stops (subprocess.run kills a child 0.25 s after
    Ctrl-C, and at once on SIGTERM). A second stop is passed on too: the child then stops at once."""
    child = subprocess.Popen(command, start_new_session=True)
    try:
        return child.wait()
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM and SIGHUP as Interrupted
        signum = getattr(stop, "signum", signal.SIGINT)
        child.send_signal(signum)
        try:
            child.wait()
        except KeyboardInterrupt:
            child.send_signal(signum)
            child.wait()
        raise


if __name__ == "__main__":
    run_main(main)
