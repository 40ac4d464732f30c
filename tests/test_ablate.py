"""ablate.py: the study's settings, its seeds and run order, the endpoints and verdicts on known results,
the refusal to reuse runs made with other settings, and a tiny study end to end."""

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT

import cli
from config import Config
from errors import ConfigError, DataError, SaveFailed
from studies import ablate, plan, report, stats


@pytest.mark.parametrize(
    "name",
    ["ablate_cpu.toml", "ablate_cpu_stage2.toml", "ablate_gpu.toml", "import_leak_cpu.toml", "import_leak_gpu.toml"]
    + ["ladder_pilot.toml", "ladder_rung1.toml", "ladder_rung2.toml", "ladder_rung3.toml", "boundary_replication.toml"],
)
def test_shipped_study_configs_parse(name):
    study, base = plan.parse_args([str(ROOT / "configs" / name), "--seeds=5", "--max_iters=7"])
    assert study.seeds == 5 and base.max_iters == 7


def test_the_first_study_is_the_one_preregistered():
    study, _ = plan.parse_args([str(ROOT / "configs/ablate_cpu.toml")])
    assert (study.first_seed, study.early_band, study.middle_band) == (3, [0, 16], [16, 64])
    assert (study.margin_band, study.margin_doc_loss) == (0.02, 0.03)
    seeds = plan.seeds_of_cells(study)
    assert seeds["learned", "no_mask_boundary_loss"] == list(range(3, 15)) == seeds["rope", "reference"]
    assert len(seeds["rope", "no_reset_position_ids"]) == 2 and len(seeds["learned", "no_reset_position_ids"]) == 4


def test_the_second_stage_is_the_one_preregistered_on_seeds_the_first_did_not_use():
    first, _ = plan.parse_args([str(ROOT / "configs/ablate_cpu.toml")])
    second, second_base = plan.parse_args([str(ROOT / "configs/ablate_cpu_stage2.toml")])
    assert plan.parse_args([str(ROOT / "configs/ablate_cpu.toml")])[1] == second_base  # same training
    for key in ("early_band", "middle_band", "margin_band", "margin_doc_loss", "invariance_tolerance", "probe_docs"):
        assert getattr(first, key) == getattr(second, key), key
    seeds = plan.seeds_of_cells(second)
    assert set(seeds) == {("learned", v) for v in ("reference", "no_reset_position_ids", "no_mask_boundary_loss")}
    assert seeds["learned", "no_reset_position_ids"] == list(range(15, 39))
    assert seeds["learned", "no_mask_boundary_loss"] == list(range(15, 55)) == seeds["learned", "reference"]
    used_before = {s for cell in plan.seeds_of_cells(first).values() for s in cell}
    assert used_before == set(range(3, 15)) and not used_before & set(seeds["learned", "reference"])


def test_the_ladder_is_the_one_preregistered():
    """Three rungs of one model and data, 150 / 1,500 / 4,500 steps, the top at 10+ tokens a parameter and 30x
    the first stage's tokens; every stage's seeds disjoint from every other's (the pilot's included)."""
    import resolve
    from model import GPT

    rungs = [plan.parse_args([str(ROOT / f"configs/ladder_rung{n}.toml")]) for n in (1, 2, 3)]
    settings = [cfg for _, cfg in rungs]
    assert [cfg.max_iters for cfg in settings] == [150, 1500, 4500]
    assert all(cfg.bos and cfg.dataset == "packages" and cfg.seq_len == 1024 for cfg in settings)
    top = settings[2]
    tokens = top.max_iters * top.batch_size * top.seq_len
    params = GPT(resolve.model_settings(top, top.tokenizer_vocab_size + 1)).num_params()
    assert tokens / params >= 10 and tokens >= 30 * 150 * 2 * 1024
    assert [study.early_band for study, _ in rungs] == [[0, 16]] * 3 and rungs[0][0].late_band == [256, 1024]
    assert rungs[2][0].pos_embs == ["learned"]
    stages = ["ablate_cpu", "ablate_cpu_stage2", "ladder_pilot", "boundary_replication"]
    studies = [plan.parse_args([str(ROOT / f"configs/{name}.toml")])[0] for name in stages] + [s for s, _ in rungs]
    used = [{seed for cell in plan.seeds_of_cells(study).values() for seed in cell} for study in studies]
    for i, seeds in enumerate(used):
        for other in used[i + 1 :]:
            assert not seeds & other


def test_bad_study_settings_are_one_clear_error(tmp_path):
    config = tmp_path / "c.toml"
    for table, message in (
        ("seed = 3", "[ablate] unknown config key 'seed' (did you mean seeds?); run 'python -m studies.ablate --help'"),
        ('variants = ["no_doc_mask"]', "variants must include reference"),
        ('variants = ["reference", "no_mask"]', "variants='no_mask': choose one of reference, no_doc_mask"),
        ("pos_embs = 5", "pos_embs=5: expected a list of str"),
        ("import_leak = 3", "import_leak=3: expected bool"),
        ("leak_pairs = 0", "leak_pairs=0: must be at least 1"),
        ("seeds = [1]", "seeds=[1]: expected int"),
        ("early_band = [16, 0]", "early_band=[16, 0]: expected [first, last + 1]"),
        ("seeds_by_variant = { padding = 3 }", "seeds_by_variant names no variant padding"),
        ("seeds_by_variant = { pad = 0 }", "every count must be at least 1"),
        ("seeds_by_variant = { pad = 20000 }", "every count must be at least 1 and at most 10000"),
        ("seeds = 99999999999999999999", "seeds=99999999999999999999: must be at most 10000"),
        ("margin_band = nan", "margin_band=nan: must be a finite number"),
    ):
        config.write_text(f"[ablate]\n{table}\n")
        with pytest.raises(ConfigError, match=re.escape(message)):
            plan.parse_args([str(config)])
    with pytest.raises(ConfigError, match="seeds='x': expected int"):
        plan.parse_args([str(ROOT / "configs/ablate_cpu.toml"), "--seeds=x"])
    with pytest.raises(ConfigError, match="seeds=99999999999999999999: must be at most 10000"):
        plan.parse_args([str(ROOT / "configs/ablate_cpu.toml"), "--seeds=99999999999999999999"])
    with pytest.raises(ConfigError, match="unknown config key 'n_layers'"):
        plan.parse_args([str(ROOT / "configs/ablate_cpu.toml"), "--n_layers=3"])


