"""No run lost, no bad input silently accepted: faults during training and what each bad input gets."""

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tiktoken
import torch
from conftest import ROOT, make_documents, rewrite_checkpoint, tiny_args

import corpora
import prepare
import shards
import train
from cli import parse_config
from config import Config
from errors import ConfigError, DataError, TrainingDiverged
from run.checkpoint import read_checkpoint
from run.folder import exclusive_lock

SMALL = Config(tokenizer_vocab_size=300)


def records(out_dir):
    """metrics.jsonl without the wall-clock rates, which differ between runs."""
    lines = (out_dir / "metrics.jsonl").read_text().split("\n")[:-1]  # a last line with no newline is being written
    return [{k: v for k, v in json.loads(line).items() if "per_sec" not in k} for line in lines]


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for_step(out_dir, step: int, proc: subprocess.Popen) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        done = [r["step"] for r in records(out_dir)] if (out_dir / "metrics.jsonl").exists() else []
        if done and done[-1] >= step and (out_dir / "ckpt.pt").exists():
            return
        time.sleep(0.005)
    raise AssertionError(f"run ended or stalled before step {step}")


@pytest.fixture(scope="module")
def long_args(tiny_corpus, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("data")
    reference = tmp_path_factory.mktemp("reference")

    def args(out_dir):  # 40 steps, a checkpoint every 3, dropout so that the RNG state matters
        return tiny_args(tiny_corpus, data_dir, out_dir, max_iters=40, eval_interval=3, dropout=0.1, eval_tokens=256)

    train.train(parse_config(args(reference)))
    return args, records(reference)


@pytest.mark.slow
def test_resume_after_kill_9_at_random_steps_is_exact(long_args, tmp_path):
    args, uninterrupted = long_args
    out = tmp_path / "killed"
    rng = random.Random(0)
    kill_steps = sorted(rng.sample(range(4, 36), 3))
    for i, step in enumerate(kill_steps):
        proc = start(args(out) + (["--resume=true"] if i else []))
        wait_for_step(out, step, proc)
        proc.kill()  # SIGKILL: no handler runs, the work since the last checkpoint is lost
        proc.wait()
    final = start(args(out) + ["--resume=true"])
    _, stderr = final.communicate(timeout=300)
    assert final.returncode == 0, stderr
    assert records(out) == uninterrupted


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_stop_signal_finishes_the_step_saves_and_exits_128_plus_it(long_args, tmp_path, signum):
    args, uninterrupted = long_args
    out = tmp_path / "stopped"
    proc = start(args(out))
    wait_for_step(out, 10, proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum  # unfinished: `train.py && export_hf.py` exports nothing
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith("interrupted:") and "--resume=true" in last_line
    stopped_at = int(last_line.split(" after step ")[1].split()[0])
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == stopped_at == records(out)[-1]["step"]
    resumed = start(args(out) + ["--resume=true"])
    resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and records(out) == uninterrupted


@pytest.mark.slow
def test_a_save_interrupted_midway_leaves_the_previous_checkpoint(long_args, tmp_path, monkeypatch):
    args, _ = long_args
    out = tmp_path / "run"
    train.train(parse_config(args(out) + ["--max_iters=3"]))
    real_save = torch.save

    def save_half_then_die(obj, path):
        real_save(obj, path)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        raise KeyboardInterrupt  # as if killed while writing

    monkeypatch.setattr(torch, "save", save_half_then_die)
    with pytest.raises(KeyboardInterrupt):
        train.train(parse_config(args(out) + ["--max_iters=6", "--resume=true"]))
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == 3


@pytest.mark.slow
def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(long_args, tmp_path, monkeypatch):
    args, _ = long_args
    out = tmp_path / "run"
    real_accumulate, steps = train.accumulate_gradients, []

    def nan_from_step_5(model, batches, autocast, config):
        steps.append(1)
        loss = real_accumulate(model, batches, autocast, config)
        return loss * float("nan") if len(steps) >= 5 else loss

    monkeypatch.setattr(train, "accumulate_gradients", nan_from_step_5)
    with pytest.raises(TrainingDiverged, match="non-finite by step 6"):
        train.train(parse_config(args(out) + ["--log_interval=10"]))  # caught at the step-6 checkpoint at the latest
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == 3
    assert all(r["step"] <= 3 for r in records(out))


# ---- bad input: one clear error


def test_empty_corpus(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no non-empty documents"):
        prepare.prepare(str(tmp_path / "empty"), str(tmp_path / "data"), log=lambda *_: None)
    assert [p.name for p in (tmp_path / "data").iterdir() if not p.name.endswith(".lock")] == []


def test_single_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(DataError, match=r"docs.txt is not UTF-8"):
        list(corpora.read_documents(corpora.resolve_dataset(str(path))))


@pytest.mark.slow
def test_dataset_too_small_for_a_batch(tiny_corpus, tmp_path):
    with pytest.raises(DataError, match=r"fewer than batch_size 4096"):
        train.train(parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "o", batch_size=4096)))


@pytest.mark.slow
def test_dataset_too_small_for_the_validation_set(tmp_path):
    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 30}) + "\n" for i in range(20)))
    with pytest.raises(DataError, match=r"the val split's .* tokens give 0 rows"):
        train.train(parse_config(tiny_args(corpus, tmp_path / "data", tmp_path / "o", seq_len=512, batch_size=1)))


