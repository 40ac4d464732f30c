"""ablate.py end to end at a tiny size (two steps per run): the grid, the report's structure, the
figures, and that re-running skips finished runs."""

import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT

import ablate
import stats
from config import ConfigError


@pytest.mark.parametrize("name", ["ablate_cpu.toml", "ablate_gpu.toml", "import_leak_cpu.toml"])
def test_shipped_study_configs_parse(name):
    settings, train_args = ablate.parse_args([str(ROOT / "configs" / name), "--seeds=5", "--max_iters=7"])
    assert settings["seeds"] == 5 and "--max_iters=7" in train_args


def test_bad_study_settings_are_one_clear_error(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[ablate]\nseed = 3\n")
    with pytest.raises(ConfigError, match="unknown \\[ablate\\] key"):
        ablate.parse_args([str(config)])
    with pytest.raises(ConfigError, match="seeds='x'"):
        ablate.parse_args([str(ROOT / "configs/ablate_cpu.toml"), "--seeds=x"])
    with pytest.raises(ConfigError, match="unknown config key 'n_layers'"):
        ablate.parse_args([str(ROOT / "configs/ablate_cpu.toml"), "--n_layers=3"])
    for table, message in (
        ('variants = ["no_doc_mask"]', "variants must include reference"),
        ('variants = ["reference", "no_mask"]', "variants=['reference', 'no_mask']: expected a list of some of"),
        ('pos_embs = "rope"', "pos_embs='rope': expected a list of some of learned, rope"),
        ('import_leak = "yes"', "import_leak='yes': expected true or false"),
        ("leak_pairs = 0", "leak_pairs=0: must be at least 1"),
    ):
        config.write_text(f"[ablate]\n{table}\n")
        with pytest.raises(ConfigError, match=re.escape(message)):
            ablate.parse_args([str(config)])


@pytest.mark.slow
def test_tiny_study_writes_the_report_and_skips_finished_runs(tiny_corpus, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(
        f'dataset = "{tiny_corpus}"\ndata_dir = "{tmp_path / "data"}"\ntokenizer_vocab_size = 320\nseq_len = 64\n'
        "n_layer = 1\nn_head = 2\nn_embd = 32\nbatch_size = 4\nmax_iters = 2\neval_interval = 1\neval_tokens = 512\n"
        f'log_interval = 1\nwarmup_iters = 1\n[ablate]\nseeds = 2\nout_dir = "{tmp_path / "study"}"\n'
        "probe_docs = 8\nprobe_offsets = [16]\n"
    )
    result = subprocess.run(
        [sys.executable, "ablate.py", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    study = tmp_path / "study"
    report = json.loads((study / "results.json").read_text())
    summary = report["summary"]
    variants = [
        "reference",
        "no_doc_mask",
        "no_reset_position_ids",
        "no_mask_boundary_loss",
        "naive",
        "pad",
        "pad_equal_compute",
    ]
    assert sorted(summary) == sorted(f"{p}/{v}" for p in ("learned", "rope") for v in variants)
    for entry in summary.values():
        assert entry["seeds"] == 2
        assert {
            "val_doc_loss",
            "delta_val_doc_loss",
            "val_loss",
            "offset_0",
            "offset_16",
            "offset_32",
            "contamination",
            "wall_seconds",
            "useful_tokens_per_sec",
            "delta_val_doc_loss_ci95",
            "delta_val_doc_loss_verdict",
            "offset_effect_verdict",
            "contamination_verdict",
        } <= entry.keys()
        assert all(len(entry[m]) == 2 for m in ("val_doc_loss", "offset_32"))  # mean and spread
    assert summary["learned/reference"]["delta_val_doc_loss"] == [0.0, 0.0]
    # with the document mask and position reset, other documents before a document change nothing
    for pos in ("learned", "rope"):
        ref = report["runs"][pos]["reference"]["0"]
        assert abs(ref["offset_loss"]["32"] - ref["offset_loss"]["0"]) < 1e-4 and abs(ref["contamination"]) < 1e-4
    naive = report["runs"]["learned"]["naive"]["0"]
    assert abs(naive["offset_loss"]["32"] - naive["offset_loss"]["0"]) > 1e-4  # ...while naive packing leaks
    # pad runs see as many real tokens as packed runs: more steps; pad_equal_compute as many steps
    assert report["runs"]["rope"]["pad"]["0"]["steps"] > report["runs"]["rope"]["reference"]["0"]["steps"]
    assert (
        report["runs"]["rope"]["pad_equal_compute"]["0"]["steps"] == report["runs"]["rope"]["reference"]["0"]["steps"]
    )
    assert summary["rope/reference"]["contamination_verdict"] == "no effect"  # exactly 0 with the mask
    markdown = (study / "results.md").read_text()
    assert markdown.count("\n| learned/") == 7 and markdown.count("\n| rope/") == 7 and "hardware:" in markdown
    assert "| variant | val_doc_loss | Δ ref | verdict |" in markdown and markdown in result.stdout
    for figure in ("val_loss.png", "loss_by_position.png", "offset_probe.png"):
        assert (study / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = subprocess.run(
        [sys.executable, "ablate.py", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0 and again.stdout.count("(finished before: skipped)") == 28


def test_confidence_interval_and_verdicts():
    low, high = stats.confidence_interval([1.0, 2.0, 3.0])  # mean 2, sd 1, t(2) = 4.303
    assert low == pytest.approx(2 - 4.303 / 3**0.5) and high == pytest.approx(2 + 4.303 / 3**0.5)
    assert stats.confidence_interval([0.5]) == (float("-inf"), float("inf"))
    assert stats.verdict(stats.confidence_interval([0.03, 0.04, 0.035])) == "hurts"
    assert stats.verdict(stats.confidence_interval([-0.03, -0.04, -0.035])) == "helps"
    assert stats.verdict(stats.confidence_interval([0.001, -0.002, 0.0, 0.001])) == "no effect"
    assert stats.verdict(stats.confidence_interval([0.03, -0.04, 0.01])) == "unresolved"
    assert stats.verdict(stats.confidence_interval([0.5])) == "unresolved"