def test_a_report_is_not_rebuilt_from_a_file_that_lacks_the_runs(tmp_path, capsys):
    old = tmp_path / "results.json"
    old.write_text(json.dumps({"summary": {}, "runs": {}}))
    assert report.main([str(old)]) == 1
    assert capsys.readouterr().err == f"error: {old} is not a study's results.json: it holds no runs\n"
    assert report.main([str(tmp_path / "none.json")]) == 1


@pytest.mark.parametrize(
    "arguments, words",
    [
        (["RESULTS", "--outdir=x"], "unknown option --outdir=x: the only one is --out_dir=DIR"),  # printed the help
        (["RESULTS", "--out_dir="], "--out_dir is empty: give a folder"),  # it wrote into the working folder
        (["RESULTS", "--out_dir"], "--out_dir needs a folder: --out_dir=DIR"),
        ([], "give one results.json (and, for a study before 2026-12-02, its config): 0 paths given"),
        (["RESULTS", "config.toml", "extra"], "3 paths given"),
    ],
)
def test_a_report_with_bad_options_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, arguments, words):
    saved = tmp_path / "study" / "results.json"
    saved.parent.mkdir()
    shutil.copy(ROOT / "results/decided/confirm_rung3/results.json", saved)
    monkeypatch.chdir(tmp_path)
    assert report.main([str(saved) if a == "RESULTS" else a for a in arguments]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["results.json", "study"]


def test_a_study_that_did_not_record_its_training_settings_is_rebuilt_from_its_config(tmp_path, capsys):
    """Stage 2 (2026-12-01) saved its [ablate] table but not train.py's settings: its report is rebuilt from
    the config it ran with, and gives the verdicts committed then; another study's config is refused."""
    saved = tmp_path / "results.json"
    shutil.copy(ROOT / "results/history/ablate_cpu_stage2/results.json", saved)
    assert report.main([str(saved)]) == 1
    assert "does not record its training settings" in capsys.readouterr().err
    assert report.main([str(saved), str(ROOT / "configs/ablate_cpu.toml")]) == 1
    assert "other settings than" in capsys.readouterr().err and not (tmp_path / "results.md").exists()
    assert report.main([str(saved), str(ROOT / "configs/ablate_cpu_stage2.toml")]) == 0
    table = (tmp_path / "results.md").read_text()
    assert "| learned | no_reset_position_ids | early band | 5.929 ± 0.068 | 5.988 ± 0.058 | **hurts**: +0.059" in table
    # the same effect from the saved sums, paired and tested by scipy
    import scipy.stats

    runs = json.loads(saved.read_text())["runs"]["learned"]

    def early(run: dict) -> float:
        return sum(run["val_doc_loss_sum_by_position"][:16]) / sum(run["val_doc_count_by_position"][:16])

    seeds = sorted(runs["no_reset_position_ids"])
    test = scipy.stats.ttest_rel(
        [early(runs["no_reset_position_ids"][s]) for s in seeds], [early(runs["reference"][s]) for s in seeds]
    )
    low, high = test.confidence_interval(0.95)
    assert f"**hurts**: +{(low + high) / 2:.3f} [+{low:.3f}, +{high:.3f}] |" in table and len(seeds) == 24


def test_a_figure_that_cannot_be_written_leaves_the_old_report_whole(tmp_path, monkeypatch, capsys):
    saved = tmp_path / "results.json"
    shutil.copy(ROOT / "results/history/ablate_cpu_stage2/results.json", saved)
    (tmp_path / "results.md").write_text("the report of the figures beside it")

    def disk_full(*args):
        raise SaveFailed("effects.png could not be written: no space left on device")

    monkeypatch.setattr(report, "plot", disk_full)
    assert report.main([str(saved), str(ROOT / "configs/ablate_cpu_stage2.toml")]) == 1
    assert "no space left" in capsys.readouterr().err
    assert (tmp_path / "results.md").read_text() == "the report of the figures beside it"


def test_help_lists_the_study_keys(capsys):
    assert ablate.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"--{key}=" in out for key in plan.STUDY_KEYS)


def test_seeds_per_cell_and_a_random_order_within_each_seed():
    study = plan.Study(seeds=3, seeds_by_variant={"no_mask_boundary_loss": 4}, invariance_seeds=2, first_seed=10)
    study.validate()
    seeds = plan.seeds_of_cells(study)
    assert seeds["learned", "reference"] == [10, 11, 12, 13] == seeds["rope", "reference"]  # every seed used
    assert seeds["rope", "no_reset_position_ids"] == [10, 11] and seeds["learned", "no_reset_position_ids"] == [
        10,
        11,
        12,
    ]
    order = plan.run_order(seeds)
    assert len(order) == sum(len(s) for s in seeds.values()) == len(set(order))
    assert [s for *_, s in order] == sorted(s for *_, s in order)  # seed by seed
    first_two = [[cell for *cell, s in order if s == seed] for seed in (10, 11)]
    assert sorted(first_two[0]) == sorted(first_two[1]) and first_two[0] != first_two[1]  # shuffled per seed
    assert order == plan.run_order(seeds)  # ...the same way on a rerun


def test_theory_says_where_nothing_can_change():
    assert plan.predicted_invariant("rope", "no_reset_position_ids")
    assert not plan.predicted_invariant("learned", "no_reset_position_ids")
    assert plan.probes_invariant("rope", "no_reset_position_ids") and plan.probes_invariant("learned", "pad")
    assert not plan.probes_invariant("learned", "no_reset_position_ids")
    assert not plan.probes_invariant("rope", "no_doc_mask") and not plan.probes_invariant("rope", "naive")


def fake_result(early: float, middle: float, doc_loss: float, offset_effect: float = 0.0, contamination: float = 0.0):
    """A run's result with these endpoint values: 10 documents, each scored at positions 0-63."""
    by_position = [early] * 16 + [middle] * 48
    return {
        "val_doc_loss": doc_loss,
        "val_loss": doc_loss,
        "val_doc_loss_sum_by_position": [10 * x for x in by_position],
        "val_doc_count_by_position": [10] * 64,
        "val_doc_loss_sum_by_document": [sum(by_position)] * 10,  # every document scored at positions 0-63
        "val_doc_count_by_document": [64] * 10,
        "offset_loss": {"1": 5.0, "32": 5.0 + offset_effect / 2, "64": 5.0 + offset_effect},
        "after_other": 5.0 + contamination,
        "wall_seconds": 1.0,
        "useful_tokens_per_sec": 1000.0,
    }


