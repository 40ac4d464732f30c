"""Checkpoints (run/checkpoint.py): saved whole or not at all, the previous one kept when a save fails or a
run diverges; verified by CRC-32 on every read, so a checkpoint damaged anywhere (a byte in its weights
or any record, a cut, a record of another checkpoint, a foreign or unreadable file) is refused by every
reader, training, sampling and export alike; and a checkpoint that holds what it needs (its tokenizer,
its step and evaluation) to be sampled or exported from anywhere."""

import dataclasses
import errno
import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    ROOT,
    copy_of,
    hand_built_checkpoint,
    in_process,
    one_error_line,
    one_line,
    python,
    records,
    run_cli,
    tiny_args,
)

import export_hf
import sample
import train
from cli import parse_config
from config import Config
from errors import ConfigError, SaveFailed, TrainingDiverged
from resolve import resolve
from run.checkpoint import read_checkpoint, save_checkpoint

# ---- damaged checkpoints, refused by every reader


def flip_byte_in_weights(path: Path, where: float) -> None:
    """Change one byte at `where` (0-1) into the largest tensor's data in the checkpoint's zip archive."""
    archive = zipfile.ZipFile(path)
    member = max(archive.infolist(), key=lambda info: info.file_size)
    raw = bytearray(path.read_bytes())
    header = member.header_offset
    name_length = int.from_bytes(raw[header + 26 : header + 28], "little")
    extra_length = int.from_bytes(raw[header + 28 : header + 30], "little")
    raw[header + 30 + name_length + extra_length + int(where * (member.file_size - 1))] ^= 0x40
    path.write_bytes(raw)


@pytest.mark.slow
def test_a_checkpoint_damaged_inside_its_weights_is_refused_by_every_reader(trained, tmp_path):
    run = copy_of(trained[0], tmp_path)
    ckpt = run / "ckpt.pt"
    flip_byte_in_weights(ckpt, 0.5)
    torch.load(ckpt, weights_only=False)  # torch itself reads the damaged file without a word
    for reader in (
        lambda: read_checkpoint(ckpt),
        lambda: sample.load_run(run, torch.device("cpu")),  # sampling and the studies' probes
        lambda: export_hf.export(run, tmp_path / "hf"),
        lambda: train.train(resolve(parse_config([f"--out_dir={run}", "--resume=true", "--max_iters=6"]))),
    ):
        with pytest.raises(ConfigError, match=f"{ckpt} is damaged: its record .* does not match the CRC-32"):
            reader()
    assert one_line(python("sample.py", f"--out_dir={run}")).startswith(f"error: {ckpt} is damaged")
    assert not (tmp_path / "hf").exists()  # nothing was written from it
    # at any place of the weights
    for where in np.linspace(0, 1, 7):
        shutil.copy(trained[0] / "ckpt.pt", ckpt)
        flip_byte_in_weights(ckpt, float(where))
        with pytest.raises(ConfigError, match="damaged"):
            read_checkpoint(ckpt)


def test_a_byte_changed_in_the_weights_of_a_hand_built_checkpoint_is_refused_on_read(tmp_path):
    """The fast tier's guard of the CRC-32 check: on every read, over the tensors' bytes."""
    ckpt = tmp_path / "ckpt.pt"
    state = hand_built_checkpoint(Config())
    save_checkpoint(ckpt, state)
    assert torch.equal(read_checkpoint(ckpt)["model"]["weight"], state["model"]["weight"])
    written = ckpt.read_bytes()
    for where in (0.0, 0.5, 1.0):
        ckpt.write_bytes(written)
        flip_byte_in_weights(ckpt, where)
        damaged = torch.load(ckpt, weights_only=False)  # torch reads it without a word
        assert not torch.equal(damaged["model"]["weight"], state["model"]["weight"])
        with pytest.raises(ConfigError, match=f"{ckpt} is damaged: its record .* does not match the CRC-32"):
            read_checkpoint(ckpt)


def record_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Each record of a checkpoint's zip archive: where its stored bytes begin and end in the file."""
    raw = path.read_bytes()
    spans = {}
    for info in zipfile.ZipFile(path).infolist():
        header = info.header_offset
        name_length = int.from_bytes(raw[header + 26 : header + 28], "little")
        extra_length = int.from_bytes(raw[header + 28 : header + 30], "little")
        start = header + 30 + name_length + extra_length
        spans[info.filename] = (start, start + info.compress_size)
    return spans


