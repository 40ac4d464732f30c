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


def effect(verdict: str, estimate: float = 0.001, role: str = "primary") -> dict:
    return {"estimate": estimate, "ci95": [estimate - 0.01, estimate + 0.01], "verdict": verdict, "role": role}


def test_negligible_is_said_only_of_well_trained_models_and_a_smoke_test_decides_nothing():
    trained, barely, smoke = {"well_trained": True}, {"well_trained": False}, {"well_trained": False, "smoke": True}
    assert compare.verdict_words(effect("negligible"), trained) == "decided: negligible"
    assert compare.verdict_words(effect("negligible"), barely) == "not decided"
    # a difference decided on barely trained models is still decided: the test does not depend on training
    assert compare.verdict_words(effect("hurts", 0.3), barely) == "decided: careful helps"
    assert compare.verdict_words(effect("helps", -0.3), trained) == "decided: careful hurts"
    assert compare.verdict_words(effect("unresolved"), trained) == "not decided"
    assert compare.verdict_words(effect("hurts", 0.3), smoke) == "not decided (smoke test)"
    assert compare.verdict_words(effect("hurts", 0.3, role="secondary"), trained) == "not tested (secondary)"


def test_the_power_line_is_the_effect_a_simulated_paired_t_test_finds_four_times_in_five():
    """The smallest effect the default comparison decides with power 0.8, checked by simulating its test:
    6 seeds, Holm's strictest level over 3 tests, the critical value itself drawn from simulated nulls."""
    study, base = plan.parse_args([str(ROOT / "configs" / "compare.toml")])
    smallest = compare.smallest_effects(study, "rope", study.seeds)
    rng = np.random.default_rng(0)

    def t_statistics(mean: float, sd: float, draws: int = 400_000) -> np.ndarray:
        x = rng.normal(mean, sd, size=(draws, study.seeds))
        return x.mean(axis=1) / (x.std(axis=1, ddof=1) / math.sqrt(study.seeds))

    level = 0.05 / 3
    critical = np.quantile(np.abs(t_statistics(0.0, 1.0)), 1 - level)
    for kind in ("early", "whole"):
        sd = compare.STUDY_SPREADS[("rope", kind)]
        power = np.mean(np.abs(t_statistics(smallest[kind], sd)) > critical)
        assert abs(power - compare.POWER) < 0.01, (kind, power)


def test_position_bins_double_and_cover_every_position_once():
    assert compare.position_bins(20) == [0, 1, 2, 4, 8, 16, 20]
    result = {"val_doc_loss_sum_by_position": [2.0, 3.0, 4.0, 8.0, 1.0], "val_doc_count_by_position": [1, 1, 2, 2, 0]}
    binned = compare.binned_loss(result, compare.position_bins(5))
    assert binned[:3] == [2.0, 3.0, 3.0] and math.isnan(binned[3])  # positions 2-3 weighted by tokens; 4: none


def test_the_plan_says_a_smoke_test_first_and_names_repetition(monkeypatch):
    from types import SimpleNamespace

    small = SimpleNamespace(vocab_size=4096, train=np.zeros(1_000_000, dtype=np.uint16))  # 1M training tokens
    study, base = plan.parse_args([str(ROOT / "configs" / "compare.toml")])
    lines = compare.plan_lines(study, base, small)
    assert lines[0].startswith("plan: 12 runs of 3,000 steps (6.14M tokens, 13.2 tokens") and "rope 0.46M" in lines[0]
    assert lines[1].startswith("note: a run reads the training split 6.1 times (1.00M tokens)")
    smallest = compare.smallest_effects(study, "rope", 6)
    assert f"at least {smallest['early']:.3f} nats on positions 0-15 and {smallest['whole']:.3f}" in lines[2]
    study, base = plan.parse_args([str(ROOT / "configs" / "compare_smoke.toml")])
    lines = compare.plan_lines(study, base, SimpleNamespace(vocab_size=4096, train=np.zeros(50_000_000)))
    assert lines[0].startswith("smoke test: 0.26 tokens a parameter decide nothing") and not lines[2].startswith("note")


def test_the_shipped_configs_are_the_practitioners_two_arms_with_rope():
    for name in ("compare.toml", "compare_smoke.toml", "compare_gpu.toml"):
        study, base = plan.parse_args([str(ROOT / "configs" / name)])
        assert study.variants == ["reference", "naive"] and study.pos_embs == ["rope"]
        assert study.primary == {"naive": ["early", "from_second", "in_context"]}
        assert base.bos and base.doc_mask and base.reset_position_ids and base.mask_boundary_loss
        assert base.warmup_iters * 4 <= base.max_iters
    default, _ = plan.parse_args([str(ROOT / "configs" / "compare.toml")])
    smoke, _ = plan.parse_args([str(ROOT / "configs" / "compare_smoke.toml")])
    assert default.seeds == 6 and default.threads == 1 and smoke.out_dir != default.out_dir
    assert "UNTESTED" in (ROOT / "configs" / "compare_gpu.toml").read_text()


