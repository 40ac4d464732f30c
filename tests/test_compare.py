"""studies/compare.py: the one-command comparison on a user's data. It runs the reference against the
document mask off and naive packing, says how far the models trained, never calls an effect negligible on
barely trained models, prints a short table and draws the loss by position."""

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from shards import load_shards
from studies import compare, plan

ROOT = Path(__file__).resolve().parent.parent


def effect(verdict: str, estimate: float = 0.001) -> dict:
    return {"estimate": estimate, "ci95": [estimate - 0.01, estimate + 0.01], "verdict": verdict, "role": "primary"}


def test_negligible_is_said_only_of_well_trained_models():
    trained, barely = {"well_trained": True}, {"well_trained": False}
    assert compare.verdict_line(effect("negligible"), trained).endswith("decided: negligible")
    assert compare.verdict_line(effect("negligible"), barely).endswith("not decided")
    # a difference decided on barely trained models is still decided: the test does not depend on training
    assert compare.verdict_line(effect("hurts", 0.3), barely).endswith("decided: the fix helps")
    assert compare.verdict_line(effect("helps", -0.3), trained).endswith("decided: the fix hurts")
    assert compare.verdict_line(effect("unresolved"), trained).endswith("not decided")


def test_position_bins_double_and_cover_every_position_once():
    assert compare.position_bins(20) == [0, 1, 2, 4, 8, 16, 20]
    result = {"val_doc_loss_sum_by_position": [2.0, 3.0, 4.0, 8.0, 1.0], "val_doc_count_by_position": [1, 1, 2, 2, 0]}
    binned = compare.binned_loss(result, compare.position_bins(5))
    assert binned[:3] == [2.0, 3.0, 3.0] and math.isnan(binned[3])  # positions 2-3 weighted by tokens; 4: none


def test_the_shipped_configs_are_the_three_arms_on_both_position_kinds():
    for name in ("compare.toml", "compare_gpu.toml"):
        study, base = plan.parse_args([str(ROOT / "configs" / name)])
        assert study.variants == ["reference", "no_doc_mask", "naive"] and study.pos_embs == ["learned", "rope"]
        assert base.bos and base.doc_mask and base.reset_position_ids and base.mask_boundary_loss
        assert base.warmup_iters * 4 <= base.max_iters and study.seeds == 3
    assert "UNTESTED" in (ROOT / "configs" / "compare_gpu.toml").read_text()


def test_the_quick_comparison_trains_with_the_confirmatory_studys_recipe():
    _, quick = plan.parse_args([str(ROOT / "configs" / "compare.toml")])
    _, registered = plan.parse_args([str(ROOT / "configs" / "confirm_rung3.toml")])
    assert (quick.lr, quick.min_lr) == (registered.lr, registered.min_lr)
    assert quick.warmup_iters == round(quick.max_iters * registered.warmup_iters / registered.max_iters)


@pytest.mark.slow
def test_the_command_compares_on_a_tiny_setting(tiny_corpus, tmp_path):
    out = tmp_path / "compare"
    settings = dict(
        dataset=tiny_corpus, data_dir=tmp_path / "data", out_dir=out, tokenizer_vocab_size=320, seq_len=64,
        n_layer=1, n_head=2, n_embd=32, batch_size=4, max_iters=3, warmup_iters=1, eval_interval=3,
        eval_tokens=1024, log_interval=1, seeds=2, probe_docs=4, probe_offsets=16,
    )  # fmt: skip
    command = [sys.executable, "-m", "studies.compare", *(f"--{k}={v}" for k, v in settings.items())]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((out / "results.json").read_text())
    assert sorted(saved["summary"]) == [
        f"{p}/{v}" for p in ("learned", "rope") for v in ("naive", "no_doc_mask", "reference")
    ]
    assert (out / "by_position.png").stat().st_size > 10_000
    printed = result.stdout[result.stdout.index("trained: ") :]
    tokens = 3 * 4 * 64
    assert f"trained: {tokens / 1e6:.2f}M tokens a run" in printed and "barely trained" in printed
    rows = [line for line in printed.splitlines() if line.startswith(("learned ", "rope "))]
    assert len(rows) == 8 and "negligible" not in "\n".join(rows)
    for line in rows:  # each effect as results.json has it: the variant minus the reference, seed by seed
        pos, arm = line.split()[:2]
        variant = {"mask": "no_doc_mask", "naive": "naive"}[arm]
        endpoint = "early" if "positions 0-15" in line else "from_second"
        values = saved["summary"][f"{pos}/{variant}"]["endpoints"][endpoint]["values"]
        reference = saved["summary"][f"{pos}/reference"]["endpoints"][endpoint]["values"]
        assert f"{np.mean(np.subtract(values, reference)):+.3f} [" in line
    assert "configs/compare_gpu.toml" in printed and "train at least" in printed
    shards = load_shards(next((tmp_path / "data").iterdir()))  # the unigram loss, counted here independently
    counts, vocab = Counter(np.asarray(shards.train).tolist()), shards.vocab_size
    total = sum(counts.values()) + vocab
    unigram = -sum(math.log((counts[t] + 1) / total) for t in np.asarray(shards.val).tolist()) / len(shards.val)
    assert f"against {unigram:.3f} for a unigram model" in printed


