"""Every committed report is what today's code writes from the committed results: a code change that alters
one fails here until the report is rebuilt (each folder's README.md gives its command). Figures are not
drawn (seconds each; every number they show is in the markdown or the json)."""

import json
import math
import re
import shutil
import subprocess

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


def test_the_committed_confirmatory_decisions_are_what_todays_code_writes(tmp_path, monkeypatch, capsys):
    """From the committed studies that configs/confirm.toml registers: the decisions, every number beside them."""
    monkeypatch.chdir(ROOT)
    assert confirm.main(["configs/confirm.toml", "--studies_dir=results/decided", f"--out_dir={tmp_path}"]) == 0, (
        capsys.readouterr().err
    )
    for name in ("confirm.md", "confirm.json"):
        assert (tmp_path / name).read_bytes() == (DECIDED / "confirm" / name).read_bytes(), (
            f"results/decided/confirm/{name} is not what today's code writes from the committed studies: if the change "
            "is meant, rebuild it (python -m studies.confirm configs/confirm.toml --studies_dir=results/decided "
            "--out_dir=results/decided/confirm) and say what changed in its README.md"
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
