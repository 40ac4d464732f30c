"""Fault injection, round 4: no run trains, samples or exports from damaged or mismatched state. One test
(or a few) per category: checkpoints damaged inside their weights, paths of the wrong kind where a run's
file goes, settings the data contradicts, empty files among good ones, data changed under a resumed run,
a run read while it is written, the smallest shapes, messages that name what exists, runs refused or
failed before their first checkpoint, every way a process ends, and a damaged config.json beside a good
checkpoint.

The tests marked slow train a model or start a process. The others guard the same promises in the fast
tier, on checkpoints and run folders built by hand, calling the function that keeps each promise."""

import dataclasses
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, make_documents, tiny_args

import export_hf
import prepare
import sample
import train
from cli import parse_config
from config import Config
from errors import ConfigError, DataError, SaveFailed, TrainingDiverged
from run import checkpoint as checkpoints
from run.checkpoint import read_checkpoint, save_checkpoint
from run.folder import RUN_FILES, MetricsFile, RunFiles, exclusive_lock, hold, lock_holder, write_atomically
from studies import report


def python(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def one_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and result.returncode != 0, result.stderr[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def trained(tiny_corpus, tmp_path_factory) -> tuple[Path, list[str]]:
    """A finished run of 4 steps with checkpoints at 2 and 4, and the arguments that made it."""
    tmp = tmp_path_factory.mktemp("trained")
    args = tiny_args(tiny_corpus, tmp / "data", tmp / "run", max_iters=4, eval_interval=2)
    train.train(parse_config(args))
    return tmp / "run", args


def copy_of(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != ".lock"}


# ---- 1. a checkpoint damaged inside its weights, without a change of size


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
        lambda: train.train(parse_config([f"--out_dir={run}", "--resume=true", "--max_iters=6"])),
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


def hand_built_checkpoint(cfg: Config) -> dict:
    """What Checkpointer.save writes, without training: one weight large enough to be the file's largest
    member (the one flip_byte_in_weights changes), the settings of `cfg`, one process's RNG, and shards
    that do not exist (a resumed run that got past the checks would stop there, in one line)."""
    generator = torch.Generator().manual_seed(0)
    return {
        "model": {"weight": torch.randn(64, 64, generator=generator)},
        "optimizer": {"state": {}, "param_groups": []},
        "config": dataclasses.asdict(cfg),
        "model_config": {},
        "step": 2,
        "data": {"epoch": 0, "cursor": 0},
        "rng": [checkpoints.rng_states()],
        "tokenizer_sha256": "0" * 64,
        "run_id": "hand-built",
        "shards": "/nonexistent/shards",
    }


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


# ---- 2. a path of the wrong kind where a run's file goes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ckpt.pt", "config.json", "metrics.jsonl"])
def test_a_folder_where_a_run_file_belongs_is_the_same_one_line_in_every_mode(trained, tmp_path, name):
    run = copy_of(trained[0], tmp_path)
    (run / name).unlink()
    (run / name).mkdir()
    expected = f"{run / name} is not a file, where the run's"
    for mode in ([], ["--overwrite=true"], ["--resume=true", "--max_iters=6"]):
        with pytest.raises(ConfigError, match=expected):
            train.train(parse_config(trained[1] + [f"--out_dir={run}", *mode]))
    assert (run / name).is_dir()


# ---- 3. settings that the data contradicts


@pytest.mark.slow
def test_a_prepared_folder_decides_the_data_settings_and_a_contradicting_one_is_refused(trained, tmp_path):
    shards = Path(read_checkpoint(trained[0] / "ckpt.pt")["shards"])
    base = tiny_args(shards, tmp_path / "data", tmp_path / "a", max_iters=1, eval_interval=1)
    base = [a for a in base if not a.startswith("--tokenizer_vocab_size")]
    for setting in ("--tokenizer_vocab_size=500", "--val_fraction=0.2", "--data_seed=7", "--text_field=body"):
        with pytest.raises(ConfigError, match=rf"{setting[2:].split('=')[0]}=.*but {shards} was prepared with"):
            train.train(parse_config(base + [setting]))
    assert not any((tmp_path / "a" / name).exists() for name in RUN_FILES)
    train.train(parse_config(base))  # the defaults: the folder's own settings are used, and recorded
    recorded = json.loads((tmp_path / "a" / "config.json").read_text())
    assert recorded["tokenizer_vocab_size"] == 320 and recorded["dataset"] == str(shards)


# ---- 4. empty or damaged files among good ones


@pytest.mark.slow
def test_empty_files_in_a_folder_are_skipped_and_named_and_a_damaged_one_is_refused(tmp_path):
    import gzip

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = make_documents(200)
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    (corpus / "good.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    for name in ("empty.jsonl.gz", "empty.jsonl.zst", "empty.jsonl"):
        (corpus / name).write_bytes(b"")
    (corpus / "blank.jsonl").write_text("\n\n")
    folder = prepare.prepare(str(corpus), str(tmp_path / "data"), Config(tokenizer_vocab_size=300), log=print)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["skipped"]["empty_file"] == 4
    assert meta["skipped_files"] == {"empty_file": ["blank.jsonl", "empty.jsonl", "empty.jsonl.gz", "empty.jsonl.zst"]}
    assert any("skipped 4 file(s) whole (empty file): blank.jsonl" in line for line in prepare.describe(meta, {}))
    good = gzip.compress(b'{"text": "a b c"}\n' * 500)
    (corpus / "cut.jsonl.gz").write_bytes(good[: len(good) // 2])  # damage found after some of it was read
    with pytest.raises(DataError, match="cut.jsonl.gz cannot be read to the end"):
        prepare.prepare(str(corpus), str(tmp_path / "data"), Config(tokenizer_vocab_size=300), log=print)


# ---- 5. the data changed under a run that resumes


@pytest.mark.slow
def test_a_resumed_run_trains_on_the_shards_its_checkpoint_names_or_not_at_all(tiny_corpus, tmp_path):
    corpus = tmp_path / "docs.jsonl"
    shutil.copy(tiny_corpus, corpus)
    args = tiny_args(corpus, tmp_path / "data", tmp_path / "run", max_iters=2, eval_interval=2)
    train.train(parse_config(args))
    shards = read_checkpoint(tmp_path / "run" / "ckpt.pt")["shards"]
    with open(corpus, "a") as f:  # the corpus grows: preparing it again would give other shards
        f.write("".join(json.dumps({"text": d}) + "\n" for d in make_documents(300, seed=9)))
    train.train(parse_config([f"--out_dir={tmp_path / 'run'}", "--resume=true", "--max_iters=4"]))
    assert read_checkpoint(tmp_path / "run" / "ckpt.pt")["shards"] == shards
    assert [p.name for p in (tmp_path / "data").iterdir() if not p.name.startswith(".")] == [Path(shards).name]
    shutil.rmtree(shards)  # and once they are gone, it is refused
    with pytest.raises(ConfigError, match=f"trained on the shards in {shards}, which cannot be read now"):
        train.train(parse_config([f"--out_dir={tmp_path / 'run'}", "--resume=true", "--max_iters=6"]))


# ---- 6. a run read while it is written


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


# ---- 7. the smallest shapes train.py accepts


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--bos=true", "--packing=bestfit"], ["--packing=pad", "--pos_emb=rope"]])
def test_the_shortest_rows_train_evaluate_sample_and_export(tiny_corpus, tmp_path, extra):
    args = tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "run", seq_len=2, n_embd=2, n_head=1, batch_size=1)
    train.train(parse_config(args + ["--max_iters=2", "--eval_interval=1", "--eval_tokens=64", *extra]))
    assert sample.main([f"--out_dir={tmp_path / 'run'}", "--max_new_tokens=3"]) == 0
    export_hf.export(tmp_path / "run", tmp_path / "hf")


# ---- 9. messages that name what exists


@pytest.mark.slow
def test_a_run_that_diverges_before_its_first_checkpoint_says_none_was_written(tiny_corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "accumulate_gradients", lambda *a, **k: torch.tensor(float("nan")))
    with pytest.raises(TrainingDiverged) as error:
        train.train(parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "run", eval_interval=4)))
    assert str(error.value).endswith("no checkpoint was written") and not (tmp_path / "run" / "ckpt.pt").exists()


@pytest.mark.slow
def test_a_busy_folder_names_the_process_that_holds_its_lock(tmp_path):
    (tmp_path / ".lock").write_text("1")  # a pid left by an earlier holder
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import fcntl, os, time; fd = os.open({str(tmp_path / '.lock')!r}, os.O_RDWR); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"in use by another run \(process {holder.pid}\)"):
            with hold(tmp_path, resume=False, overwrite=False):
                pass
    finally:
        holder.kill()


# ---- 10. a run that is refused or fails changes nothing that was there


@pytest.mark.slow
def test_overwriting_replaces_the_old_run_only_once_the_new_one_has_a_checkpoint(trained, tmp_path, monkeypatch):
    run = copy_of(trained[0], tmp_path)
    before = contents(run)
    overwrite = trained[1] + [f"--out_dir={run}", "--overwrite=true", "--seed=5"]
    with pytest.raises(DataError):  # refused after the folder was taken: bad data
        train.train(parse_config(overwrite + [f"--dataset={tmp_path / 'missing.jsonl'}"]))
    assert contents(run) == before

    def full_disk(path, state):
        raise SaveFailed(f"could not save the checkpoint {path} (No space left on device)")

    monkeypatch.setattr(checkpoints, "save_checkpoint", full_disk)
    with pytest.raises(SaveFailed):  # failed at its first checkpoint
        train.train(parse_config(overwrite))
    assert contents(run) == before and not (run / ".replacing").exists()
    monkeypatch.undo()
    train.train(parse_config(overwrite))
    after = contents(run)
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in after)
    assert json.loads(after["config.json"])["run_id"] == read_checkpoint(run / "ckpt.pt")["run_id"]


