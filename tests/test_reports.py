"""Every committed report is what today's code writes from the committed results: a code change that alters
one fails here until the report is rebuilt (each folder's README.md gives its command). Figures are not
drawn (seconds each; every number they show is in the markdown or the json)."""

import json
import math
import re
import shutil
import subprocess
import tomllib

import numpy as np
import pytest
import scipy.stats
from conftest import ROOT

from studies import confirm, ladder, report

COMMITTED = ROOT / "results"
DECIDED, HISTORY = COMMITTED / "decided", COMMITTED / "history"
# written before results.json recorded the study's settings (2026-11-30): today's code refuses to rebuild them
FROM_BEFORE_REBUILDS = ("pilots/ablate_cpu_pilot", "history/import_leak_cpu")
# a study's folder under results/, as <group>/<study> (a running study's at the top: <study>)
STUDIES = sorted(
    saved.parent.relative_to(COMMITTED).as_posix()
    for saved in [*COMMITTED.glob("*/results.json"), *COMMITTED.glob("*/*/results.json")]
)
REBUILDABLE = [name for name in STUDIES if name not in FROM_BEFORE_REBUILDS]
# the commit that last rebuilt a report: the one part of it that moves on with the code
REBUILT_AT = re.compile(r"(rebuilt from its runs at commit )[^\n]*")


def rebuild_command(name: str) -> list[str]:
    """studies.report's arguments for a committed study, from the repository's root: its config too where it
    did not record its training settings (studies before 2026-12-02; each ran configs/<its folder's name>.toml)."""
    recorded = "config" in json.loads((COMMITTED / name / "results.json").read_text())
    return [f"results/{name}/results.json", *([] if recorded else [f"configs/{name.split('/')[-1]}.toml"])]