def test_band_loss_is_token_weighted():
    result = {"val_doc_loss_sum_by_position": [4.0, 9.0, 1.0], "val_doc_count_by_position": [2, 3, 1]}
    assert report.band_loss(result, [0, 2]) == pytest.approx(13 / 5) and report.band_loss(result, [2, 3]) == 1.0


def test_the_document_weighted_loss_is_the_mean_of_each_documents_own_loss():
    # a document of 10 targets with loss 1.0 and one of a single target with loss 2.0: each counts once,
    # (1.0 + 2.0) / 2 = 1.5, where token weighting would give 12 / 11
    result = {**fake_result(5.0, 5.0, 5.0), "val_doc_loss_sum_by_document": [10.0, 2.0]}
    result["val_doc_count_by_document"] = [10, 1]
    assert report.endpoints(result, plan.Study(), [1, 32, 64])["doc_weighted"] == pytest.approx(1.5)


def test_verdicts_on_known_results():
    """Seeds 0-5 of each cell: noise of sd ~0.01 around a planted effect."""
    rng = np.random.default_rng(0)
    study = plan.Study(variants=["reference", "no_doc_mask", "no_reset_position_ids", "no_mask_boundary_loss"])
    runs = {}
    for pos in ("learned", "rope"):
        runs[pos] = {}
        for variant, (d_early, d_doc) in {
            "reference": (0.0, 0.0),
            "no_doc_mask": (0.3, 0.0),  # hurts at the document start
            "no_reset_position_ids": (0.05 if pos == "learned" else 0.0, 0.0),
            "no_mask_boundary_loss": (0.0, 0.001),  # nothing: negligible
        }.items():
            runs[pos][variant] = {}
            for seed in range(6):
                base = 5.0 + 0.05 * seed  # the seed moves every variant alike
                noise = 0.0 if variant == "reference" or (pos, variant) == ("rope", "no_reset_position_ids") else 1
                e = noise * rng.normal(0, 0.01, 2)
                leak = variant == "no_doc_mask"
                runs[pos][variant][seed] = fake_result(
                    base + d_early + e[0],
                    base + e[1],
                    base + d_doc + e[1] / 10,
                    offset_effect=0.02 + 0.01 * rng.normal() if leak else 0.0,
                    contamination=0.03 if leak else 0.0,
                )
    summary = report.summarise(runs, study, [1, 32, 64])
    verdict = {key: {n: e.get("verdict") for n, e in cell["endpoints"].items()} for key, cell in summary.items()}
    assert verdict["learned/no_doc_mask"]["early"] == verdict["rope/no_doc_mask"]["early"] == "hurts"
    assert verdict["learned/no_reset_position_ids"]["early"] == "hurts"
    assert verdict["learned/no_mask_boundary_loss"]["val_doc_loss"] == "negligible"
    rope_reset = summary["rope/no_reset_position_ids"]["endpoints"]
    assert rope_reset["early"]["role"] == "invariant" and rope_reset["early"]["bitwise"]
    assert verdict["rope/no_reset_position_ids"]["early"] == "invariant"
    # the probes: invariant under the mask, measured (secondary, a bound) without it
    assert summary["learned/reference"]["endpoints"]["contamination"]["verdict"] == "invariant"
    contamination = summary["learned/no_doc_mask"]["endpoints"]["contamination"]
    assert contamination["role"] == "secondary" and contamination["estimate"] == pytest.approx(0.03)
    assert "verdict" not in contamination and contamination["bound"] >= 0.03
    assert_holm_decided(summary, expected_family=5)
    # a noisy cell with too few seeds stays unresolved
    for seed in range(6):
        runs["learned"]["no_mask_boundary_loss"][seed]["val_doc_loss"] += [0.1, -0.1, 0.05, 0.0, -0.02, 0.08][seed]
    noisy = report.summarise(runs, study, [1, 32, 64])["learned/no_mask_boundary_loss"]["endpoints"]["val_doc_loss"]
    assert noisy["verdict"] == "unresolved"


def test_a_variant_is_compared_with_its_own_baseline_seed_by_seed():
    """The boundary mask without the start marker is compared with the run without the marker (no_bos), not
    with the reference: an effect planted against no_bos is found whatever the reference does."""
    study = plan.Study(
        pos_embs=["rope"],
        variants=["reference", "no_bos", "no_bos_no_mask_boundary_loss"],
        seeds=4,
        primary={"no_bos": ["early"], "no_bos_no_mask_boundary_loss": ["val_doc_loss"]},
    )
    assert plan.seeds_of_cells(study)[("rope", "no_bos")] == [0, 1, 2, 3]
    rng = np.random.default_rng(1)
    runs = {"rope": {"reference": {}, "no_bos": {}, "no_bos_no_mask_boundary_loss": {}}}
    for seed in range(4):
        base = 5.0 + 0.1 * rng.normal()
        runs["rope"]["reference"][seed] = fake_result(base, base, base - 1.0)  # far from both: must not matter
        runs["rope"]["no_bos"][seed] = fake_result(base + 0.2, base, base)
        runs["rope"]["no_bos_no_mask_boundary_loss"][seed] = fake_result(base + 0.2, base, base - 0.05 + 1e-3 * seed)
    summary = report.summarise(runs, study, [1, 32, 64])
    boundary = summary["rope/no_bos_no_mask_boundary_loss"]
    assert boundary["baseline"] == "no_bos"
    assert boundary["endpoints"]["val_doc_loss"]["estimate"] == pytest.approx(-0.05 + 1.5e-3)
    assert summary["rope/no_bos"]["endpoints"]["early"]["estimate"] == pytest.approx(0.2)
    assert summary["rope/no_bos"]["endpoints"]["doc_weighted"]["estimate"] == pytest.approx(0.2 * 16 / 64)
    assert {e.get("p_wilcoxon") for e in boundary["endpoints"].values() if e.get("role") == "primary"} == {2 / 16}


