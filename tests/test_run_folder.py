"""The run folder (run/folder.py): one run at a time in a folder, under its lock, and a refusal that names
the process holding it; results written atomically, never in place of a device, a FIFO or a folder, and
never over a finished run unless asked; an old run replaced only once the new one has its first
checkpoint; a moved run that resumes where it is; and metrics.jsonl or the lock damaged, named in one
line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    copy_of,
    one_error_line,
    records,
    run_cli,
    start,
    tiny_args,
    tried,
    wait_for_step,
)

import train
from cli import parse_config
from errors import ConfigError, DataError, SaveFailed
from resolve import resolve
from run import checkpoint as checkpoints
from run.checkpoint import read_checkpoint
from run.folder import RUN_FILES, MetricsFile, RunFiles, exclusive_lock, hold, lock_holder, write_atomically
from studies import report


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != ".lock"}


# ---- the lock and its holder


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
        assert lock_holder(fd) == f"process {os.getpid()}"
        os.pwrite(fd_rw := os.open(lock, os.O_RDWR), b"999998", 0)  # a holder that is gone, and /proc/locks names
        assert lock_holder(fd) == "an unknown process"  # one that is not running: no other process has it open
        os.close(fd_rw)
        os.close(fd)


# A holder as `( exec 9>>RUN/.lock; flock -x 9; exec sleep 120 ) &` makes one: a child takes the lock on the
# inherited descriptor and exits, and its parent holds it on. With "2", a second process keeps the file open too.
LOCKED_BY_A_CHILD = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
if os.fork() == 0:
    fcntl.flock(fd, fcntl.LOCK_EX)
    os._exit(0)
os.wait()
if sys.argv[2] == "2" and os.fork() == 0:
    time.sleep(60)
    os._exit(0)
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("openers", [1, 2])
def test_a_lock_left_by_a_child_that_exited_names_its_holder_or_says_it_is_unknown(tmp_path, openers):
    import os
    import signal

    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / ".lock").write_text(str(gone.pid))  # an earlier run's pid: not running now
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCKED_BY_A_CHILD, str(tmp_path / ".lock"), str(openers)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        named = f"process {holder.pid}" if openers == 1 else "an unknown process"
        with pytest.raises(ConfigError, match=rf"is in use by another run \({named}\); wait for it"):
            with hold(tmp_path, resume=False, overwrite=False):
                pass
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


# ---- results written whole, never in place of what is not a regular file


@pytest.mark.slow
def test_a_result_file_never_replaces_a_device_a_fifo_or_a_folder(tmp_path):
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / f"ckpt.pt.tmp-{os.getpid()}").mkdir()  # a folder where this process's temporary file goes
    for path in (fifo, Path("/dev/null"), tmp_path / "ckpt.pt"):
        with pytest.raises(SaveFailed, match="is not a regular file"):
            write_atomically(path, "{}")
    assert fifo.is_fifo() and Path("/dev/null").is_char_device() and (tmp_path / f"ckpt.pt.tmp-{os.getpid()}").is_dir()
    assert not (tmp_path / "ckpt.pt").exists()
    write_atomically(tmp_path / "result.json", "{}")  # absent, then a regular file: written, replaced
    write_atomically(tmp_path / "result.json", "[]")
    assert (tmp_path / "result.json").read_text() == "[]"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["result.json"]  # no temporary file left


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


def test_a_metrics_record_that_does_not_fit_leaves_the_log_as_it_was(tmp_path):
    """A full disk or a file-size limit can take part of a line before the write fails: the log keeps its whole
    lines only (a file-size limit here: the kernel writes up to it, then refuses)."""
    import resource

    metrics = MetricsFile(RunFiles(tmp_path, "id", fresh=False), resume_step=None)
    metrics.write({"step": 1, "train_loss": 5.0})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) + 10, hard))  # room for 10 bytes of the next line
    try:
        with pytest.raises(SaveFailed, match=r"could not write .*metrics.jsonl \(File too large\)"):
            metrics.write({"step": 2, "train_loss": 4.0, "lr": 0.001})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize("writer", ["weights", "tokenizer"])
def test_an_export_onto_a_full_disk_is_one_line_and_leaves_the_earlier_export(trained, tmp_path, monkeypatch, writer):
    """safetensors and tokenizers write in Rust and raise their own exceptions for the OS's error."""
    import safetensors.torch
    import transformers
    from safetensors import SafetensorError

    import export_hf

    def full(path, text: str, error: type[Exception]) -> None:
        Path(path).write_bytes(b"{")  # the file's first bytes are written
        raise error(text)

    if writer == "weights":
        text = "Error while serializing: I/O error: No space left on device (os error 28)"
        monkeypatch.setattr(safetensors.torch, "save_file", lambda t, path, *a, **k: full(path, text, SafetensorError))
    else:
        monkeypatch.setattr(
            transformers.PreTrainedTokenizerFast,
            "save_pretrained",
            lambda self, folder, **k: full(
                Path(folder) / "tokenizer.json", "No space left on device (os error 28)", Exception
            ),
        )
    to = tmp_path / "hf"
    to.mkdir()
    for name in ("config.json", "model.safetensors"):  # an earlier export, which --overwrite=true replaces
        (to / name).write_text("earlier")
    with pytest.raises(export_hf.ExportError, match=rf"^could not write {to} \(No space left on device\)$"):
        export_hf.export(trained[0], to, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder left
    assert {p.name: p.read_text() for p in to.iterdir()} == {"config.json": "earlier", "model.safetensors": "earlier"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ckpt.pt", "config.json", "metrics.jsonl"])
def test_a_folder_where_a_run_file_belongs_is_the_same_one_line_in_every_mode(trained, tmp_path, name):
    run = copy_of(trained[0], tmp_path)
    (run / name).unlink()
    (run / name).mkdir()
    expected = f"{run / name} is not a file, where the run's"
    for mode in ([], ["--overwrite=true"], ["--resume=true", "--max_iters=6"]):
        with pytest.raises(ConfigError, match=expected):
            train.train(resolve(parse_config(trained[1] + [f"--out_dir={run}", *mode])))
    assert (run / name).is_dir()


@pytest.mark.slow
def test_out_dir_not_writable(tiny_corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="out_dir .* is not a writable folder"):
        train.train(resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", blocker / "out"))))


def test_an_export_over_a_folder_holding_files_of_its_users_keeps_them(tmp_path, monkeypatch):
    """--overwrite=true replaces an earlier export, never a folder that also holds other files (a model
    repository's clone: its .git, the user's notes); the export's own work is faked, the refusal is not."""
    import export_hf

    def write_folder(folder: Path, model, enc) -> dict:
        folder.mkdir()
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (folder / name).write_text("new")
        return {}

    monkeypatch.setattr(export_hf, "read_checkpoint", lambda path: {"model_config": {"pos_emb": "rope"}})
    monkeypatch.setattr(export_hf.sample, "trained_model", lambda *a, **k: torch.nn.Linear(1, 1))
    monkeypatch.setattr(export_hf.sample, "checkpoint_tokenizer", lambda state: None)
    monkeypatch.setattr(export_hf.huggingface, "write_folder", write_folder)
    monkeypatch.setattr(export_hf, "model_card", lambda *a: "card")
    monkeypatch.setattr(export_hf, "check", lambda *a: {})
    to = tmp_path / "hf"
    to.mkdir()
    (to / "config.json").write_text("earlier")
    (to / "model.safetensors").write_text("earlier")
    export_hf.export(tmp_path / "run", to, overwrite=True)
    assert (to / "config.json").read_text() == "new"  # an earlier export alone is replaced
    (to / ".git").mkdir()
    (to / "NOTES.txt").write_text("mine")
    with pytest.raises(export_hf.ExportError, match=r"hf holds \.git, NOTES\.txt, which an export does not write"):
        export_hf.export(tmp_path / "run", to, overwrite=True)
    assert (to / "NOTES.txt").read_text() == "mine" and (to / ".git").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder left


@pytest.mark.slow
def test_export_never_replaces_the_run_the_working_folder_or_a_folder_that_is_not_an_export(
    reference_run, tmp_path, monkeypatch
):
    import export_hf

    args, _ = reference_run
    out = tmp_path / "runs" / "run"
    train.train(resolve(parse_config(args(out, max_iters=1, eval_interval=1))))
    monkeypatch.chdir(tmp_path)
    for to in (out, out.parent, tmp_path, Path("/")):
        with pytest.raises(export_hf.ExportError, match="is the run's folder, the working folder or a folder above"):
            export_hf.export(out, to, overwrite=True)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(export_hf.ExportError, match="is not an exported model folder"):
        export_hf.export(out, tmp_path / "notes", overwrite=True)
    assert (tmp_path / "notes" / "keep.txt").exists() and (out / "ckpt.pt").exists()
    tried("export target", 5)


# ---- a run in the folder: never replaced unless asked, and then only once the new one has a checkpoint


@pytest.mark.slow
def test_a_fresh_run_never_replaces_a_finished_one(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2)
    train.train(resolve(parse_config(args)))
    before = {name: (out / name).read_bytes() for name in ("ckpt.pt", "config.json", "metrics.jsonl")}
    with pytest.raises(ConfigError, match=r"holds a run .*--resume=true.*another out_dir.*--overwrite=true"):
        train.train(resolve(parse_config(args + ["--n_embd=64"])))
    assert {name: (out / name).read_bytes() for name in before} == before
    train.train(resolve(parse_config(args + ["--n_embd=64", "--overwrite=true"])))
    assert torch.load(out / "ckpt.pt", weights_only=False)["config"]["n_embd"] == 64


def old_run_in(folder: Path) -> dict[str, bytes]:
    """A finished run's files written by hand into `folder` (their content is never read here); returns them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        (folder / name).write_bytes(f"the old run's {name}".encode())
    return contents(folder)


def test_a_new_run_into_a_folder_holding_a_run_is_refused_unless_asked_to_overwrite(tmp_path):
    """The fast guard of test_a_fresh_run_never_replaces_a_finished_one (above). Its dataset is
    missing, so a run that gets past the folder stops at its data at once, with another error."""
    run = tmp_path / "run"
    before = old_run_in(run)
    args = [f"--out_dir={run}", f"--data_dir={tmp_path / 'data'}", f"--dataset={tmp_path / 'missing.jsonl'}"]
    with pytest.raises(ConfigError, match=r"holds a run \(ckpt.pt\): continue it with --resume=true.*--overwrite=true"):
        train.train(resolve(parse_config(args)))
    assert contents(run) == before
    with pytest.raises(DataError):  # asked to overwrite: the folder's checks pass, and the run goes on to its data
        train.train(resolve(parse_config([*args, "--overwrite=true"])))
    assert contents(run) == before  # nothing is replaced before the new run's first checkpoint


def test_a_replacing_run_writes_beside_the_old_one_until_its_first_checkpoint(tmp_path):
    """The fast guard of the staging folder (test_overwriting_replaces_the_old_run_only_once_the_new_one_has_a_
    checkpoint): RunFiles as the Session uses it, without training."""
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
        run_files.promote()  # what Session.save does once the first checkpoint is written
    assert contents(tmp_path) == new and not (tmp_path / ".replacing").exists()


@pytest.mark.slow
def test_overwriting_replaces_the_old_run_only_once_the_new_one_has_a_checkpoint(trained, tmp_path, monkeypatch):
    run = copy_of(trained[0], tmp_path)
    before = contents(run)
    overwrite = trained[1] + [f"--out_dir={run}", "--overwrite=true", "--seed=5"]
    with pytest.raises(DataError):  # refused after the folder's checks: bad data
        train.train(resolve(parse_config(overwrite + [f"--dataset={tmp_path / 'missing.jsonl'}"])))
    assert contents(run) == before

    def full_disk(path, state, kept):
        raise SaveFailed(f"could not save the checkpoint {path} (No space left on device)")

    monkeypatch.setattr(checkpoints, "save_checkpoint", full_disk)
    with pytest.raises(SaveFailed):  # failed at its first checkpoint
        train.train(resolve(parse_config(overwrite)))
    assert contents(run) == before and not (run / ".replacing").exists()
    monkeypatch.undo()
    train.train(resolve(parse_config(overwrite)))
    after = contents(run)
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in after)
    assert json.loads(after["config.json"])["run_id"] == read_checkpoint(run / "ckpt.pt")["run_id"]


@pytest.mark.slow
def test_a_moved_run_resumes_where_it_is_and_overwrite_keeps_the_old_run_until_it_has_a_checkpoint(
    reference_run, tmp_path
):
    args, _ = reference_run
    first = tmp_path / "first"
    train.train(resolve(parse_config(args(first, max_iters=3))))
    moved = tmp_path / "moved"
    shutil.copytree(first, moved)
    shutil.rmtree(first)
    cfg = parse_config([f"--out_dir={moved}", "--resume=true", "--max_iters=6"])
    assert cfg.out_dir == str(moved)  # not the folder its config.json was written in
    train.train(resolve(cfg))
    assert not first.exists() and torch.load(moved / "ckpt.pt", weights_only=False)["step"] == 6
    with hold(moved, resume=False, overwrite=True):
        run_files = RunFiles(moved, "new", fresh=True)  # a kill now leaves the old run whole
        assert run_files.path("ckpt.pt") == moved / ".replacing" / "ckpt.pt" and (moved / "ckpt.pt").exists()
    tried("moved or replaced run folder", 2)


# ---- damaged run folders


@pytest.mark.slow
def test_a_folder_that_mixes_two_runs_is_refused(trained, tmp_path):
    run = copy_of(trained[0], tmp_path)
    settings = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**settings, "run_id": "another"}))  # a move that never finished
    with pytest.raises(ConfigError, match=f"{run} mixes two runs: its config.json belongs to another run"):
        train.train(resolve(parse_config([f"--out_dir={run}", "--resume=true", "--max_iters=6"])))


@pytest.mark.slow
def test_damaged_run_folders_are_one_line(reference_run, tmp_path):
    args, _ = reference_run
    out = tmp_path / "run"
    train.train(resolve(parse_config(args(out, max_iters=3))))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([lines[0], "{ damaged", *lines[1:]]) + "\n")
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2 is not a metrics record"):
        train.train(resolve(parse_config(args(out, max_iters=6) + ["--resume=true"])))
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (out / ".lock").unlink()
    (out / ".lock").mkdir()
    with pytest.raises(ConfigError, match=r"\.lock cannot serve as the run's lock"):
        train.train(resolve(parse_config(args(out, max_iters=6) + ["--resume=true"])))
    tried("damaged run folder", 2)


def test_a_run_starting_removes_the_temporary_files_a_killed_run_left(tmp_path):
    for name in ("ckpt.pt.tmp-4242", "metrics.jsonl.tmp-17", "notes.txt.tmp-4242"):
        (tmp_path / name).write_bytes(b"half")
    RunFiles(tmp_path, "run", fresh=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt.tmp-4242"]  # not a run's file: kept


def test_a_write_leaves_another_writers_temporary_file_alone(tmp_path):
    """Two processes writing one file (a study's report) each go through a temporary file of their own: one
    never renames or truncates the other's, whatever name that one chose."""
    for name in ("result.json.tmp", "result.json.tmp-1"):
        (tmp_path / name).write_text("another process, mid-write")
    write_atomically(tmp_path / "result.json", "{}")
    assert (tmp_path / "result.json").read_text() == "{}"
    for name in ("result.json.tmp", "result.json.tmp-1"):
        assert (tmp_path / name).read_text() == "another process, mid-write"


def test_a_full_disk_does_not_cost_a_run_its_lock(tmp_path, monkeypatch):
    import errno
    import fcntl
    import os

    def full_disk(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full_disk)  # writing the pid is what a full disk refuses
    lock = tmp_path / ".lock"
    with exclusive_lock(lock):
        other = os.open(lock, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(other)


def test_a_lock_that_a_full_disk_refuses_says_so_and_does_not_blame_the_file(tmp_path):
    import errno
    import os

    from run.folder import lock_failure

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert (
        lock_failure(tmp_path / ".lock", "run", full)
        == f"no room for {tmp_path / '.lock'} (No space left on device): free some space"
    )
    directory = OSError(errno.EISDIR, os.strerror(errno.EISDIR))
    assert lock_failure(tmp_path / ".lock", "run", directory).endswith(
        "cannot serve as the run's lock (Is a directory): remove it (nothing holds it)"
    )