def test_corrupted_meta_json(tiny_corpus, tmp_path):
    path = prepare.prepare(str(tiny_corpus), str(tmp_path / "data"), SMALL, log=lambda *_: None)
    (path / "meta.json").write_text("{ not json")
    with pytest.raises(DataError, match="meta.json is corrupted"):
        shards.load_shards(path)


def test_shard_with_token_ids_outside_the_vocabulary(tiny_corpus, tmp_path):
    path = prepare.prepare(str(tiny_corpus), str(tmp_path / "data"), SMALL, log=lambda *_: None)
    tokens = np.fromfile(path / "val_000000.bin", dtype=np.uint16)
    tokens[0] = 60000
    tokens.tofile(path / "val_000000.bin")
    with pytest.raises(DataError, match="val_000000.bin does not match its tokenizer"):
        shards.load_shards(path)


@pytest.mark.slow
def test_shards_with_another_tokenizer_than_the_checkpoint(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2)
    train.train(parse_config(args))
    rewrite_checkpoint(out / "ckpt.pt", lambda state: state.update(tokenizer_sha256="0" * 64))
    with pytest.raises(ConfigError, match="trained with another tokenizer"):
        train.train(parse_config(args + ["--max_iters=4", "--resume=true"]))


@pytest.mark.slow
def test_unreadable_checkpoint(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        train.train(parse_config(tiny_args(tiny_corpus, tmp_path / "data", out) + ["--resume=true"]))


@pytest.mark.slow
def test_out_dir_not_writable(tiny_corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="out_dir .* is not a writable folder"):
        train.train(parse_config(tiny_args(tiny_corpus, tmp_path / "data", blocker / "out")))


@pytest.mark.slow
def test_flex_on_cpu_is_refused(tiny_corpus, tmp_path):
    with pytest.raises(ConfigError, match="FlexAttention has no backward on CPU"):
        train.train(
            parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "o", attn_impl="flex", device="cpu"))
        )


@pytest.mark.slow
def test_flags_with_pad_packing_warn(tiny_corpus, tmp_path, capsys):
    train.train(
        parse_config(
            tiny_args(
                tiny_corpus,
                tmp_path / "data",
                tmp_path / "o",
                packing="pad",
                doc_mask="false",
                max_iters=1,
                eval_interval=1,
            )
        )
    )
    assert "with packing=pad each row holds one document, so the three flags change nothing" in capsys.readouterr().err


def test_tokenizer_that_needs_the_network_offline(tmp_path, monkeypatch):
    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(DataError, match="Offline, use tokenizer='bpe' or a local .tiktoken file"):
        prepare.load_named_tokenizer("gpt2")


# ---- round 2: no run overwritten, no output mixed, no traceback


def run_cli(*args: str, cwd=ROOT, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300, **kw)