@pytest.mark.parametrize(
    "table, settings, message",
    [
        ({"late_band": [256, 2048]}, {}, "late_band=[256, 2048] reaches past seq_len=1024"),
        ({"early_band": [0, 2000]}, {}, "early_band=[0, 2000] reaches past seq_len=1024"),
        ({"variants": ["reference", "no_bos"]}, {"bos": False}, "variant no_bos changes nothing from reference"),
        ({"variants": ["reference", "bestfit"]}, {"packing": "bestfit"}, "variant bestfit changes nothing"),
        (
            {"variants": ["reference", "no_mask_boundary_loss"], "primary": {"no_mask_boundary_loss": ["first_token"]}},
            {"bos": False},
            "first_token needs the start marker",
        ),
        # a reference with a fix off would make the invariance predictions false and the variants no-ops
        ({}, {"doc_mask": False}, "doc_mask=false: a study's reference trains with every fix on"),
        ({}, {"packing": "pad"}, "packing=pad: a study's reference packs documents into rows"),
        # under the marker, position seq_len - 1 holds no text: a band there scores nothing
        ({"late_band": [1023, 1024]}, {"bos": True}, "late_band=[1023, 1024]: positions are scored below 1023"),
        ({"primary": {"no_doc_mask": ["late"]}}, {}, "primary.no_doc_mask names late, but late_band is empty"),
        (
            {"variants": ["reference", "no_doc_mask"], "seeds_by_variant": {"no_doc_mask": 1}},
            {},
            "learned/no_doc_mask has a primary test but runs on 1 seed",
        ),
    ],
)
def test_a_study_the_settings_make_impossible_is_refused(table, settings, message):
    study = plan.Study(**table)
    study.validate()
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan.check_against(study, Config(seq_len=1024, **settings))


def test_the_edges_of_what_a_study_may_ask_are_accepted():
    """The checks above refuse only what cannot be measured: the last scored band under the marker, and two
    seeds, pass."""
    study = plan.Study(variants=["reference", "no_doc_mask"], seeds=2, late_band=[1022, 1023])
    study.validate()
    plan.check_against(study, Config(seq_len=1024, bos=True))
    invariant_on_one_seed = plan.Study(variants=["reference", "no_reset_position_ids"], invariance_seeds=1)
    invariant_on_one_seed.validate()
    plan.check_against(invariant_on_one_seed, Config(seq_len=1024))  # judged by its tolerance, not a t-test
    # a rerun that another study's registration reads has no tests of its own, so one seed serves
    rerun = plan.Study(variants=["reference", "naive"], seeds=1, primary={"naive": []})
    rerun.validate()
    plan.check_against(rerun, Config(seq_len=1024))