def test_the_quick_comparison_trains_with_the_confirmatory_studys_recipe():
    _, quick = plan.parse_args([str(ROOT / "configs" / "compare.toml")])
    _, registered = plan.parse_args([str(ROOT / "configs" / "confirm_rung3.toml")])
    assert (quick.lr, quick.min_lr) == (registered.lr, registered.min_lr)
    assert quick.warmup_iters == round(quick.max_iters * registered.warmup_iters / registered.max_iters)


TINY = dict(
    tokenizer_vocab_size=320, seq_len=64, n_layer=1, n_head=2, n_embd=32, batch_size=4, max_iters=3, warmup_iters=1,
    eval_interval=3, eval_tokens=0, val_fraction=0.3, log_interval=1, seeds=2, probe_docs=4, probe_offsets=16,
    compile="false",
)  # fmt: skip


@pytest.mark.slow
def test_the_command_compares_on_a_tiny_setting_in_two_processes(tiny_corpus, tmp_path):
    out = tmp_path / "compare"
    settings = dict(dataset=tiny_corpus, data_dir=tmp_path / "data", out_dir=out, workers=2, **TINY)
    command = [sys.executable, "-m", "studies.compare", *(f"--{k}={v}" for k, v in settings.items())]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    first = next(line for line in result.stdout.splitlines() if not line.startswith("data: "))  # after preparing
    assert first.startswith("smoke test: ")  # 0.02 tokens a parameter: it says first that it decides nothing
    saved = json.loads((out / "results.json").read_text())
    assert sorted(saved["summary"]) == ["rope/naive", "rope/reference"]
    trained_here, trained_there = result.stdout.count("\nmodel: "), (out / "worker2.log").read_text().count("\nmodel: ")
    assert trained_here + trained_there == 4  # the second process shares the runs (how many: a race): each trains once
    assert (out / "worker2.log").read_text().count("=== run ") == 4  # it saw every run, trained or done
    assert (out / "by_position.png").stat().st_size > 10_000
    assert "# " not in result.stdout  # results.md is named, not printed
    planned = result.stdout.split("tokens, ")[1].split(" tokens a parameter")[0]  # the plan's, before training
    assert f"{planned} tokens a parameter" in result.stdout[result.stdout.index("trained: ") :]  # the models' own
    printed = result.stdout[result.stdout.index("trained: ") :]
    tokens = 3 * 4 * 64
    assert f"trained: {tokens / 1e6:.2f}M tokens a run" in printed and "barely trained" in printed
    rows = [line for line in printed.splitlines() if line.startswith("rope ")]
    assert len(rows) == 3 and all(line.endswith("not decided (smoke test)") for line in rows)
    cells = saved["summary"]["rope/naive"]["endpoints"], saved["summary"]["rope/reference"]["endpoints"]
    for line, endpoint, bpb in zip(rows, ["early", "from_second", "in_context"], [None, "bpb", "bpb_in_context"]):
        for name in filter(None, [endpoint, bpb]):  # each effect as the runs have it: naive minus reference, by seed
            assert f"{np.mean(np.subtract(cells[0][name]['values'], cells[1][name]['values'])):+.3f} [" in line
        assert line.count("[") == (2 if bpb else 1)
    shards = load_shards(next((tmp_path / "data").iterdir()))  # the unigram loss, counted here independently
    counts, vocab = Counter(np.asarray(shards.train).tolist()), shards.vocab_size
    total = sum(counts.values()) + vocab
    unigram = -sum(math.log((counts[t] + 1) / total) for t in np.asarray(shards.val).tolist()) / len(shards.val)
    assert f"against {unigram:.3f} for a unigram model" in printed


