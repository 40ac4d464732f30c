"""No run lost, no bad input silently accepted: faults during training and what each bad input gets."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tiktoken
import torch
from conftest import ROOT, tiny_args

import data
import train
from data import DataError
from train import ConfigError, TrainingDiverged, parse_config


def records(out_dir):
    """metrics.jsonl without the wall-clock rates, which differ between runs."""
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
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
        return tiny_args(tiny_corpus, data_dir, out_dir, max_iters=40, eval_interval=3, dropout=0.1, eval_rows=2)

    train.train(parse_config(args(reference)))
    return args, records(reference)


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


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_stop_signal_finishes_the_step_saves_and_exits_0(long_args, tmp_path, signum):
    args, uninterrupted = long_args
    out = tmp_path / "stopped"
    proc = start(args(out))
    wait_for_step(out, 10, proc)
    proc.send_signal(signum)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    last_line = stdout.strip().splitlines()[-1]
    assert last_line.startswith("stopped after step") and "--resume=true" in last_line
    stopped_at = int(last_line.split()[3].rstrip(";"))
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == stopped_at == records(out)[-1]["step"]
    resumed = start(args(out) + ["--resume=true"])
    resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and records(out) == uninterrupted


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


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(long_args, tmp_path, monkeypatch):
    args, _ = long_args
    out = tmp_path / "run"
    real_accumulate, steps = train.accumulate_gradients, []

    def nan_from_step_5(model, batches, autocast):
        steps.append(1)
        loss = real_accumulate(model, batches, autocast)
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
        data.prepare(str(tmp_path / "empty"), str(tmp_path / "data"), log=lambda *_: None)
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())


def test_single_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(DataError, match=r"docs.txt is not UTF-8"):
        data.load_documents(str(path))


def test_dataset_too_small_for_a_batch(tiny_corpus, tmp_path):
    with pytest.raises(DataError, match=r"fewer than batch_size 4096"):
        train.train(parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "o", batch_size=4096)))


def test_dataset_too_small_for_the_validation_set(tmp_path):
    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 30}) + "\n" for i in range(20)))
    with pytest.raises(DataError, match=r"the val split's .* tokens give 0 rows"):
        train.train(parse_config(tiny_args(corpus, tmp_path / "data", tmp_path / "o", seq_len=512, batch_size=1)))


def test_corrupted_meta_json(tiny_corpus, tmp_path):
    path = data.prepare(str(tiny_corpus), str(tmp_path / "data"), vocab_size=300, log=lambda *_: None)
    (path / "meta.json").write_text("{ not json")
    with pytest.raises(DataError, match="meta.json is corrupted"):
        data.load_shards(path)


def test_shard_with_token_ids_outside_the_vocabulary(tiny_corpus, tmp_path):
    path = data.prepare(str(tiny_corpus), str(tmp_path / "data"), vocab_size=300, log=lambda *_: None)
    tokens = np.fromfile(path / "val.bin", dtype=np.uint16)
    tokens[0] = 60000
    tokens.tofile(path / "val.bin")
    with pytest.raises(DataError, match="val.bin does not match its tokenizer"):
        data.load_shards(path)


def test_shards_with_another_tokenizer_than_the_checkpoint(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2)
    train.train(parse_config(args))
    state = torch.load(out / "ckpt.pt", weights_only=False)
    state["tokenizer_sha256"] = "0" * 64
    torch.save(state, out / "ckpt.pt")
    with pytest.raises(ConfigError, match="trained with another tokenizer"):
        train.train(parse_config(args + ["--max_iters=4", "--resume=true"]))


def test_unreadable_checkpoint(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        train.train(parse_config(tiny_args(tiny_corpus, tmp_path / "data", out) + ["--resume=true"]))


def test_out_dir_not_writable(tiny_corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="is not writable"):
        train.train(parse_config(tiny_args(tiny_corpus, tmp_path / "data", blocker / "out")))


def test_flex_on_cpu_is_refused(tiny_corpus, tmp_path):
    with pytest.raises(ConfigError, match="FlexAttention has no backward on CPU"):
        train.train(
            parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "o", attn_impl="flex", device="cpu"))
        )


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
        data.make_tokenizer("gpt2", 0, [])