@pytest.mark.parametrize(
    "table, message",
    [
        ({"variants": ["reference"]}, "variants names only the reference"),
        ({"pos_embs": []}, "pos_embs is empty"),
        ({"variants": ["reference", "no_bos_no_mask_boundary_loss"]}, "compared with no_bos: add it to variants"),
        ({"primary": {"pad": ["early"]}, "variants": ["reference", "no_doc_mask"]}, "primary names 'pad'"),
        ({"primary": {"no_doc_mask": ["earliest"]}}, "choose endpoints among"),
        ({"late_band": [300, 300]}, "late_band=[300, 300]: expected"),
    ],
)
def test_study_tables_that_ask_for_nothing_are_refused(table, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan.Study(**table).validate()


def test_an_endpoint_without_scored_targets_is_not_a_number_but_absent():
    result = fake_result(5.0, 5.0, 5.0)
    values = report.endpoints(result, plan.Study(late_band=[100, 200]), [1, 32, 64])
    assert "late" not in values and "first_token" not in values and values["early"] == 5.0


@pytest.mark.parametrize("tail", ["cut", "zero"])
def test_a_band_no_validation_document_reaches_is_reported_empty_and_the_others_still_decide(tmp_path, tail):
    """Documents that all end before position 16 (the issue's case: studies.compare on them trained every run,
    then KeyError: 'middle'): the middle band is reported as empty, the early band and whole documents decide.
    The sums by position end where the documents do, or (as a run writes them) run on to seq_len as zeros: the
    loss-by-position figure leaves those positions out (it once subtracted None from None there)."""
    study = plan.Study(variants=["reference", "no_doc_mask"], primary={"no_doc_mask": ["early", "from_second"]})
    rng, runs = np.random.default_rng(0), {}
    for pos in ("learned", "rope"):
        for variant, effect in (("reference", 0.0), ("no_doc_mask", 0.3)):
            for seed in range(3):
                loss = 5.0 + 0.05 * seed + effect + rng.normal(0, 0.01)
                result = fake_result(loss, loss, loss)
                for key in ("val_doc_loss_sum_by_position", "val_doc_count_by_position"):
                    kept = result[key][:10]  # every document ends before position 10
                    result[key] = kept if tail == "cut" else kept + [0] * 54
                runs.setdefault(pos, {}).setdefault(variant, {})[seed] = result
    regime = dict(documents_per_row=4.0, tokens_seeing_another_document=0.5, median_document_tokens=6.0)
    env = {"command": "python -m studies.compare", "hardware": "CPU", "torch": "2.13.0", "commit": "abc"}
    report.write_report(runs, study, [1, 32, 64], Config(), {**regime, "mean_document_tokens": 6.0}, 1.0, tmp_path, env)
    summary = json.loads((tmp_path / "results.json").read_text())["summary"]
    mask = summary["learned/no_doc_mask"]["endpoints"]
    assert "middle" not in mask and mask["early"]["verdict"] == mask["from_second"]["verdict"] == "hurts"
    markdown = (tmp_path / "results.md").read_text()
    assert "- secondary: the middle band (positions 16-63; empty: no validation document reaches it)" in markdown
    row = r"\| learned/no_doc_mask \| 3 \| [\d.]+ ± [\d.]+ \| [\d.]+ ± [\d.]+ \| empty: no validation document reaches"
    assert re.search(row, markdown)  # val_doc_loss, the early band, then the middle band
    assert (tmp_path / "loss_by_position.png").stat().st_size > 10_000


def test_a_primary_band_no_validation_document_reaches_is_refused_before_anything_trains(tmp_path, capsys, monkeypatch):
    words = "def class return self value items for in if else".split()
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(words, rng.integers(1, 6))) for _ in range(3000)]  # at most 5 words each
    corpus = tmp_path / "short.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    argv = [str(write_tiny_study_config(corpus, tmp_path)), "--variants=reference,no_doc_mask"]
    assert ablate.main([*argv, "--primary=no_doc_mask=middle"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: primary.no_doc_mask = middle: middle_band=[16, 64] holds no scored target, since")
    assert "validation documents end before position" in err and err.count("\n") == 1
    assert not (tmp_path / "study" / "learned").exists()  # refused before any run

    def planned_runs(planned, study, offsets):  # on the early band the study goes on to train: stop it there
        raise ConfigError(f"{len(planned)} runs planned")

    monkeypatch.setattr(ablate, "train_planned", planned_runs)
    assert ablate.main([*argv, "--primary=no_doc_mask=early"]) == 1
    out, err = capsys.readouterr()
    assert "note: middle_band=[16, 64] holds no scored target in the validation documents" in out
    assert err == "error: 8 runs planned\n"  # 2 position kinds x 2 cells x 2 seeds


def assert_holm_decided(summary: dict, expected_family: int) -> None:
    """Every primary cell's adjusted p-values are Holm's over the whole primary family, and its verdict
    is what they say."""
    family = {(k, n): e for k, c in summary.items() for n, e in c["endpoints"].items() if e.get("role") == "primary"}
    assert len(family) == expected_family
    difference = stats.holm({k: e["p_difference"] for k, e in family.items()})
    equivalence = stats.holm({k: e["p_equivalence"] for k, e in family.items()})
    for key, e in family.items():
        assert (e["p_difference_holm"], e["p_equivalence_holm"]) == (difference[key], equivalence[key])
        effect = stats.Effect(e["estimate"], e["se"], e["df"])
        assert e["verdict"] == stats.primary_verdict(effect, difference[key], equivalence[key])


def test_a_run_folder_of_other_settings_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    decided = {"config": {"max_iters": 150, "eval_tokens": 0}, "shards": "stdlib-bpe4096-0e077582", "probes": {}}
    ablate.check_reusable(run, decided)  # nothing there yet
    (run / "study_run.json").write_text(json.dumps({"decided_by": decided}))
    ablate.check_reusable(run, json.loads(json.dumps(decided)))  # the same settings, through JSON
    changed = {**decided, "config": {"max_iters": 300, "eval_tokens": 0}}
    with pytest.raises(ConfigError, match=re.escape("other settings than this study's (config.max_iters)")):
        ablate.check_reusable(run, changed)
    (run / "result.json").write_text("{not json")
    with pytest.raises(ConfigError, match="result.json is damaged"):
        ablate.check_reusable(run, decided)


def cut(result: dict, key: str) -> dict:
    """The result with one of its lists cut to its first 3 entries (the key may be start_after_eot.NAME)."""
    if key.startswith("start_after_eot."):
        inner = key.removeprefix("start_after_eot.")
        return {**result, "start_after_eot": cut(result["start_after_eot"], inner)}
    return {**result, key: result[key][:3]}


KEPT_RUNS = {  # runs this code's studies wrote, kept: with every list a run writes, under the marker and without
    "marker": "results/decided/practitioner_packages/runs/practitioner_packages/rope/naive/seed600/result.json",
    "no marker": "results/decided/confirm_rung2/runs/confirm_rung2/learned/no_bos/seed500/result.json",
}
DAMAGES = [
    (lambda r: None, "it is not a run's result"),
    (lambda r: {}, "it has no val_loss"),
    (lambda r: {**r, "val_doc_loss": "x"}, "its val_doc_loss is 'x', not a finite number"),
    (lambda r: {**r, "wall_seconds": float("nan")}, "its wall_seconds is nan, not a finite number"),
    (lambda r: {**r, "val_first_token_loss": None}, "its val_first_token_loss is None"),
    (lambda r: {**r, "val_doc_count_by_position": [1, None]}, "val_doc_count_by_position is not a list of"),
    (lambda r: {k: v for k, v in r.items() if k != "useful_tokens_per_sec"}, "it has no useful_tokens_per_sec"),
    (lambda r: {k: v for k, v in r.items() if k != "after_other"}, "it has no after_other"),
    (lambda r: {k: v for k, v in r.items() if k != "val_doc_loss_sum_by_position"}, "it has no val_doc_loss_sum"),
    (lambda r: {k: v for k, v in r.items() if k != "val_doc_count_by_document"}, "it has no val_doc_count_by_doc"),
    (lambda r: {**r, "offset_loss": {"2": 1.0}}, "its offset_loss is not the probe's losses by offset"),
    (lambda r: {**r, "start_after_eot": []}, "its start_after_eot is not the losses by position after each EOT"),
    # a list cut short would be read as a run that scored fewer positions or documents
    (lambda r: cut(r, "val_doc_loss_sum_by_position"), "val_doc_loss_sum_by_position: 3, val_doc_count_by_pos"),
    (lambda r: cut(r, "val_doc_loss_sum_by_document"), "val_doc_loss_sum_by_document: 3"),
]


@pytest.mark.parametrize("kept", KEPT_RUNS)
def test_a_finished_run_whose_result_a_report_cannot_read_is_damaged(tmp_path, kept):
    result = json.loads((ROOT / KEPT_RUNS[kept]).read_text())["result"]
    decided = {"config": {"max_iters": 150}, "probes": {}}
    run = tmp_path / "run"
    run.mkdir()
    (run / "result.json").write_text(json.dumps({"result": result, "decided_by": decided}))
    ablate.check_reusable(run, decided)
    own = (  # the lists only one kind of run has
        [(lambda r: cut(r, "val_doc_first_token_loss_by_document"), "val_doc_first_token_loss_by_document: 3")]
        if kept == "marker"
        else [(lambda r: cut(r, "start_after_eot.sum_by_position"), "start_after_eot.sum_by_position: 3")]
    )
    for damage, reason in DAMAGES + own:
        (run / "result.json").write_text(json.dumps({"result": damage(result), "decided_by": decided}))
        path = re.escape(str(run / "result.json"))
        with pytest.raises(ConfigError, match=rf"^{path} is damaged \(.*{re.escape(reason)}.*\): delete"):
            ablate.check_reusable(run, decided)
    (run / "result.json").write_text(json.dumps({"decided_by": decided}))
    with pytest.raises(ConfigError, match="is damaged"):
        ablate.check_reusable(run, decided)


def test_a_results_file_with_a_damaged_run_is_refused_naming_the_run():
    saved = json.loads((ROOT / "results/decided/confirm_rung3/results.json").read_text())
    assert report.saved_runs(saved)["rope"]["reference"][400]["threads"] == 1  # as kept, every run reads
    sums = saved["runs"]["learned"]["reference"]["400"]["val_doc_loss_sum_by_position"]
    del sums[3:]  # the by-position counts stay whole: the bands would be read from part of the sums
    with pytest.raises(ValueError, match=r"^run learned/reference/seed400: its lists differ in length \(.*: 3, "):
        report.saved_runs(saved)


@pytest.mark.slow
def test_tiny_study_writes_the_report_and_skips_finished_runs(tiny_corpus, tmp_path):
    config = write_tiny_study_config(tiny_corpus, tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "studies.ablate", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    study = tmp_path / "study"
    report = json.loads((study / "results.json").read_text())
    assert_tiny_study_decided(report["summary"])
    assert_the_mask_keeps_out_what_precedes_a_document(report)
    runs = report["runs"]
    assert runs["rope"]["pad"]["0"]["steps"] >= runs["rope"]["reference"]["0"]["steps"]
    assert runs["rope"]["pad_equal_compute"]["0"]["steps"] == runs["rope"]["reference"]["0"]["steps"]
    assert report["regime"]["documents_per_row"] > 1
    markdown = assert_report_and_figures_written(study, result.stdout)
    assert_report_rebuilt_from_results(study, markdown)
    assert_finished_runs_skipped_and_other_settings_refused(config)


def write_tiny_study_config(tiny_corpus, tmp_path: Path) -> Path:
    """Every position kind and variant: 2 seeds (3 for no_mask_boundary_loss and its baseline), 2 steps a run."""
    config = tmp_path / "tiny.toml"
    config.write_text(
        f'dataset = "{tiny_corpus}"\ndata_dir = "{tmp_path / "data"}"\ntokenizer_vocab_size = 320\nseq_len = 64\n'
        "n_layer = 1\nn_head = 2\nn_embd = 32\nbatch_size = 4\nmax_iters = 2\neval_interval = 1\neval_tokens = 512\n"
        f'log_interval = 1\nwarmup_iters = 1\n[ablate]\nseeds = 2\nout_dir = "{tmp_path / "study"}"\n'
        "probe_docs = 8\nprobe_offsets = [16]\nseeds_by_variant = { no_mask_boundary_loss = 3 }\n"
    )
    return config


def assert_tiny_study_decided(summary: dict) -> None:
    """Every cell summarised over its own seeds, the primary family decided by Holm, an invariance checked."""
    assert sorted(summary) == sorted(f"{p}/{v}" for p in plan.POSITION_KINDS for v in plan.Study().variants)
    assert summary["learned/reference"]["seeds"] == [0, 1, 2] and summary["learned/naive"]["seeds"] == [0, 1]
    assert summary["rope/no_reset_position_ids"]["seeds"] == [0, 1]
    assert_holm_decided(summary, expected_family=11)  # rope/no_reset_position_ids is checked, not tested
    assert summary["rope/no_reset_position_ids"]["endpoints"]["early"]["role"] == "invariant"


def assert_the_mask_keeps_out_what_precedes_a_document(report: dict) -> None:
    summary, runs = report["summary"], report["runs"]
    # with the document mask and position reset, what precedes a document changes nothing...
    for pos in plan.POSITION_KINDS:
        contamination = summary[f"{pos}/reference"]["endpoints"]["contamination"]
        assert contamination["verdict"] == "invariant" and contamination["max_abs_difference"] < 1e-4
    # a run's own start after one EOT is, with the mask, the same as the document alone (its first target aside)
    for pos in plan.POSITION_KINDS:
        run = runs[pos]["reference"]["0"]
        after, n = run["start_after_eot"], len(run["start_after_eot"]["count_by_position"]) - 1
        assert after["count_by_position"][:n] == run["val_doc_count_by_position"][:n] and n > 30
        assert after["sum_by_position"][:n] == pytest.approx(run["val_doc_loss_sum_by_position"][:n], abs=2e-3)
        assert after["first_token_count"] == len(run["val_doc_count_by_document"])
    # ...while naive packing lets it in
    naive = runs["learned"]["naive"]["0"]
    assert abs(naive["offset_loss"]["32"] - naive["offset_loss"]["1"]) > 1e-4


def assert_report_and_figures_written(study: Path, stdout: str) -> str:
    """results.md, also printed, and the three figures; returns results.md."""
    markdown = (study / "results.md").read_text()
    assert "## Pre-registered endpoints and decision rules" in markdown and "hardware:" in markdown
    assert markdown.count("\n| learned | ") == 6 and markdown.count("\n| rope | ") == 6 and markdown in stdout
    for figure in ("effects.png", "loss_by_position.png", "offset_probe.png"):
        assert (study / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return markdown


def assert_report_rebuilt_from_results(study: Path, markdown: str) -> None:
    """The report is rebuilt from results.json alone, the verdicts computed again from the saved runs."""
    (study / "results.md").unlink()
    rebuilt = subprocess.run(
        [sys.executable, "-m", "studies.report", str(study / "results.json")], cwd=ROOT, capture_output=True, text=True
    )
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    stamp = re.compile(r" and rebuilt from its runs at commit [^\n]*")  # the one line a rebuild adds
    assert stamp.search(text := (study / "results.md").read_text()) and stamp.sub("", text) == markdown


def assert_finished_runs_skipped_and_other_settings_refused(config: Path) -> None:
    again = subprocess.run(
        [sys.executable, "-m", "studies.ablate", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0 and again.stdout.count("(finished before: skipped)") == len(
        plan.run_order(plan.seeds_of_cells(plan.parse_args([str(config)])[0]))
    )
    changed = subprocess.run(
        [sys.executable, "-m", "studies.ablate", str(config), "--eval_tokens=256"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert changed.returncode == 1 and "config.eval_tokens" in changed.stderr and "step" not in changed.stdout


def test_a_pad_run_gets_the_steps_for_as_many_real_tokens_and_keeps_the_rest():
    """Documents of 3, 5 and 17 tokens (EOT included) at seq_len 8 give pad rows of 3, 5, 9 and 9 tokens, so
    8, 8 and 8 of their inputs are real out of 3, 5, 8 and 8: the factor is 8 / 6."""
    from shards import Shards

    stream = np.concatenate([np.append(np.ones(n - 1, dtype=np.uint16), 63) for n in (3, 5, 17)])
    factor = ablate.pad_steps_factor(Shards(meta={"eot_id": 63}, train=stream, val=stream), 8)
    assert factor == pytest.approx(8 / 6)
    args = Config(seq_len=8, max_iters=30, warmup_iters=0, eval_interval=10, eval_tokens=-1)
    reference = plan.run_config(args, "learned", "reference", 0, Path("r"), factor)
    pad = plan.run_config(args, "learned", "pad", 0, Path("p"), factor)
    assert (pad.max_iters, pad.eval_interval, pad.warmup_iters) == (40, 13, 0)  # no warmup stays none
    assert pad.eval_tokens == reference.eval_tokens > 0  # the same documents, fixed before the stretch


def test_a_baseline_runs_every_seed_of_what_is_compared_with_it():
    study = plan.Study(
        pos_embs=["rope"],
        variants=["reference", "no_bos", "no_bos_no_mask_boundary_loss"],
        seeds=2,
        seeds_by_variant={"no_bos_no_mask_boundary_loss": 5},
    )
    seeds = plan.seeds_of_cells(study)
    assert seeds[("rope", "no_bos")] == seeds[("rope", "reference")] == [0, 1, 2, 3, 4]


def test_a_cells_interval_and_p_value_are_the_paired_t_tests():
    from scipy.stats import ttest_rel

    study = plan.Study(pos_embs=["learned"], variants=["reference", "no_doc_mask"], seeds=5)
    own = [5.31, 5.42, 5.27, 5.39, 5.35]
    base = [5.30, 5.36, 5.29, 5.31, 5.33]
    runs = {
        "learned": {
            "reference": {s: fake_result(v, v, v) for s, v in enumerate(base)},
            "no_doc_mask": {s: fake_result(v, v, v) for s, v in enumerate(own)},
        }
    }
    entry = report.summarise(runs, study, [1, 32, 64])["learned/no_doc_mask"]["endpoints"]["early"]
    expected = ttest_rel(own, base)
    assert entry["p_difference"] == pytest.approx(expected.pvalue, rel=1e-9) and entry["df"] == 4
    low, high = expected.confidence_interval(0.95)
    assert entry["ci95"] == pytest.approx([low, high], rel=1e-9)


def test_under_the_start_marker_the_probes_place_each_document_after_its_bos_as_training_does():
    """Probe documents, filler and unrelated documents are cut from the marked stream; with the document
    mask, a probe document after an EOT scores exactly as [BOS, text] alone from position 0."""
    from types import SimpleNamespace

    import torch

    from model import GPT, GPTConfig
    from studies.probes import doc_loss_in_rows, probe_inputs

    eot, bos, T, offset = 62, 63, 32, 8
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, eot, n), eot) for n in rng.integers(3, 40, 30)]
    split = SimpleNamespace(val=np.concatenate(docs), eot_id=eot)
    probe_docs, filler, unrelated = probe_inputs(split, 4, T, [offset], bos_id=bos)
    assert [d.tolist() for d in probe_docs] == [[bos, *doc.tolist()][: T - offset + 1] for doc in docs[:4]]
    assert filler[: len(docs[4]) + 2].tolist() == [bos, *docs[4].tolist(), bos]
    assert all(u[0] == bos and u[-1] == eot for u in unrelated)

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=T, n_layer=1, n_head=2, n_embd=16)).eval()
    cfg = Config(seq_len=T, dtype="float32")
    after_eot = doc_loss_in_rows(model, cfg, eot, [np.array([eot])] * 4, probe_docs, torch.device("cpu"))
    alone = []
    for d in map(torch.from_numpy, probe_docs):
        with torch.no_grad():
            alone += model(d[None, :-1], torch.arange(len(d) - 1)[None], None, d[None, 1:])[0].flatten().tolist()
    assert after_eot == pytest.approx(np.mean(alone), abs=1e-5)


def test_the_signed_rank_check_says_when_the_seeds_are_too_few_for_it_to_pass():
    """With n seeds the signed-rank test's smallest p is 2/2^n, and Holm multiplies the smallest by the family
    size: 8 seeds leave room for a family of 6 (6 x 2/256 < 0.05), not of 7. A clear effect is then robust,
    or out of the check's reach, never "not robust" for want of seeds."""

    def entry(differences: list[float]) -> dict:
        effect = stats.paired_effect(differences)
        return {
            "role": "primary",
            "estimate": effect.estimate,
            "se": effect.se,
            "df": effect.df,
            "p_difference": 1e-6,
            "p_equivalence": 0.9,
            "p_wilcoxon": stats.signed_rank_p(differences, [0.0] * len(differences)),
            "ci95": list(effect.interval(0.95)),
        }

    def family(size: int, differences: list[float], *others: list[float]) -> dict:
        cells = {f"learned/cell{i}": {"endpoints": {"early": entry(differences)}} for i in range(size)}
        cells |= {f"rope/other{i}": {"endpoints": {"early": entry(d)}} for i, d in enumerate(others)}
        report.decide_primary(cells)
        return cells["learned/cell0"]["endpoints"]["early"]

    clear = [0.1, 0.12, 0.09, 0.11, 0.1, 0.13, 0.08, 0.1]
    assert family(6, clear)["verdict"] == "hurts" and family(6, clear)["robust"] is True
    assert family(7, clear)["robust"] is None
    assert report.describe_effect(family(7, clear)).startswith("**hurts** (too few seeds to check)")
    one_heavy_seed = [0.5, -0.01, 0.02, -0.01, 0.01, -0.02, 0.01, 0.03]
    assert family(1, one_heavy_seed)["robust"] is False
    # beside a cell of 12 seeds the family could pass, but a cell of 3 never can: its own floor is 2/8
    assert family(1, clear[:3], [0.1] * 12)["robust"] is None
    assert family(1, [0.1 + 0.001 * i for i in range(12)], clear[:3])["robust"] is True
    # Holm's later steps: beside one cell of 12 seeds (its floor 2/4096, times 5), four cells of 6 seeds have
    # floors of 2/64 each, and Holm's second step multiplies theirs by 4: 0.125, out of reach for all four
    six = [0.1, 0.12, 0.09, 0.11, 0.1, 0.13]
    assert family(4, six, [0.1 + 0.001 * i for i in range(12)])["robust"] is None


def test_a_study_records_its_data_and_names_the_files_that_differ_at_a_later_start(tmp_path):
    from studies.ablate import check_data

    prepared = tmp_path / "data" / "corpus-bpe300-0123abcd"
    prepared.mkdir(parents=True)
    for name, content in (("meta.json", b"{}"), ("train_000000.bin", b"\x01\x02"), ("timings.json", b"1")):
        (prepared / name).write_bytes(content)
    out = tmp_path / "study"
    first = check_data(out, prepared)
    lines = (out / "data.sha256").read_text().splitlines()
    assert lines == [
        f"{hashlib.sha256(b'{}').hexdigest()}  corpus-bpe300-0123abcd/meta.json",
        f"{hashlib.sha256(bytes([1, 2])).hexdigest()}  corpus-bpe300-0123abcd/train_000000.bin",
    ]  # sha256sum's format; the timings are not data
    (prepared / "timings.json").write_bytes(b"2")
    assert check_data(out, prepared) == first
    (prepared / "train_000000.bin").write_bytes(b"\x01\x03")
    with pytest.raises(DataError, match=r"differ .*: corpus-bpe300-0123abcd/train_000000.bin; prepare"):
        check_data(out, prepared)


def test_a_study_counts_every_process_s_runs_in_its_progress_and_eta(tmp_path, capsys, monkeypatch):
    planned = [("learned", "reference", seed, Config(out_dir=str(tmp_path / f"seed{seed}")), {}) for seed in range(5)]
    (tmp_path / "seed1").mkdir()
    (tmp_path / "seed1" / "result.json").write_text("{}")  # finished before: skipped, not counted in the rate
    clock = [0.0]

    def train(cfg, study, decided, offsets, wait):  # a minute a run trained; a finished one is read back at once
        if not (Path(cfg.out_dir) / "result.json").exists():
            clock[0] += 60
            finish = [Path(cfg.out_dir)] + ([tmp_path / "seed4"] if cfg.out_dir.endswith("seed0") else [])
            for folder in finish:  # while seed 0 trains here, another process finishes seed 4
                folder.mkdir(exist_ok=True)
                (folder / "result.json").write_text("{}")
        return {"val_doc_loss": 1.0}

    monkeypatch.setattr(cli.time, "time", lambda: clock[0])
    monkeypatch.setattr(ablate, "run_one", train)
    runs = ablate.train_planned(planned, plan.Study(variants=["reference"], pos_embs=["learned"]), [1])
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("=== study")]
    # after seed 0: 3 of 5 finished, 2 of the 4 left at the start in one minute, so 2 more take another minute
    # (counting only this process's run would say 3 minutes); printed once a run, piped or not
    assert progress == [
        "=== study: 3/5 runs finished, 1 by this process; ETA 1m00s",
        "=== study: 4/5 runs finished, 2 by this process; ETA 0m40s",
        "=== study: 5/5 runs finished, 3 by this process; ETA 0m00s",
    ]
    assert sorted(runs["learned"]["reference"]) == [0, 1, 2, 3, 4]


def test_two_processes_of_a_study_share_its_runs_and_wait_for_each_others(tmp_path, capsys, monkeypatch):
    planned = [("learned", "reference", seed, Config(out_dir=str(tmp_path / f"seed{seed}")), {}) for seed in range(3)]
    trained = []

    def train(cfg, study, decided, offsets):
        trained.append(cfg.out_dir)
        (Path(cfg.out_dir) / "result.json").write_text(json.dumps({"result": {"val_doc_loss": 2.0}}))
        return {"val_doc_loss": 2.0}

    monkeypatch.setattr(ablate, "train_and_probe", train)
    (tmp_path / "seed1").mkdir()
    other = os.open(tmp_path / "seed1" / "study.lock", os.O_RDWR | os.O_CREAT)  # another process holds seed 1
    fcntl.flock(other, fcntl.LOCK_EX)

    def finish_seed1_then_release():
        time.sleep(0.5)
        (tmp_path / "seed1" / "result.json").write_text(json.dumps({"result": {"val_doc_loss": 1.5}}))
        os.close(other)

    threading.Thread(target=finish_seed1_then_release).start()
    runs = ablate.train_planned(planned, plan.Study(variants=["reference"], pos_embs=["learned"]), [1])
    assert trained == [str(tmp_path / "seed0"), str(tmp_path / "seed2")]  # seed 1 was the other process's
    assert runs["learned"]["reference"] == {
        0: {"val_doc_loss": 2.0},
        1: {"val_doc_loss": 1.5},
        2: {"val_doc_loss": 2.0},
    }
    out = capsys.readouterr().out
    assert "another process of this study is training it" in out and f"waiting for process {os.getpid()}" in out


def test_a_run_the_other_process_left_unfinished_is_resumed_by_the_one_waiting(tmp_path, monkeypatch):
    cfg = Config(out_dir=str(tmp_path / "seed0"))
    monkeypatch.setattr(ablate, "train_and_probe", lambda cfg, study, decided, offsets: {"val_doc_loss": 3.0})
    (tmp_path / "seed0").mkdir()
    other = os.open(tmp_path / "seed0" / "study.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(other, fcntl.LOCK_EX)
    assert ablate.run_one(cfg, plan.Study(), {}, [1], wait=False) is None
    threading.Timer(0.3, os.close, [other]).start()  # it stops without a result
    assert ablate.run_one(cfg, plan.Study(), {}, [1], wait=True) == {"val_doc_loss": 3.0}


def test_the_machine_a_run_records_tells_apart_cpus_that_share_a_model_name(monkeypatch):
    """CPUs of one model name can run kernels of different levels, which round floats differently; confirm
    refuses runs of two machines only if the record differs."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the device's name is recorded")
    recorded = {}
    for level in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda level=level: level)
        recorded[level] = ablate.hardware()
    assert recorded["AVX2"].endswith("cores, AVX2 kernels") and recorded["AVX512"].endswith("AVX512 kernels")