def test_data_too_small_to_decide_anything_is_refused_before_any_run(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "compare"
    settings = {**TINY, "val_fraction": 0.02, "eval_tokens": 1024}  # about 12 validation documents
    argv = [
        f"--{k}={v}" for k, v in dict(dataset=tiny_corpus, data_dir=tmp_path / "data", out_dir=out, **settings).items()
    ]
    assert compare.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the evaluation scores ") and "eval_tokens" in err and err.count("\n") == 1
    assert not out.exists()


def test_a_failed_or_stopped_comparison_stops_its_background_workers(monkeypatch, tmp_path):
    signals = []

    class Worker:  # a background process still training when this one ends
        returncode = None

        def __init__(self, argv, stdout, stderr):
            self.argv = argv

        def poll(self):
            return self.returncode

        def send_signal(self, signum):
            signals.append(signum)
            self.returncode = 130  # it saves its checkpoint and exits as a stopped study does

        def wait(self):
            return self.returncode

    monkeypatch.setattr(compare.subprocess, "Popen", Worker)
    monkeypatch.setattr(compare.ablate, "main", lambda argv, command, echo_report: 130)
    assert compare.train_runs("c.toml", ["--seeds=2"], ["python"], 3, tmp_path) == 130
    assert signals == [compare.signal.SIGINT] * 2 and (tmp_path / "worker3.log").is_file()
    monkeypatch.setattr(compare.ablate, "main", lambda argv, command, echo_report: 0)
    Worker.returncode = 0  # finished with this process: nothing to stop
    assert compare.train_runs("c.toml", [], ["python"], 2, tmp_path) == 0 and len(signals) == 2


@pytest.mark.parametrize("workers", ["0", "two", "99999999999999999999"])
def test_a_bad_worker_count_is_one_error_line(tiny_corpus, tmp_path, workers, capsys):
    argv = [
        f"--dataset={tiny_corpus}",
        f"--data_dir={tmp_path / 'data'}",
        f"--out_dir={tmp_path / 'c'}",
        f"--workers={workers}",
    ]
    assert compare.main([*argv, *(f"--{k}={v}" for k, v in TINY.items())]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "workers" in err and err.count("\n") == 1
    assert not list(tmp_path.glob("c/worker*.log"))  # refused before any process starts


def test_a_bad_setting_is_one_error_line(capsys):
    assert compare.main(["--seeds=0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


@pytest.fixture
def no_data(monkeypatch, tmp_path):
    """compare.main with the data, its checks and the plan faked, one process, in tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compare, "prepare_for", lambda base: tmp_path / f"{Path(base.dataset).name}-bpe8192-0123abcd")
    monkeypatch.setattr(compare, "load_shards", lambda path: None)
    monkeypatch.setattr(compare, "check_supports", lambda base, shards: None)
    monkeypatch.setattr(compare, "plan_lines", lambda study, base, shards: [])
    monkeypatch.setattr(compare, "default_workers", lambda base, study: 1)


def test_each_dataset_gets_its_own_folder_and_a_stopped_comparison_names_its_own_command(monkeypatch, no_data):
    called = {}

    def fake_ablate(argv: list[str], command: list[str], echo_report: bool) -> int:
        called.update(argv=argv, command=command)
        return 130  # as a stopped study returns: compare passes it on and reads nothing

    monkeypatch.setattr(compare.ablate, "main", fake_ablate)
    assert compare.main(["--dataset=my_docs.jsonl", "--seeds=2"]) == 130
    assert called["argv"][1:] == [
        "--dataset=my_docs.jsonl",
        "--seeds=2",
        "--out_dir=out/compare/my_docs.jsonl-bpe8192-0123abcd",
    ]
    assert called["command"] == ["python", "-m", "studies.compare", "--dataset=my_docs.jsonl", "--seeds=2"]
    assert compare.main(["--dataset=my_docs.jsonl", "--out_dir=mine"]) == 130 and called["argv"][-1] == "--out_dir=mine"
    assert compare.main(["--variants=no_doc_mask,naive"]) == 1  # no reference to compare with: one error line


def test_an_out_dir_that_cannot_be_a_folder_is_one_line_naming_it_before_any_run(
    monkeypatch, tmp_path, no_data, capsys
):
    monkeypatch.setattr(compare.ablate, "main", lambda *a, **k: pytest.fail("a run started"))
    (tmp_path / "a_file").write_text("")
    assert compare.main(["--dataset=my_docs.jsonl", "--out_dir=a_file/cmp"]) == 1
    err = capsys.readouterr().err  # once: "cannot write the output (File exists)", after the plan, naming nothing
    assert err == "error: out_dir a_file/cmp is not a writable folder (Not a directory)\n"


def test_a_study_the_settings_make_impossible_is_refused_before_any_data_is_prepared(monkeypatch, capsys):
    prepared = []
    monkeypatch.setattr(compare, "prepare_for", lambda base: prepared.append(base) or Path("data/x"))
    assert compare.main(["--doc_mask=false"]) == 1 and compare.main(["--early_band=0,1100"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: doc_mask=false: a study's reference trains with every fix on")
    assert err[1] == "error: early_band=[0, 1100] reaches past seq_len=1024: no position there is scored"
    assert not prepared  # the preparation names the study's folder: it came first, and could take hours


def test_a_figure_the_disk_has_no_room_for_is_one_line(monkeypatch, tmp_path, no_data, capsys):
    """The runs done, the comparison's own figure cannot be written: one line, as every writer's full disk."""
    from errors import SaveFailed

    out = tmp_path / "out"
    out.mkdir()
    run = {"val_doc_loss_sum_by_position": [5.0, 4.0], "val_doc_count_by_position": [1, 1]}
    (out / "results.json").write_text(json.dumps({"runs": {"learned": {"reference": {"0": run}}}}))
    monkeypatch.setattr(compare.ablate, "main", lambda argv, command, echo_report: 0)
    monkeypatch.setattr(compare, "unigram_loss", lambda shard_path: 6.0)
    monkeypatch.setattr(compare, "training_extent", lambda saved, out, unigram: {})

    def full_disk(figure, path):
        raise SaveFailed(f"could not write {path} (No space left on device)")

    monkeypatch.setattr(compare, "save_figure", full_disk)
    assert compare.main([f"--out_dir={out}"]) == 1
    assert capsys.readouterr().err == f"error: could not write {out / 'by_position.png'} (No space left on device)\n"
