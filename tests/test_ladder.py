"""The ladder's combined report: each rung's saved verdicts side by side, ordered by training tokens."""

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import ROOT

from errors import SaveFailed
from studies import ladder
from studies.plan import parse_args


def rung_config(tmp_path, name: str, max_iters: int) -> str:
    """The registered rung-1 config with its own out_dir and length."""
    text = (ROOT / "configs" / "ladder_rung1.toml").read_text()
    text = text.replace('out_dir = "out/ladder_rung1"', f'out_dir = "{tmp_path / name}"')
    text = text.replace("max_iters = 150", f"max_iters = {max_iters}")
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return str(path)


def result(loss: float, last: float | None = None) -> dict:
    """A run's result: 10 documents scored at every position 0-1023 with this loss (`last` at 1023)."""
    sums = [10 * loss] * 1023 + [10 * (loss if last is None else last)]
    return {
        "val_doc_loss": loss,
        "val_loss": loss,
        "wall_seconds": 1.0,
        "useful_tokens_per_sec": 1.0,
        "val_doc_loss_sum_by_position": sums,
        "val_doc_count_by_position": [10] * 1024,
        "val_doc_loss_sum_by_document": [sum(sums) / 10] * 10,
        "val_doc_count_by_document": [1024] * 10,
        "offset_loss": {"1": 5.0, "64": 5.0},
        "after_other": 5.0,
    }


def write_runs(tmp_path, name: str, runs: dict, **study_changes) -> None:
    """A results.json as studies.ablate writes it for the rung config `name`, as far as the ladder reads it;
    study_changes: [ablate] settings the study had that its config no longer has."""
    study, _ = parse_args([str(tmp_path / f"{name}.toml")])
    saved = {"runs": runs, "probe_offsets": [64], "study": {**dataclasses.asdict(study), **study_changes}}
    (tmp_path / name).mkdir()
    (tmp_path / name / "results.json").write_text(json.dumps(saved))


def no_doc_mask_runs(differences: list[float]) -> dict:
    """The reference and no_doc_mask, a seed per difference, from 100 on."""
    seeds = range(100, 100 + len(differences))
    return {
        "learned": {
            "reference": {seed: result(5.0 + 0.01 * seed) for seed in seeds},
            "no_doc_mask": {seed: result(5.0 + 0.01 * seed + d) for seed, d in zip(seeds, differences)},
        }
    }


def test_rungs_side_by_side_by_tokens(tmp_path, capsys):
    """Each rung decided again from its runs: early-band differences of 0.19, 0.20, 0.21 (mean 0.2, se
    0.01/sqrt(3), t(0.975, 2) = 4.3027: +-0.0248) hurt; -0.011, -0.010, -0.009 lie within the 0.02 margin."""
    long = rung_config(tmp_path, "long", 1500)
    short = rung_config(tmp_path, "short", 150)
    missing = rung_config(tmp_path, "missing", 4500)
    write_runs(tmp_path, "short", no_doc_mask_runs([0.19, 0.2, 0.21]))
    write_runs(tmp_path, "long", no_doc_mask_runs([-0.011, -0.01, -0.009]))
    out = tmp_path / "report"
    assert ladder.main([long, missing, short, f"--out_dir={out}"]) == 0
    assert "missing.toml: no" in capsys.readouterr().err  # a rung still running is left out, with a line
    saved = json.loads((out / "ladder.json").read_text())
    assert [r["tokens"] for r in saved] == [150 * 2 * 1024, 1500 * 2 * 1024]  # steps x rows x seq_len, in order
    # vocab 4096 + the BOS padded to 4160, width 64, 4 blocks, 1024 learned positions: 0.53M parameters
    assert saved[0]["parameters"] == 4160 * 64 + 4 * (12 * 64 * 64 + 4 * 64) + 2 * 64 + 1024 * 64
    row = next(line for line in (out / "ladder.md").read_text().splitlines() if line.startswith("| no_doc_mask"))
    assert row == (
        "| no_doc_mask | early band | **hurts** (too few seeds to check): +0.200 [+0.175, +0.225] "
        "| **negligible**: -0.010 [-0.012, -0.008] |"
    )
    assert (out / "effects.png").stat().st_size > 0


def test_rungs_are_read_from_studies_dir_and_the_ladder_written_under_out(tmp_path, monkeypatch):
    """--studies_dir=DIR reads each rung from DIR/<the last part of its out_dir> (results/history/ladder_rung1 for
    out/ladder_rung1, the committed rungs); without --out_dir the ladder goes to out/ladder, which git ignores."""
    config = rung_config(tmp_path, "rung", 150)
    write_runs(tmp_path, "rung", no_doc_mask_runs([0.19, 0.2, 0.21]))
    (tmp_path / "committed").mkdir()
    (tmp_path / "rung").rename(tmp_path / "committed" / "rung")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ladder, "plot", lambda *figure_inputs: None)
    assert ladder.main([config]) == 1  # the config's own out_dir has no results.json now
    assert ladder.main([config, "--studies_dir=committed"]) == 0
    assert "| no_doc_mask | early band | **hurts**" in (tmp_path / "out" / "ladder" / "ladder.md").read_text()


