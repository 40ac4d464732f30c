"""The ladder's combined report: each rung's saved verdicts side by side, ordered by training tokens."""

import json
from pathlib import Path

import pytest
from conftest import ROOT

from studies import ladder


def rung_config(tmp_path, name: str, max_iters: int) -> str:
    """The registered rung-1 config with its own out_dir and length."""
    text = (ROOT / "configs" / "ladder_rung1.toml").read_text()
    text = text.replace('out_dir = "out/ladder_rung1"', f'out_dir = "{tmp_path / name}"')
    text = text.replace("max_iters = 150", f"max_iters = {max_iters}")
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return str(path)


def primary(estimate: float, low: float, high: float, verdict: str) -> dict:
    return {"role": "primary", "estimate": estimate, "ci95": [low, high], "verdict": verdict, "values": [estimate]}


def write_results(tmp_path, name: str, summary: dict) -> None:
    (tmp_path / name).mkdir()
    (tmp_path / name / "results.json").write_text(json.dumps({"summary": summary}))


def test_rungs_side_by_side_by_tokens(tmp_path, capsys):
    long = rung_config(tmp_path, "long", 1500)
    short = rung_config(tmp_path, "short", 150)
    missing = rung_config(tmp_path, "missing", 4500)
    write_results(tmp_path, "short", {"learned/no_doc_mask": {"endpoints": {"early": primary(0.2, 0.1, 0.3, "hurts")}}})
    write_results(
        tmp_path, "long", {"learned/no_doc_mask": {"endpoints": {"early": primary(-0.01, -0.02, 0.0, "equivalent")}}}
    )
    out = tmp_path / "report"
    assert ladder.main([long, missing, short, f"--out_dir={out}"]) == 0
    assert "missing.toml: no" in capsys.readouterr().err  # a rung still running is left out, with a line
    saved = json.loads((out / "ladder.json").read_text())
    assert [r["tokens"] for r in saved] == [150 * 2 * 1024, 1500 * 2 * 1024]  # steps x rows x seq_len, in order
    # vocab 4096 + the BOS padded to 4160, width 64, 4 blocks, 1024 learned positions: 0.53M parameters
    assert saved[0]["parameters"] == 4160 * 64 + 4 * (12 * 64 * 64 + 4 * 64) + 2 * 64 + 1024 * 64
    row = next(line for line in (out / "ladder.md").read_text().splitlines() if line.startswith("| no_doc_mask"))
    assert (
        row
        == "| no_doc_mask | early band | **hurts**: +0.200 [+0.100, +0.300] | **equivalent**: -0.010 [-0.020, +0.000] |"
    )
    assert (out / "effects.png").stat().st_size > 0


def test_bad_arguments_are_one_line(tmp_path, capsys):
    assert ladder.main([rung_config(tmp_path, "a", 150), "--out=x"]) == 2
    assert capsys.readouterr().err == "error: unknown argument '--out=x': give rung configs and --out_dir=DIR\n"
    assert ladder.main(["--out_dir=x"]) == 2
    assert capsys.readouterr().err == "error: no rung config given: give rung configs and --out_dir=DIR\n"
    assert ladder.main([str(tmp_path / "absent.toml")]) == 1
    assert capsys.readouterr().err.startswith("error: config file ")
    gpt2 = rung_config(tmp_path, "gpt2", 150)
    Path(gpt2).write_text(Path(gpt2).read_text().replace('tokenizer = "bpe"', 'tokenizer = "gpt2"'))
    assert ladder.main([gpt2]) == 1
    assert "the ladder counts parameters for a 'bpe' one" in capsys.readouterr().err


def test_no_finished_rung_is_one_line(tmp_path, capsys):
    assert ladder.main([rung_config(tmp_path, "none", 150), f"--out_dir={tmp_path / 'report'}"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "error: no rung has finished: nothing to report"
    assert not (tmp_path / "report").exists()


def test_the_late_band_is_also_given_without_the_position_a_later_chunk_started_at(tmp_path, capsys):
    """Under the marker, evaluations before the fix counted a long document's second chunk at text position
    1023, inside the late band (256-1023). A planted +10 there in every variant run moves the late effect by
    (767 x 0.1 + 10) / 768 - 0.1 = 9.9 / 768; the ladder says so."""
    from studies import plan, report

    def result(loss: float, last: float) -> dict:
        sums = [10 * loss] * 1023 + [10 * last]
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

    runs = {
        "learned": {
            "reference": {seed: result(5.0 + 0.01 * seed, 5.0 + 0.01 * seed) for seed in (100, 101, 102)},
            "no_reset_position_ids": {seed: result(5.1 + 0.01 * seed, 15.0 + 0.01 * seed) for seed in (100, 101, 102)},
        }
    }
    config = rung_config(tmp_path, "rung", 150)
    study, _ = plan.parse_args([config])
    summary = report.summarise(runs, study, [64])
    (tmp_path / "rung").mkdir()
    saved = {"summary": summary, "runs": runs, "probe_offsets": [64]}
    (tmp_path / "rung" / "results.json").write_text(json.dumps(saved))
    assert summary["learned/no_reset_position_ids"]["endpoints"]["late"]["estimate"] == pytest.approx(0.1 + 9.9 / 768)
    out = tmp_path / "report"
    assert ladder.main([config, f"--out_dir={out}"]) == 0
    assert json.loads((out / "ladder.json").read_text())[0]["late_shift"] == pytest.approx(9.9 / 768)
    assert "moves its effects by at most 1.3e-02 nats" in (out / "ladder.md").read_text()
