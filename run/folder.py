"""The run folder, out_dir: a lock the OS drops when its process dies, writes that leave the old file or the
new one (never half of one), a new run that replaces an old one only at its first checkpoint, and the
metrics log. Imports nothing from the repo but its exceptions."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from errors import ConfigError, SaveFailed


@contextmanager
def exclusive_lock(path: Path, on_busy: Callable[[str], None] | None = None) -> Iterator[None]:
    """An exclusive lock on `path` for the with-block. Held by another process: on_busy(lock_holder's words) and
    wait, or without on_busy raise BlockingIOError(lock_holder's words)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_busy is None:
                raise BlockingIOError(lock_holder(fd)) from None
            on_busy(lock_holder(fd))
            fcntl.flock(fd, fcntl.LOCK_EX)
        with suppress(OSError):  # the pid only names the holder in messages: a full disk must not cost the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def lock_failure(lock: Path, holder: str, e: OSError) -> str:
    """Why `lock` cannot be taken, and what to do: a full disk is no fault of the lock file's."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no room for {lock} ({e.strerror}): free some space"
    return f"{lock} cannot serve as the {holder}'s lock ({e.strerror or e}): remove it (nothing holds it)"


def lock_holder(fd: int) -> str:
    """Who holds the lock on this file: "process N", or "an unknown process". The pid written in it (an earlier
    holder's, once that one is gone) and the one /proc/locks names (the locker: maybe a child that left the lock to
    its parent, as `flock` in a shell does) count only while they have the file open; else the one other that has."""
    stat = os.fstat(fd)
    named = [os.pread(fd, 32, 0).decode(errors="replace").strip()]
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    with suppress(OSError):
        for fields in (line.split() for line in Path("/proc/locks").read_text().splitlines()):
            if "->" not in fields and "FLOCK" in fields and device in fields:  # "->" marks a waiting process
                named.append(fields[fields.index(device) - 1])
    holder = next((pid for pid in named if pid.isdigit() and _has_open(pid, stat)), None)
    if holder is None:  # another user's processes may be unreadable: then the holder stays unknown
        others = {p.name for p in Path("/proc").glob("[0-9]*") if _has_open(p.name, stat)} - {str(os.getpid())}
        holder = others.pop() if len(others) == 1 else None
    return f"process {holder}" if holder else "an unknown process"


def _has_open(pid: str, stat: os.stat_result) -> bool:
    """Whether process `pid` has the file of `stat` open (False where /proc cannot tell)."""
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for descriptor in descriptors:
        with suppress(OSError):  # closed since it was listed
            if os.path.samestat(os.stat(f"/proc/{pid}/fd/{descriptor}"), stat):
                return True
    return False


def check_writable_folder(folder: Path, what: str) -> None:
    """Make `folder` if needed and check that a file can be written in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{what} {folder} is not a writable folder ({e.strerror})") from None


def replace_atomically(
    path: Path, write: Callable[[BinaryIO], object], failed: str = "could not write {path} ({reason})"
) -> None:
    """write(a binary file open on this process's temporary file), then rename it over `path`: an interrupt or a
    full disk leaves the previous file, never half of one; a failure is SaveFailed(`failed`). The one way results
    are written: through a Python file, whose failed write is the OSError itself (No space left on device), where
    torch.save given a path says only "[enforce fail at inline_container.cc:672]"."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    for target in (path, tmp):  # a rename would replace a device, a FIFO or a folder's entry: never do that
        if (target.exists() or target.is_symlink()) and not target.is_file():
            raise SaveFailed(failed.format(path=path, reason=f"{target} exists and is not a regular file"))
    try:
        with open(tmp, "wb") as file:
            write(file)
        os.replace(tmp, path)
    except BaseException as e:  # a second Ctrl-C mid-write too: the previous file stays, nothing half-written
        tmp.unlink(missing_ok=True)
        if not isinstance(e, (OSError, RuntimeError)):
            raise
        cause = e if isinstance(e, OSError) else e.__context__  # torch's writer raises RuntimeError from the OSError
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(e).splitlines()[0]
        raise SaveFailed(failed.format(path=path, reason=reason)) from None


def write_atomically(path: Path, text: str) -> None:
    replace_atomically(path, lambda file: file.write(text.encode()))


# ----------------------------------------------------------------------------------------------
# The run folder: out_dir/ckpt.pt, config.json, metrics.jsonl and .lock


RUN_FILES = {"ckpt.pt": "checkpoint", "config.json": "settings file", "metrics.jsonl": "metrics log"}


@contextmanager
def hold(out_dir: Path, resume: bool, overwrite: bool) -> Iterator[None]:
    """Hold out_dir for the run's lifetime: refuse a folder another run is using, or holding a run this one
    would replace unasked. Nothing changes here: a new run replaces an old one at its first checkpoint."""
    for name, what in RUN_FILES.items():  # each of a run's files, where it exists, is a regular file
        if (out_dir / name).exists() and not (out_dir / name).is_file():
            raise ConfigError(f"{out_dir / name} is not a file, where the run's {what} belongs: move it away")
    if resume and not (out_dir / "ckpt.pt").is_file():
        raise ConfigError(f"resume=true but {out_dir / 'ckpt.pt'} does not exist; start without --resume=true")
    check_writable_folder(out_dir, "out_dir")
    with ExitStack() as held:
        try:
            held.enter_context(exclusive_lock(out_dir / ".lock"))
        except BlockingIOError as e:
            raise ConfigError(
                f"{out_dir} is in use by another run ({e.args[0]}); wait for it or pick another out_dir"
            ) from None
        except OSError as e:
            raise ConfigError(lock_failure(out_dir / ".lock", "run", e)) from None
        if (out_dir / "ckpt.pt").exists() and not resume and not overwrite:
            raise ConfigError(
                f"{out_dir} holds a run (ckpt.pt): continue it with --resume=true, pick another out_dir, "
                "or replace it with --overwrite=true"
            )
        yield


class RunFiles(AbstractContextManager):
    """Where a run writes its files. A new run in a folder holding another run writes to out_dir/.replacing/
    until its first checkpoint, then moves its files in, the checkpoint last: stopped before, it leaves the
    old run as it was. Settings and checkpoint carry the run id, so a folder left mixed is refused."""

    def __init__(self, out_dir: Path, run_id: str, fresh: bool, enabled: bool = True) -> None:
        self.out_dir, self.run_id = out_dir, run_id
        self.staging = out_dir / ".replacing"
        replacing = fresh and enabled and any((out_dir / name).exists() for name in RUN_FILES)
        if enabled:  # what a run killed mid-write left: a replacement without its checkpoint, temporary files
            shutil.rmtree(self.staging, ignore_errors=True)
            for stale in [p for name in RUN_FILES for p in out_dir.glob(f"{name}.tmp-*")]:
                stale.unlink()
        if replacing:
            self.staging.mkdir()
        self.folder = self.staging if replacing else out_dir

    def path(self, name: str) -> Path:
        return self.folder / name

    def promote(self) -> None:
        """Once the first checkpoint is written: this run's files replace the old run's."""
        if self.folder == self.staging:
            for name in [n for n in ("config.json", "metrics.jsonl", "ckpt.pt") if (self.staging / n).exists()]:
                os.replace(self.staging / name, self.out_dir / name)  # the checkpoint last
            self.folder = self.out_dir
            shutil.rmtree(self.staging, ignore_errors=True)

    def __exit__(self, *exc) -> None:  # a run that ends before its first checkpoint: the old run stays
        if self.folder == self.staging:
            shutil.rmtree(self.staging, ignore_errors=True)


def read_metrics(path: Path) -> list[tuple[str, dict]]:
    """(line, record) of each line of a metrics.jsonl; a last line cut short by a kill is dropped."""
    lines = path.read_text().splitlines() if path.exists() else []
    out = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError
        except ValueError:
            if number == len(lines):
                print(f"warning: {path}: its last line was cut short; dropped it", file=sys.stderr)
                break
            raise ConfigError(
                f"{path}:{number} is not a metrics record: the log is damaged; move it away to resume with a new log"
            ) from None
        out.append((line, record))
    return out


class MetricsFile:
    """out_dir/metrics.jsonl, one record a line; a resumed run's log drops what was logged after its
    checkpoint. Process 0 writes it (elsewhere enabled=False), each record also to `mirror` if given."""

    def __init__(self, files: RunFiles, resume_step: int | None, enabled: bool = True, mirror=None) -> None:
        self.files, self.enabled, self.mirror = files, enabled, mirror
        if enabled:
            path = files.path("metrics.jsonl")
            kept = [] if resume_step is None else [line for line, r in read_metrics(path) if r["step"] <= resume_step]
            write_atomically(path, "".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        path, line = self.files.path("metrics.jsonl"), memoryview((json.dumps(record) + "\n").encode())
        try:
            with open(path, "ab", buffering=0) as file:  # each write straight to the OS, which can take part of it
                end = file.tell()
                try:
                    while line:
                        line = line[file.write(line) :]
                except OSError:  # a full disk took part of the line, or none: the log ends where it did
                    file.truncate(end)
                    raise
        except OSError as e:  # a full disk, a file-size limit: one line, as for a checkpoint
            raise SaveFailed(f"could not write {path} ({e.strerror or e})") from None
        if self.mirror is not None:
            self.mirror(record)