def in_process(main, argv: list[str], capsys) -> subprocess.CompletedProcess:
    """A script's main called here, as run_cli would run it (the same exit code and stderr), without the
    seconds of starting Python and importing torch."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return subprocess.CompletedProcess(argv, code, "", capsys.readouterr().err)


def one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error:") and sum(line.startswith("error:") for line in lines) == 1, result.stderr
    assert all(f in lines[-1] for f in fragments), (fragments, lines[-1])


@pytest.mark.slow
def test_a_fresh_run_never_replaces_a_finished_one(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2)
    train.train(parse_config(args))
    before = {name: (out / name).read_bytes() for name in ("ckpt.pt", "config.json", "metrics.jsonl")}
    with pytest.raises(ConfigError, match=r"holds a run .*--resume=true.*another out_dir.*--overwrite=true"):
        train.train(parse_config(args + ["--n_embd=64"]))
    assert {name: (out / name).read_bytes() for name in before} == before
    train.train(parse_config(args + ["--n_embd=64", "--overwrite=true"]))
    assert torch.load(out / "ckpt.pt", weights_only=False)["config"]["n_embd"] == 64


@pytest.mark.slow
def test_a_second_run_into_the_same_folder_is_refused_while_the_first_runs(long_args, tmp_path):
    args, _ = long_args
    out = tmp_path / "run"
    first = start(args(out) + ["--max_iters=100000"])  # runs until killed
    wait_for_step(out, 3, first)
    second = run_cli("train.py", *args(out), "--overwrite=true")
    one_error_line(second, "is in use by another run", f"process {first.pid}")
    assert first.poll() is None
    first.kill()  # the OS drops the lock with the process: resuming works at once
    first.wait()
    step = torch.load(out / "ckpt.pt", weights_only=False)["step"]
    resumed = run_cli("train.py", *args(out), f"--max_iters={step + 2}", "--resume=true")
    assert resumed.returncode == 0, resumed.stderr
    assert records(out)[-1]["step"] == step + 2


@pytest.mark.slow
def test_a_preparation_in_progress_is_waited_for(tiny_corpus, tmp_path):
    data_dir = tmp_path / "data"
    source = corpora.resolve_dataset(str(tiny_corpus))
    name = prepare.shard_dir_for(str(data_dir), source, SMALL, corpora.fingerprint(source)).name
    data_dir.mkdir()
    with exclusive_lock(data_dir / f".{name}.lock"):
        waiting = subprocess.Popen(
            [sys.executable, "prepare.py", str(tiny_corpus), f"--data_dir={data_dir}", "--tokenizer_vocab_size=300"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        first_line = waiting.stdout.readline()
        assert first_line.startswith(f"data: waiting for process {os.getpid()}, which is preparing")
        assert waiting.poll() is None
    stdout, stderr = waiting.communicate(timeout=300)
    assert waiting.returncode == 0 and f"ready: {data_dir / name}" in stdout, stderr


@pytest.mark.slow
def test_sampling_works_from_anywhere_and_from_a_copied_run_folder(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    train.train(parse_config(tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run_cli(str(ROOT / "sample.py"), f"--out_dir={out}", "--max_new_tokens=5", cwd=elsewhere)
    assert result.returncode == 0 and "--- sample 1" in result.stdout, result.stderr
    copied = tmp_path / "copied"
    copied.mkdir()
    (copied / "ckpt.pt").write_bytes((out / "ckpt.pt").read_bytes())
    import shutil

    shutil.rmtree(tmp_path / "data")  # the shards and their tokenizer are gone: the checkpoint holds its own
    result = run_cli("sample.py", f"--out_dir={copied}", "--max_new_tokens=5")
    assert result.returncode == 0 and "--- sample 1" in result.stdout, result.stderr


@pytest.mark.slow
def test_a_checkpoint_that_cannot_be_written_is_one_line_and_leaves_the_old_one(tiny_corpus, tmp_path):
    import resource

    out = tmp_path / "run"
    args = tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2)
    train.train(parse_config(args))  # data prepared and a first checkpoint written, without a limit
    old = (out / "ckpt.pt").read_bytes()
    limit = len(old) // 2

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = run_cli("train.py", *args, "--max_iters=4", "--resume=true", preexec_fn=small_files)
    one_error_line(result, "could not save the checkpoint", "the previous checkpoint is kept")
    assert (out / "ckpt.pt").read_bytes() == old and not (out / "ckpt.pt.tmp").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        (b"YQ== 0\nYQ== 1\n", "appears twice"),
        (b"YQ== -1\n", "ranks must be 0..0"),
        (b"YQ== 0\nYg== 5\n", "ranks must be 0..1"),
        (b"YQ== 0\n", "single bytes are not tokens"),
        (b"not base64 at all\n", "not a .tiktoken file"),
    ],
    ids=["duplicate", "negative", "gap", "missing-bytes", "garbage"],
)
def test_bad_tiktoken_files_are_named(tmp_path, content, message):
    path = tmp_path / "bad.tiktoken"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        prepare.load_named_tokenizer(str(path))  # a user's file
    with pytest.raises(DataError, match=message):  # the bytes a checkpoint keeps: the same reader, checked
        shards.read_tiktoken(content, prepare.SPLIT_PATTERN, "bad", "the checkpoint's tokenizer")


def test_non_finite_and_out_of_range_settings_are_refused_before_anything_else(tmp_path):
    for bad, message in [
        ("--lr=nan", "lr=nan: must be a finite number"),
        ("--lr=inf", "lr=inf: must be a finite number"),
        ("--dropout=nan", "dropout=nan: must be a finite number"),
        ("--seed=-1", "seed=-1: must be at least 0"),
        ("--data_seed=99999999999999999999", "data_seed=99999999999999999999: must be at most"),
        ("--tokenizer_vocab_size=70000", "tokenizer_vocab_size=70000: must be at most 65536"),
        ("--out_dir=", "out_dir is empty"),
        ("--data_dir=", "data_dir is empty"),
        ("--device=meta", "device='meta'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config([bad, "--resume=true", f"--out_dir={tmp_path / 'none'}"] if "out_dir" not in bad else [bad])


@pytest.mark.slow
def test_a_model_too_large_for_the_machine_is_refused(tiny_corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"needs about .* GB .* this machine has"):
        train.train(parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "o", n_embd=200_000)))


def test_config_files_that_are_folders_or_not_utf8(tmp_path):
    with pytest.raises(ConfigError, match="is a folder, not a config file"):
        parse_config([str(tmp_path)])
    (tmp_path / "latin1.toml").write_bytes(b'dataset = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        parse_config([str(tmp_path / "latin1.toml")])


@pytest.mark.slow
def test_foreign_and_truncated_checkpoints(tiny_corpus, tmp_path, capsys):
    import sample

    out = tmp_path / "run"
    out.mkdir()
    torch.save({"weights": torch.zeros(3)}, out / "ckpt.pt")
    args = tiny_args(tiny_corpus, tmp_path / "data", out)
    with pytest.raises(ConfigError, match="not a checkpoint written by train.py"):
        train.train(parse_config(args + ["--resume=true"]))
    one_error_line(run_cli("sample.py", f"--out_dir={out}"), "not a checkpoint written by train.py")
    real = tmp_path / "real"
    train.train(parse_config(tiny_args(tiny_corpus, tmp_path / "data", real, max_iters=1, eval_interval=1)))
    (out / "ckpt.pt").write_bytes((real / "ckpt.pt").read_bytes()[:5000])
    one_error_line(in_process(sample.main, [f"--out_dir={out}"], capsys), "not a readable checkpoint")
    one_error_line(in_process(sample.main, [f"--out_dir={real}", "--device=cuda:0"], capsys), "CUDA is not available")
    one_error_line(in_process(sample.main, [f"--out_dir={real}", "--num_samples=x"], capsys), "--num_samples")


@pytest.mark.slow
def test_resuming_to_fewer_steps_than_the_checkpoint_is_refused(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=4, eval_interval=2)
    train.train(parse_config(args))
    with pytest.raises(ConfigError, match=r"ckpt.pt is at step 4, past max_iters=2"):
        train.train(parse_config(args + ["--max_iters=2", "--resume=true"]))


@pytest.mark.slow
def test_data_dir_that_is_a_file_is_refused_before_reading_the_corpus(tiny_corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="data_dir .* is not a writable folder"):
        train.train(parse_config(tiny_args(tiny_corpus, blocker, tmp_path / "o")))


@pytest.mark.slow
def test_a_dataset_folder_that_holds_the_runs_outputs_skips_them(tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    project.mkdir()
    for i, doc in enumerate(make_documents(400)):
        (project / f"{i}.py").write_text(doc)
    monkeypatch.chdir(project)
    train.train(parse_config(tiny_args(".", "data", "out", max_iters=1, eval_interval=1)))
    # out/ now holds ckpt.pt, config.json and metrics.jsonl: were they corpus, the data would change and
    # the resumed run would stop on a tokenizer mismatch
    train.train(parse_config(tiny_args(".", "data", "out", max_iters=2, eval_interval=1) + ["--resume=true"]))
    assert "changed since" not in capsys.readouterr().out
    (meta,) = (project / "data").glob("*/meta.json")
    assert sum(s["documents"] for s in json.loads(meta.read_text())["splits"].values()) == 400
    with pytest.raises(ConfigError, match="dataset is empty"):
        parse_config(["--dataset="])


@pytest.mark.parametrize(
    "table, message",
    [
        ("seeds = [1]", "seeds=[1]: expected int"),
        ("probe_offsets = 8", "probe_offsets=8: expected a list of int"),
        ('probe_offsets = ["a"]', "probe_offsets='a': expected int"),
        ("out_dir = []", "out_dir=[]: expected str"),
        ('out_dir = ""', "out_dir is empty"),
        ("probe_docs = 0", "probe_docs=0: must be at least 1"),
    ],
)
def test_ablate_settings_of_the_wrong_type(tmp_path, table, message, capsys):
    from studies import ablate

    config = tmp_path / "c.toml"
    config.write_text(f"[ablate]\n{table}\n")
    one_error_line(in_process(ablate.main, [str(config)], capsys), message)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda saved: saved["runs"]["learned"]["reference"]["20"].pop("val_doc_loss"), "not a study's results.json"),
        (lambda saved: saved["runs"]["learned"]["reference"].pop("21"), "no_doc_mask has seeds [21] that its baseline"),
        (lambda saved: saved.update(runs=[]), "AttributeError"),
    ],
)
def test_a_damaged_results_json_is_one_line_and_no_report(tmp_path, damage, message, capsys):
    """A results.json that is JSON but not in the shape studies.ablate writes (a run's field or a seed gone,
    runs of another type) is named in one line, and no results.md or figure is written."""
    from studies import report

    saved = json.loads((ROOT / "results/import_leak_cpu_bos/results.json").read_text())
    damage(saved)
    (tmp_path / "results.json").write_text(json.dumps(saved))
    one_error_line(in_process(report.main, [str(tmp_path / "results.json")], capsys), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


@pytest.mark.slow
def test_a_bad_study_setting_is_one_line_from_the_command_line(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[ablate]\nprobe_docs = 0\n")
    one_error_line(run_cli("-m", "studies.ablate", str(config)), "probe_docs=0: must be at least 1")


def test_bench_checks_its_arguments_before_it_runs(tmp_path, capsys):
    from bench import attention as bench

    one_error_line(in_process(bench.main, ["--seq_lens=0"], capsys), "--seq_lens")
    one_error_line(in_process(bench.main, ["--doc_len=0"], capsys), "--doc_len")
    one_error_line(in_process(bench.main, [f"--out={tmp_path}"], capsys), "is a folder")


def test_a_run_that_ends_before_its_warmup_does_says_so(tiny_corpus, tmp_path, capsys):
    args = dict(max_iters=2, eval_interval=2)
    train.train(parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "o", warmup_iters=2, **args)))
    assert capsys.readouterr().err.count("warning: max_iters=2 is not past warmup_iters=2") == 1  # once a run
    train.train(parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "p", warmup_iters=1, **args)))
    assert "warmup_iters" not in capsys.readouterr().err


# ---- hints to paste: a command in a message is quoted where the shell would change it


def test_prepare_quotes_a_glob_in_its_train_hint(tiny_corpus, tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_bytes(tiny_corpus.read_bytes())
    glob = str(tmp_path / "corpus" / "*.jsonl")
    assert prepare.main([glob, f"--data_dir={tmp_path / 'data'}", "--tokenizer_vocab_size=300"]) == 0
    (hint,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train on it with ")]
    pasted = hint.removeprefix("train on it with ").split(" (or ")[0]
    assert f"'--dataset={glob}'" in pasted  # quoted: the shell leaves the glob to the script
    assert shlex.split(pasted) == [f"--dataset={glob}", f"--data_dir={tmp_path / 'data'}", "--tokenizer_vocab_size=300"]


def test_a_missing_checkpoint_hint_pastes(tmp_path):
    with pytest.raises(ConfigError) as error:
        read_checkpoint(tmp_path / "my run" / "ckpt.pt")
    assert shlex.split(str(error.value).split("train first with: ")[1])[-1] == f"--out_dir={tmp_path / 'my run'}"