def test_a_changed_byte_in_any_record_a_cut_or_a_record_of_another_checkpoint_is_refused_on_read(tmp_path):
    """The CRC-32 check catches what the content digest it replaced caught: a byte changed in any record
    (weights, pickle, version records), a file cut short anywhere, and one record replaced by the same
    record of another checkpoint of the same shapes. The record is named."""
    ckpt, other = tmp_path / "ckpt.pt", tmp_path / "other" / "ckpt.pt"
    other.parent.mkdir()
    save_checkpoint(ckpt, hand_built_checkpoint(Config()))
    good, spans = ckpt.read_bytes(), record_spans(ckpt)
    assert len(spans) >= 6 and any(name.endswith("data.pkl") for name in spans)
    for name, (start, end) in spans.items():
        raw = bytearray(good)
        raw[(start + end - 1) // 2] ^= 0x01
        ckpt.write_bytes(raw)
        with pytest.raises(ConfigError, match=f"is damaged: its record {re.escape(name)} does not match"):
            read_checkpoint(ckpt)
    for cut in (len(good) - 1, len(good) - 100, len(good) // 2, 200):
        ckpt.write_bytes(good[:cut])
        with pytest.raises(ConfigError, match="is not a readable checkpoint"):
            read_checkpoint(ckpt)
    state = hand_built_checkpoint(Config())
    state["model"]["weight"] = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    save_checkpoint(other, state)
    weights = max(spans, key=lambda name: spans[name][1] - spans[name][0])
    (start, end), (other_start, other_end) = spans[weights], record_spans(other)[weights]
    ckpt.write_bytes(good[:start] + other.read_bytes()[other_start:other_end] + good[end:])
    assert torch.equal(torch.load(ckpt, weights_only=False)["model"]["weight"], state["model"]["weight"])
    with pytest.raises(ConfigError, match=f"is damaged: its record {re.escape(weights)} does not match"):
        read_checkpoint(ckpt)


@pytest.mark.slow
def test_unreadable_checkpoint(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        train.train(resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", out) + ["--resume=true"])))


@pytest.mark.slow
def test_foreign_and_truncated_checkpoints(tiny_corpus, tmp_path, capsys):
    import sample

    out = tmp_path / "run"
    out.mkdir()
    torch.save({"weights": torch.zeros(3)}, out / "ckpt.pt")
    args = tiny_args(tiny_corpus, tmp_path / "data", out)
    with pytest.raises(ConfigError, match="not a checkpoint written by train.py"):
        train.train(resolve(parse_config(args + ["--resume=true"])))
    one_error_line(run_cli("sample.py", f"--out_dir={out}"), "not a checkpoint written by train.py")
    real = tmp_path / "real"
    train.train(resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", real, max_iters=1, eval_interval=1))))
    (out / "ckpt.pt").write_bytes((real / "ckpt.pt").read_bytes()[:5000])
    one_error_line(in_process(sample.main, [f"--out_dir={out}"], capsys), "not a readable checkpoint")
    one_error_line(in_process(sample.main, [f"--out_dir={real}", "--device=cuda:0"], capsys), "CUDA is not available")
    one_error_line(in_process(sample.main, [f"--out_dir={real}", "--num_samples=x"], capsys), "--num_samples")


# ---- saving: the previous checkpoint kept when a save fails or a run diverges


@pytest.mark.slow
def test_a_save_interrupted_midway_leaves_the_previous_checkpoint(long_args, tmp_path, monkeypatch):
    args, _ = long_args
    out = tmp_path / "run"
    train.train(resolve(parse_config(args(out) + ["--max_iters=3"])))
    real_save = torch.save

    def save_half_then_die(obj, file):
        real_save(obj, file)
        file.truncate(file.tell() // 2)
        raise KeyboardInterrupt  # as if killed while writing

    monkeypatch.setattr(torch, "save", save_half_then_die)
    with pytest.raises(KeyboardInterrupt):
        train.train(resolve(parse_config(args(out) + ["--max_iters=6", "--resume=true"])))
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == 3


@pytest.mark.slow
def test_a_checkpoint_that_cannot_be_written_is_one_line_and_leaves_the_old_one(tiny_corpus, tmp_path):
    import resource

    out = tmp_path / "run"
    args = tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2)
    train.train(resolve(parse_config(args)))  # data prepared and a first checkpoint written, without a limit
    old = (out / "ckpt.pt").read_bytes()
    limit = len(old) // 2

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = run_cli("train.py", *args, "--max_iters=4", "--resume=true", preexec_fn=small_files)
    one_error_line(result, "could not save the checkpoint", "(File too large)", f"step 2 is kept in {out / 'ckpt.pt'}")
    assert (out / "ckpt.pt").read_bytes() == old and not list(out.glob("ckpt.pt.tmp*"))


def contents(folder: Path) -> dict[str, bytes]:
    files = [p for p in folder.iterdir() if p.is_file() and p.name != ".lock"] if folder.exists() else []
    return {p.name: p.read_bytes() for p in files}


def torch_save_on_a_full_disk(obj, file) -> None:
    """torch.save when the disk fills. Writing to a file object, its writer meets the file's OSError and raises
    its own error from it; given a path, it says only that error's words."""
    enforce_fail = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    if isinstance(file, (str, os.PathLike)):
        Path(file).write_bytes(b"PK\x03\x04")  # the zip's first bytes are written
        raise enforce_fail
    file.write(b"PK\x03\x04")
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as e:
        raise enforce_fail from e


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.mark.parametrize("case", ["first checkpoint", "second checkpoint", "replacing a run"])
def test_a_full_disk_at_a_checkpoint_says_so_and_what_is_kept(tiny_corpus, data_dir, tmp_path, monkeypatch, case):
    out, real_save = tmp_path / "run", torch.save
    args = tiny_args(tiny_corpus, data_dir, out, max_iters=4, eval_interval=2, log_interval=2)
    if case == "replacing a run":
        train.train(resolve(parse_config(args)))
        args.append("--overwrite=true")
    before = contents(out)
    saves = []

    def save(obj, file) -> None:
        saves.append(1)
        (real_save if case == "second checkpoint" and len(saves) == 1 else torch_save_on_a_full_disk)(obj, file)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(SaveFailed) as error:
        train.train(resolve(parse_config(args)))
    kept = {
        "first checkpoint": "no checkpoint was written",
        "second checkpoint": f"the checkpoint of step 2 is kept in {out / 'ckpt.pt'}",
        "replacing a run": f"no checkpoint was written; {out} keeps the run it held",
    }[case]
    place = out / (".replacing" if case == "replacing a run" else "") / "ckpt.pt"
    assert str(error.value) == f"could not save the checkpoint {place} (No space left on device); {kept}"
    assert not list(out.rglob("*.tmp-*")) and not (out / ".replacing").exists()
    if case == "first checkpoint":
        assert not (out / "ckpt.pt").exists()
    elif case == "second checkpoint":
        assert read_checkpoint(out / "ckpt.pt")["step"] == 2
    else:
        assert contents(out) == before  # the old run, whole


@pytest.mark.slow
def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(long_args, tmp_path, monkeypatch):
    args, _ = long_args
    out = tmp_path / "run"
    real_accumulate, steps = train.accumulate_gradients, []

    def nan_from_step_5(model, batches, autocast, config, doc_mask):
        steps.append(1)
        loss = real_accumulate(model, batches, autocast, config, doc_mask)
        return loss * float("nan") if len(steps) >= 5 else loss

    monkeypatch.setattr(train, "accumulate_gradients", nan_from_step_5)
    with pytest.raises(TrainingDiverged, match="non-finite by step 6"):
        # caught at the step-6 checkpoint at the latest
        train.train(resolve(parse_config(args(out) + ["--log_interval=10"])))
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == 3
    assert all(r["step"] <= 3 for r in records(out))


@pytest.mark.slow
def test_a_run_that_diverges_before_its_first_checkpoint_says_none_was_written(tiny_corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "accumulate_gradients", lambda *a, **k: torch.tensor(float("nan")))
    with pytest.raises(TrainingDiverged) as error:
        train.train(resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "run", eval_interval=4))))
    assert str(error.value).endswith("no checkpoint was written") and not (tmp_path / "run" / "ckpt.pt").exists()


# ---- what a checkpoint holds: read from anywhere, exported with its own step and loss


def test_the_model_of_an_earlier_checkpoint_loads():
    """Earlier checkpoints' model_config also held doc_mask and flex_kernel_options, which the model no longer
    has: sample.py and export_hf.py read their models all the same, with the attention they are asked for."""
    from model import GPT, GPTConfig

    config = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, n_embd=16)
    model = GPT(config)
    saved = {**dataclasses.asdict(config), "doc_mask": True, "flex_kernel_options": None}
    loaded = sample.trained_model({"model": model.state_dict(), "model_config": saved}, torch.device("cpu"), "sdpa")
    assert loaded.config == dataclasses.replace(config, attn_impl="sdpa")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_sampling_works_from_anywhere_and_from_a_copied_run_folder(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    train.train(resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2))))
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
def test_an_export_takes_its_step_and_loss_from_the_checkpoint_it_exports(trained, tmp_path):
    run = copy_of(trained[0], tmp_path)
    state = read_checkpoint(run / "ckpt.pt")
    assert state["evaluation"]["step"] == state["step"] == 4
    with open(run / "metrics.jsonl", "a") as f:  # training goes on: a later evaluation, not yet in ckpt.pt
        f.write(json.dumps({"step": 6, "val_loss": 1.0, "val_doc_loss": 1.2345}) + "\n")
    export_hf.export(run, tmp_path / "hf")
    card = (tmp_path / "hf" / "README.md").read_text()
    assert f"{state['evaluation']['val_doc_loss']:.4f} at step 4" in card and "1.2345" not in card