@pytest.mark.parametrize("name", REBUILDABLE)
def test_a_committed_report_is_what_todays_code_writes(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(report, "plot", lambda *figure_inputs: None)
    assert report.main([*rebuild_command(name), f"--out_dir={tmp_path}"]) == 0, capsys.readouterr().err
    rebuilt, committed = ((folder / "results.md").read_text() for folder in (tmp_path, COMMITTED / name))
    command = " ".join(["python -m studies.report", *rebuild_command(name), f"--out_dir=results/{name}"])
    assert REBUILT_AT.sub(r"\1<commit>", rebuilt) == REBUILT_AT.sub(r"\1<commit>", committed), (
        f"results/{name}/results.md is not what today's code writes from its results.json: if the change is "
        f"meant, rebuild it ({command}) and say what changed in its README.md"
    )


@pytest.mark.parametrize("name", FROM_BEFORE_REBUILDS)
def test_a_report_from_before_rebuilds_is_refused(name, tmp_path, capsys):
    assert report.main([str(COMMITTED / name / "results.json"), f"--out_dir={tmp_path}"]) == 1
    assert "written before reports could be rebuilt" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text", ["[]", '"x"', "{}", '{"study": {}}'])
def test_json_that_is_no_study_is_said_to_be_none(text, tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(text)
    assert report.main([str(path), f"--out_dir={tmp_path / 'out'}"]) == 1
    assert capsys.readouterr().err == f"error: {path} is not a study's results.json: it holds no runs\n"


def test_the_arms_by_position_are_each_arms_mean_loss_alone_and_in_context():
    """loss_by_position.png's top row, from sums worked by hand: each arm's mean over seeds in each position bin,
    and a dashed in-context line only for an arm whose every run kept the in-context sums."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def run(alone: list[float], in_context: list[float] | None = None) -> dict:
        result = {"val_doc_loss_sum_by_position": alone, "val_doc_count_by_position": [2, 2, 1, 0]}
        return result if in_context is None else {**result, report.IN_CONTEXT_SUMS: in_context}

    runs = {
        "rope": {
            "reference": {0: run([2, 4, 3, 0], [1, 2, 3, 0]), 1: run([4, 8, 1, 0], [3, 2, 1, 0])},
            "naive": {0: run([6, 6, 5, 0]), 1: run([2, 2, 5, 0], [0, 0, 0, 0])},
        }
    }
    fig, axes = plt.subplots(1, 1, squeeze=False)
    report.draw_arm_loss_by_position(axes[0], runs)
    lines = {line.get_label(): line for line in axes[0][0].get_lines()}
    assert list(lines) == ["reference", "reference, in context", "naive"]
    assert list(lines["reference"].get_xdata()) == [0, 1, 2]  # positions 0, 1 and 2: the third holds one target
    assert list(lines["reference"].get_ydata()) == [1.5, 3.0, 2.0]
    assert list(lines["reference, in context"].get_ydata()) == [1.0, 1.0, 2.0]
    assert list(lines["naive"].get_ydata()) == [2.0, 2.0, 5.0]
    plt.close(fig)


def test_the_committed_ladder_is_what_todays_code_writes(tmp_path, monkeypatch, capsys):
    """From the committed rungs, the configs it names, in the order it has them."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(ladder, "plot", lambda *figure_inputs: None)
    configs = [rung["config"] for rung in json.loads((HISTORY / "ladder" / "ladder.json").read_text())]
    assert ladder.main([*configs, "--studies_dir=results/history", f"--out_dir={tmp_path}"]) == 0, (
        capsys.readouterr().err
    )
    for name in ("ladder.md", "ladder.json"):
        assert (tmp_path / name).read_bytes() == (HISTORY / "ladder" / name).read_bytes(), (
            f"results/history/ladder/{name} is not what today's code writes from the committed rungs: if the change is "
            f"meant, rebuild it (python -m studies.ladder {' '.join(configs)} --studies_dir=results/history "
            "--out_dir=results/history/ladder) and say what changed in its README.md"
        )


@pytest.mark.parametrize(
    "registration, studies_dir, decided_dir",
    [
        ("configs/confirm.toml", "results/decided", "results/decided/confirm"),
        ("configs/practitioner.toml", "results/decided", "results/decided/practitioner"),
    ],
)
def test_the_committed_registered_decisions_are_what_todays_code_writes(
    registration, studies_dir, decided_dir, tmp_path, monkeypatch, capsys
):
    """From the committed studies that a registration names: the decisions, every number beside them."""
    monkeypatch.chdir(ROOT)
    assert confirm.main([registration, f"--studies_dir={studies_dir}", f"--out_dir={tmp_path}"]) == 0, (
        capsys.readouterr().err
    )
    for name in ("confirm.md", "confirm.json"):
        assert (tmp_path / name).read_bytes() == (ROOT / decided_dir / name).read_bytes(), (
            f"{decided_dir}/{name} is not what today's code writes from the committed studies: if the change is "
            f"meant, rebuild it (python -m studies.confirm {registration} --studies_dir={studies_dir} "
            f"--out_dir={decided_dir}) and say what changed in its README.md"
        )


def committed_runs(study: str, pos: str, variant: str) -> dict[int, dict]:
    runs = DECIDED / study / "runs" / study / pos / variant
    return {
        int(f.parent.name.removeprefix("seed")): json.loads(f.read_text())["result"] for f in runs.glob("*/result.json")
    }


def band_loss(result: dict, first: int, last: int) -> float:
    """The loss of positions first..last-1 of every validation document, from the run's per-position sums."""
    sums, counts = result["val_doc_loss_sum_by_position"], result["val_doc_count_by_position"]
    return sum(sums[first:last]) / sum(counts[first:last])


def whole_loss_from_second(result: dict) -> float:
    """Every validation document's loss from its second token: under the marker, its first token's loss (the
    one target a run without the marker never has) taken out."""
    sums, counts = sum(result["val_doc_loss_sum_by_document"]), sum(result["val_doc_count_by_document"])
    first_tokens = result.get("val_doc_first_token_loss_by_document")
    if first_tokens is not None:
        sums, counts = sums - sum(first_tokens), counts - len(first_tokens)
    return sums / counts


def paired_band_effects(study: str, pos: str, variant: str, band: tuple[int, int] | None = (0, 16)) -> np.ndarray:
    """Per seed, the variant's loss minus the reference's: in the band's positions, or (band None) over whole
    documents from the second token."""
    reference, variant_runs = committed_runs(study, pos, "reference"), committed_runs(study, pos, variant)
    loss = whole_loss_from_second if band is None else (lambda result: band_loss(result, *band))
    return np.array([loss(variant_runs[s]) - loss(reference[s]) for s in sorted(reference)])


def test_the_committed_confirmatory_decisions_recompute_with_scipy_from_the_runs():
    """Independent of studies/: each run's result.json, scipy's tests and Holm's step-down written out here."""
    decided = json.loads((DECIDED / "confirm" / "confirm.json").read_text())
    where = {
        "the mask, learned": ("confirm_rung3", "learned", "no_doc_mask"),
        "the mask, RoPE": ("confirm_rung3", "rope", "no_doc_mask"),
        "the position reset, learned": ("confirm_rung3", "learned", "no_reset_position_ids"),
        "the marker, learned (rung 2)": ("confirm_rung2", "learned", "no_bos"),
    }
    effects = {name: paired_band_effects(*cell) for name, cell in where.items()}
    p = {name: scipy.stats.ttest_1samp(d, 0.0).pvalue for name, d in effects.items()}
    growth = "growth of the mask's effect, learned, rung 2 to rung 3"
    before = paired_band_effects("confirm_rung2", "learned", "no_doc_mask")
    p[growth] = scipy.stats.ttest_ind(effects["the mask, learned"], before, equal_var=False).pvalue
    assert set(p) == set(decided["primary"])
    holm, running = {}, 0.0
    for step, name in enumerate(sorted(p, key=p.get)):
        running = max(running, min(1.0, (len(p) - step) * p[name]))
        holm[name] = running
    registered_seeds = {"confirm_rung3": 8, "confirm_rung2": 16}
    for name, d in effects.items():
        study, pos, variant = where[name]
        assert len(d) == decided["primary"][name]["seeds"] == registered_seeds[study]
        assert decided["primary"][name]["estimate"] == pytest.approx(d.mean(), rel=1e-9)
        whole = paired_band_effects(study, pos, variant, band=None)
        # the runs recorded their whole-document loss before rounding the per-document sums they keep
        assert decided["primary"][name]["whole"] == pytest.approx(whole.mean(), abs=1e-6)
        assert decided["primary"][name]["p_rank"] == pytest.approx(scipy.stats.wilcoxon(d).pvalue, rel=1e-9)
    for name in p:
        assert decided["primary"][name]["p_holm"] == pytest.approx(holm[name], rel=1e-6)
        expected = ("grows" if name == growth else "hurts") if holm[name] < 0.05 else "unresolved"
        assert decided["primary"][name]["verdict"] == expected
    late = paired_band_effects("confirm_rung3", "learned", "no_reset_position_ids", (256, 1024))
    se, df = late.std(ddof=1) / math.sqrt(len(late)), len(late) - 1
    tost = max(scipy.stats.t.sf((late.mean() + 0.02) / se, df), scipy.stats.t.cdf((late.mean() - 0.02) / se, df))
    assert decided["equivalence"]["the position reset's late band, learned"]["p"] == pytest.approx(tost, rel=1e-9)


PRACTITIONER_FIRST_SEEDS = {"packages": 600, "docs": 700, "docs_large": 900}


def practitioner_runs(study: str, pos: str, variant: str) -> dict[int, dict]:
    runs = DECIDED / f"practitioner_{study}" / "runs" / f"practitioner_{study}" / pos / variant
    return {
        int(f.parent.name.removeprefix("seed")): json.loads(f.read_text())["result"] for f in runs.glob("*/result.json")
    }


def whole_loss(result: dict, endpoint: str) -> float:
    """A run's loss over every validation document's targets from its second token, pooled: scored alone
    (`from_second`, the first token's loss taken out of each document's sum) or after the documents before it
    in its row (`in_context`, whose sums start at the second token)."""
    targets = sum(result["val_doc_count_by_document"]) - len(result["val_doc_count_by_document"])
    if endpoint == "in_context":
        return sum(result["val_doc_loss_in_context_sum_by_document"]) / targets
    return (sum(result["val_doc_loss_sum_by_document"]) - sum(result["val_doc_first_token_loss_by_document"])) / targets


def practitioner_effects(study: str, pos: str, endpoint: str) -> np.ndarray:
    """Per seed, the naive arm's whole-document loss minus the reference's, from runs of one commit, one thread
    and one CPU model a seed."""
    reference, naive = practitioner_runs(study, pos, "reference"), practitioner_runs(study, pos, "naive")
    first = PRACTITIONER_FIRST_SEEDS[study]
    assert sorted(reference) == sorted(naive) == list(range(first, first + 8))
    for seed in reference:
        pair = (reference[seed], naive[seed])
        assert {(r["trained_at_commit"], r["threads"]) for r in pair} == {("c602490", 1)}
        assert pair[0]["trained_on"] == pair[1]["trained_on"]
    return np.array([whole_loss(naive[s], endpoint) - whole_loss(reference[s], endpoint) for s in sorted(reference)])


def test_the_committed_practitioner_decisions_recompute_with_scipy_from_the_runs():
    """Independent of studies/: the twelve tests configs/practitioner.toml registers, from each run's
    per-document sums, scipy's tests and Holm's step-down written out here."""
    decided = json.loads((DECIDED / "practitioner" / "confirm.json").read_text())["primary"]
    registered = tomllib.loads((ROOT / "configs" / "practitioner.toml").read_text())["primary"]
    assert [test["name"] for test in registered] == list(decided)
    p, rank_p, estimate, direction = {}, {}, {}, {}
    for test in registered:
        name, after = test["name"], practitioner_effects(test["study"], test["pos"], test["endpoint"])
        if "growth_from" in test:
            before = practitioner_effects(test["growth_from"], test["pos"], test["endpoint"])
            estimate[name] = after.mean() - before.mean()
            p[name] = scipy.stats.ttest_ind(after, before, equal_var=False).pvalue
            rank_p[name] = scipy.stats.mannwhitneyu(after, before).pvalue
            away_from_zero = estimate[name] * before.mean() > 0
            past_zero = before.mean() * after.mean() < 0
            direction[name] = "grows" if away_from_zero else "shrinks, past 0" if past_zero else "shrinks"
        else:
            estimate[name] = after.mean()
            p[name] = scipy.stats.ttest_1samp(after, 0.0).pvalue
            rank_p[name] = scipy.stats.wilcoxon(after).pvalue
            direction[name] = "hurts" if after.mean() > 0 else "helps"
    holm, running = {}, 0.0
    for step, name in enumerate(sorted(p, key=p.get)):
        running = max(running, min(1.0, (len(p) - step) * p[name]))
        holm[name] = running
    for name, r in decided.items():
        # the runs recorded their whole-document losses before rounding the per-document sums they keep
        assert r["estimate"] == pytest.approx(estimate[name], abs=1e-6)
        assert r["whole"] == pytest.approx(estimate[name], abs=1e-6)
        assert r["p"] == pytest.approx(p[name], rel=1e-3)
        assert r["p_holm"] == pytest.approx(holm[name], rel=1e-3)
        assert r["p_rank"] == pytest.approx(rank_p[name], rel=1e-9)
        assert r["verdict"] == (direction[name] if holm[name] < 0.05 else "unresolved")


def test_the_committed_practitioner_rounding_rows_are_the_eager_rerun_minus_the_compiled_run():
    """How far training eager moved seed 600's reference, from the two runs' sums: no study code involved."""
    rounding = json.loads((DECIDED / "practitioner" / "confirm.json").read_text())["rounding"]
    assert sorted(rounding) == ["learned/seed600", "rope/seed600"]
    for pos in ("learned", "rope"):
        compiled = practitioner_runs("packages", pos, "reference")[600]
        eager = next(iter(practitioner_runs("rounding", pos, "reference").values()))
        moved = {
            "early": band_loss(eager, 0, 16) - band_loss(compiled, 0, 16),
            "late": band_loss(eager, 256, 1024) - band_loss(compiled, 256, 1024),
            "from_second": whole_loss(eager, "from_second") - whole_loss(compiled, "from_second"),
            "in_context": whole_loss(eager, "in_context") - whole_loss(compiled, "in_context"),
        }
        assert rounding[f"{pos}/seed600"] == pytest.approx(moved, abs=1e-6)


@pytest.mark.skipif(shutil.which("git") is None, reason="git tells which folders are committed")
def test_a_committed_report_is_rewritten_only_where_told(tmp_path, monkeypatch, capsys):
    """A results.json that git tracks: without --out_dir nothing is written (one error line); with its
    folder named, the report is rebuilt there."""
    monkeypatch.setattr(report, "plot", lambda *figure_inputs: None)
    study = tmp_path / "study"
    study.mkdir()
    shutil.copy(DECIDED / "import_leak_cpu_bos" / "results.json", study / "results.json")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "study/results.json"], check=True)
    assert report.main([str(study / "results.json")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0] == (
        f"error: {study} holds files that git tracks: give --out_dir=DIR for the report "
        f"(--out_dir={study} rewrites the committed one)"
    )
    assert sorted(p.name for p in study.iterdir()) == ["results.json"]
    assert report.main([str(study / "results.json"), f"--out_dir={study}"]) == 0
    assert (study / "results.md").is_file()