def test_bad_arguments_are_one_line(tmp_path, capsys):
    assert ladder.main([rung_config(tmp_path, "a", 150), "--out=x"]) == 2
    assert (
        capsys.readouterr().err
        == "error: unknown argument '--out=x': give rung configs, --studies_dir=DIR and --out_dir=DIR\n"
    )
    assert ladder.main(["--out_dir=x"]) == 2
    assert (
        capsys.readouterr().err
        == "error: no rung config given: give rung configs, --studies_dir=DIR and --out_dir=DIR\n"
    )
    assert ladder.main([str(tmp_path / "absent.toml")]) == 1
    assert capsys.readouterr().err.startswith("error: config file ")
    gpt2 = rung_config(tmp_path, "gpt2", 150)
    Path(gpt2).write_text(Path(gpt2).read_text().replace('tokenizer = "bpe"', 'tokenizer = "gpt2"'))
    assert ladder.main([gpt2]) == 1
    assert "the ladder counts parameters for a 'bpe' one" in capsys.readouterr().err
    other_margin = rung_config(tmp_path, "other_margin", 150)
    write_runs(tmp_path, "other_margin", no_doc_mask_runs([0.1, 0.2]), margin_band=0.05)
    assert ladder.main([other_margin, f"--out_dir={tmp_path / 'report'}"]) == 1
    assert "by a study with other settings than" in (err := capsys.readouterr().err) and "(study.margin_band)" in err
    no_counts = rung_config(tmp_path, "no_counts", 150)
    runs = no_doc_mask_runs([0.1, 0.2])
    del runs["learned"]["no_doc_mask"][100]["val_doc_count_by_position"]
    write_runs(tmp_path, "no_counts", runs)
    assert ladder.main([no_counts, f"--out_dir={tmp_path / 'report'}"]) == 1
    assert (
        "cannot be read as a study's results (ValueError: run learned/no_doc_mask/seed100: it has no "
        "val_doc_count_by_position)" in capsys.readouterr().err
    )
    summary_only = rung_config(tmp_path, "summary_only", 150)
    (tmp_path / "summary_only").mkdir()
    (tmp_path / "summary_only" / "results.json").write_text(json.dumps({"summary": {}}))
    assert ladder.main([summary_only, f"--out_dir={tmp_path / 'report'}"]) == 1
    assert "cannot be read as a study's results (KeyError: 'runs')" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()


def test_no_finished_rung_is_one_line(tmp_path, capsys):
    assert ladder.main([rung_config(tmp_path, "none", 150), f"--out_dir={tmp_path / 'report'}"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "error: no rung has finished: nothing to report"
    assert not (tmp_path / "report").exists()


def test_the_late_band_is_also_given_without_the_position_a_later_chunk_started_at(tmp_path):
    """Under the marker, evaluations before the fix counted a long document's second chunk at text position
    1023, inside the late band (256-1023). A planted +10 there in every variant run moves the late effect by
    (767 x 0.1 + 10) / 768 - 0.1 = 9.9 / 768; the ladder says so."""
    seeds = (100, 101, 102)
    runs = {
        "learned": {
            "reference": {seed: result(5.0 + 0.01 * seed) for seed in seeds},
            "no_reset_position_ids": {seed: result(5.1 + 0.01 * seed, 15.0 + 0.01 * seed) for seed in seeds},
        }
    }
    config = rung_config(tmp_path, "rung", 150)
    write_runs(tmp_path, "rung", runs)
    out = tmp_path / "report"
    assert ladder.main([config, f"--out_dir={out}"]) == 0
    (rung,) = json.loads((out / "ladder.json").read_text())
    late = rung["summary"]["learned/no_reset_position_ids"]["endpoints"]["late"]
    assert late["estimate"] == pytest.approx(0.1 + 9.9 / 768) and rung["late_shift"] == pytest.approx(9.9 / 768)
    assert "moves its effects by at most 1.3e-02 nats" in (out / "ladder.md").read_text()


def test_a_figure_that_cannot_be_written_leaves_the_old_tables_whole(tmp_path, monkeypatch, capsys):
    config = rung_config(tmp_path, "rung", 150)
    write_runs(tmp_path, "rung", no_doc_mask_runs([0.19, 0.2, 0.21]))
    out = tmp_path / "report"
    out.mkdir()
    (out / "ladder.md").write_text("the tables of the figure beside them")

    def disk_full(*args):
        raise SaveFailed("effects.png could not be written: no space left on device")

    monkeypatch.setattr(ladder, "plot", disk_full)
    assert ladder.main([config, f"--out_dir={out}"]) == 1
    assert "no space left" in capsys.readouterr().err
    assert (out / "ladder.md").read_text() == "the tables of the figure beside them"
    assert not (out / "ladder.json").exists()