@pytest.mark.slow
def test_a_folder_that_mixes_two_runs_is_refused(trained, tmp_path):
    run = copy_of(trained[0], tmp_path)
    settings = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**settings, "run_id": "another"}))  # a move that never finished
    with pytest.raises(ConfigError, match=f"{run} mixes two runs: its config.json belongs to another run"):
        train.train(parse_config([f"--out_dir={run}", "--resume=true", "--max_iters=6"]))


def old_run_in(folder: Path) -> dict[str, bytes]:
    """A finished run's files written by hand into `folder` (their content is never read here); returns them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        (folder / name).write_bytes(f"the old run's {name}".encode())
    return contents(folder)


def test_a_new_run_into_a_folder_holding_a_run_is_refused_unless_asked_to_overwrite(tmp_path):
    """The fast guard of test_reliability's test_a_fresh_run_never_replaces_a_finished_one. Its dataset is
    missing, so a run that gets past the folder stops at its data at once, with another error."""
    run = tmp_path / "run"
    before = old_run_in(run)
    args = [f"--out_dir={run}", f"--data_dir={tmp_path / 'data'}", f"--dataset={tmp_path / 'missing.jsonl'}"]
    with pytest.raises(ConfigError, match=r"holds a run \(ckpt.pt\): continue it with --resume=true.*--overwrite=true"):
        train.train(parse_config(args))
    assert contents(run) == before
    with pytest.raises(DataError):  # asked to overwrite: the folder is taken, and the run goes on to its data
        train.train(parse_config([*args, "--overwrite=true"]))
    assert contents(run) == before  # nothing is replaced before the new run's first checkpoint


def test_a_replacing_run_writes_beside_the_old_one_until_its_first_checkpoint(tmp_path):
    """The fast guard of the staging folder (test_overwriting_replaces_the_old_run_only_once_the_new_one_has_a_
    checkpoint): RunFiles as train.fit uses it, without training."""
    before = old_run_in(tmp_path)
    new = {name: f"the new run's {name}".encode() for name in RUN_FILES}
    with RunFiles(tmp_path, "new", fresh=True) as run_files:  # a run that ends before its first checkpoint
        for name, content in new.items():
            run_files.path(name).write_bytes(content)
        assert contents(tmp_path) == before  # the old run stays whole while the new one writes
    assert contents(tmp_path) == before and not (tmp_path / ".replacing").exists()
    with RunFiles(tmp_path, "new", fresh=True) as run_files:
        for name, content in new.items():
            run_files.path(name).write_bytes(content)
        run_files.promote()  # what Checkpointer.save does once the first checkpoint is written
    assert contents(tmp_path) == new and not (tmp_path / ".replacing").exists()


# ---- 11. every way a process ends


@pytest.mark.slow
def test_sigterm_or_sighup_during_preparation_is_one_line_and_leaves_nothing(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_documents(20000)))
    for signum in (signal.SIGTERM, signal.SIGHUP):
        data_dir = tmp_path / f"data{signum}"
        child = subprocess.Popen(
            [sys.executable, "prepare.py", str(corpus), f"--data_dir={data_dir}", "--tokenizer_vocab_size=300"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + 120
        while not any(data_dir.glob(".*.tmp-*")) and time.time() < deadline:  # the preparation has begun
            time.sleep(0.05)
        child.send_signal(signum)
        _, err = child.communicate(timeout=120)
        assert child.returncode == 128 + signum, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("interrupted:") and "Traceback" not in err
        assert not list(data_dir.glob(".*.tmp-*")) and not list(data_dir.glob("*/meta.json"))


@pytest.mark.slow
def test_sighup_stops_training_like_ctrl_c(tiny_corpus, tmp_path):
    args = tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "run", max_iters=100000, eval_interval=100000)
    child = subprocess.Popen(
        [sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in child.stdout:
        if line.startswith("step "):
            break
    child.send_signal(signal.SIGHUP)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGHUP and "SIGHUP: finishing this step" in out, err[-2000:]
    step = read_checkpoint(tmp_path / "run" / "ckpt.pt")["step"]
    assert f"run stopped after step {step} of 100000" in out
    assert f"interrupted: SIGHUP stopped the run after step {step} with its checkpoint saved; exit 129" in err


@pytest.mark.slow
def test_a_result_that_cannot_be_written_is_one_line(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (tmp_path / "figure.png").mkdir()  # nothing can be written there
    with pytest.raises(SaveFailed, match="could not write"):
        report.save_figure(plt.figure(), tmp_path / "figure.png")
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
    run_files = RunFiles(tmp_path / "run", "id", fresh=False)
    with pytest.raises(SaveFailed, match="could not write"):
        MetricsFile(run_files, resume_step=None)


# ---- 12. config.json is a record for people: a resumed run takes its settings from its checkpoint


@pytest.mark.slow
def test_a_damaged_config_json_beside_a_good_checkpoint_resumes_with_its_settings(trained, tmp_path, capsys):
    run = copy_of(trained[0], tmp_path)
    (run / "config.json").write_text('{"max_iters": 4, "n_embd": ')  # cut short
    cfg = parse_config([f"--out_dir={run}", "--resume=true", "--max_iters=6"])
    assert cfg.n_embd == 32 and cfg.max_iters == 6 and not capsys.readouterr().err
    train.train(cfg)
    assert json.loads((run / "config.json").read_text())["max_iters"] == 6  # written whole again
    (run / "ckpt.pt").unlink()
    with pytest.raises(ConfigError, match="resume=true but .*ckpt.pt does not exist"):
        train.train(parse_config([f"--out_dir={run}", "--resume=true"]))


def stopped_run(folder: Path, cfg: Config) -> Path:
    """A run folder as a stopped run leaves it, built by hand: config.json and ckpt.pt of `cfg`, of one run
    (the same run id in both)."""
    folder.mkdir()
    state = hand_built_checkpoint(dataclasses.replace(cfg, out_dir=str(folder)))
    (folder / "config.json").write_text(json.dumps({"run_id": state["run_id"], **state["config"]}))
    save_checkpoint(folder / "ckpt.pt", state)
    return folder


def test_a_resumed_run_takes_its_settings_from_its_checkpoint_not_from_config_json(tmp_path):
    """Settings edited into config.json change nothing; given ones are checked once, against the checkpoint:
    those a resumed run may change pass, the others are named."""
    run = stopped_run(tmp_path / "run", Config(n_embd=32))
    saved = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**saved, "n_embd": 48}))
    cfg = parse_config([f"--out_dir={run}", "--resume=true", "--max_iters=700"])
    assert cfg.n_embd == 32 and cfg.max_iters == 700
    state = read_checkpoint(run / "ckpt.pt")
    checkpoints.check_resumable(run / "ckpt.pt", state, cfg, world_size=1)
    cfg = parse_config([f"--out_dir={run}", "--resume=true", "--n_embd=48"])
    with pytest.raises(
        ConfigError, match=rf"cannot resume {re.escape(str(run))} with other settings \(n_embd: 32 -> 48\)"
    ):
        checkpoints.check_resumable(run / "ckpt.pt", state, cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"with other settings \(n_embd: 32 -> 48\)"):
        train.train(cfg)  # the one check, before anything is prepared or written


def test_the_packing_cannot_change_when_a_run_resumes(tmp_path):
    """The rows are planned from the packing, and the data position counts rows: resumed under another
    packing, a run would go on at its cursor in other rows."""
    run = stopped_run(tmp_path / "run", Config(packing="concat"))
    cfg = parse_config([f"--out_dir={run}", "--resume=true", "--packing=bestfit"])
    changed = re.escape("(packing: 'concat' -> 'bestfit')")
    with pytest.raises(ConfigError, match=rf"cannot resume {re.escape(str(run))} with other settings {changed}"):
        checkpoints.check_resumable(run / "ckpt.pt", read_checkpoint(run / "ckpt.pt"), cfg, world_size=1)


@pytest.mark.slow
def test_a_result_file_never_replaces_a_device_a_fifo_or_a_folder(tmp_path):
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "ckpt.pt.tmp").mkdir()  # a folder where the temporary file goes
    for path in (fifo, Path("/dev/null"), tmp_path / "ckpt.pt"):
        with pytest.raises(SaveFailed, match="is not a regular file"):
            write_atomically(path, "{}")
    assert fifo.is_fifo() and Path("/dev/null").is_char_device() and (tmp_path / "ckpt.pt.tmp").is_dir()
    assert not (tmp_path / "ckpt.pt").exists()
    write_atomically(tmp_path / "result.json", "{}")  # absent, then a regular file: written, replaced
    write_atomically(tmp_path / "result.json", "[]")
    assert (tmp_path / "result.json").read_text() == "[]"


@pytest.mark.slow
def test_a_lock_refusal_names_the_process_that_wrote_its_pid_not_a_child_listed_in_proc_locks(tmp_path, monkeypatch):
    import os

    lock = tmp_path / ".lock"
    with exclusive_lock(lock):
        fd = os.open(lock, os.O_RDONLY)
        real_read_text = Path.read_text

        def proc_locks_naming_a_child(path, *args, **kwargs):  # what /proc/locks shows after a fork
            if str(path) == "/proc/locks":
                stat = os.fstat(fd)
                device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
                return f"1: FLOCK  ADVISORY  WRITE 999999 {device} 0 EOF\n"
            return real_read_text(path, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", proc_locks_naming_a_child)
        assert lock_holder(fd) == str(os.getpid())
        os.pwrite(fd_rw := os.open(lock, os.O_RDWR), b"999998", 0)  # a holder that is gone: /proc/locks decides
        assert lock_holder(fd) == "999999"
        os.close(fd_rw)
        os.close(fd)