def test_a_bad_setting_is_one_error_line(capsys):
    assert compare.main(["--seeds=0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_each_dataset_gets_its_own_folder_and_a_stopped_comparison_names_its_own_command(monkeypatch, tmp_path):
    called = {}

    def fake_ablate(argv: list[str], command: list[str]) -> int:
        called.update(argv=argv, command=command)
        return 130  # as a stopped study returns: compare passes it on and reads nothing

    monkeypatch.setattr(compare.ablate, "main", fake_ablate)
    monkeypatch.setattr(compare, "prepare_for", lambda base: tmp_path / f"{Path(base.dataset).name}-bpe8192-0123abcd")
    assert compare.main(["--dataset=my_docs.jsonl", "--seeds=2"]) == 130
    assert called["argv"][1:] == [
        "--dataset=my_docs.jsonl",
        "--seeds=2",
        "--out_dir=out/compare/my_docs.jsonl-bpe8192-0123abcd",
    ]
    assert called["command"] == ["python", "-m", "studies.compare", "--dataset=my_docs.jsonl", "--seeds=2"]
    assert compare.main(["--dataset=my_docs.jsonl", "--out_dir=mine"]) == 130 and called["argv"][-1] == "--out_dir=mine"
    assert compare.main(["--variants=no_doc_mask,naive"]) == 1  # no reference to compare with: one error line


def test_a_study_the_settings_make_impossible_is_refused_before_any_data_is_prepared(monkeypatch, capsys):
    prepared = []
    monkeypatch.setattr(compare, "prepare_for", lambda base: prepared.append(base) or Path("data/x"))
    assert compare.main(["--doc_mask=false"]) == 1 and compare.main(["--early_band=0,600"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: doc_mask=false: a study's reference trains with every fix on")
    assert err[1] == "error: early_band=[0, 600] reaches past seq_len=512: no position there is scored"
    assert not prepared  # the preparation names the study's folder: it came first, and could take hours


def test_a_figure_the_disk_has_no_room_for_is_one_line(monkeypatch, tmp_path, capsys):
    """The runs done, the comparison's own figure cannot be written: one line, as every writer's full disk."""
    from errors import SaveFailed

    out = tmp_path / "out"
    out.mkdir()
    run = {"val_doc_loss_sum_by_position": [5.0, 4.0], "val_doc_count_by_position": [1, 1]}
    (out / "results.json").write_text(json.dumps({"runs": {"learned": {"reference": {"0": run}}}}))
    monkeypatch.setattr(compare.ablate, "main", lambda argv, command: 0)
    monkeypatch.setattr(compare, "prepare_for", lambda base: tmp_path / "data")
    monkeypatch.setattr(compare, "unigram_loss", lambda shard_path: 6.0)
    monkeypatch.setattr(compare, "training_extent", lambda saved, out, unigram: {})

    def full_disk(figure, path):
        raise SaveFailed(f"could not write {path} (No space left on device)")

    monkeypatch.setattr(compare, "save_figure", full_disk)
    assert compare.main([f"--out_dir={out}"]) == 1
    assert capsys.readouterr().err == f"error: could not write {out / 'by_position.png'} (No space left on device)\n"
