"""The run folder: everything around the recipe in train.py that makes a run safe to stop, resume and
share. The folder's lock, atomic writes, checkpoints (with every process's RNG state and the tokenizer, so
a run folder stands alone), loading a trained model back, the metrics log, stop signals, and the helpers
for several processes (torchrun). Preparation (prepare.py) uses its lock and writable-folder check too.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np
import tiktoken
import torch
import torch.distributed as dist

import data
from config import RESUMABLE_CHANGES, RUN_FILES, Config, ConfigError, Interrupted, check_run_files, resolve_device
from model import GPT, GPTConfig


class SaveFailed(Exception):
    """A checkpoint could not be written (disk full, file size limit); printed as one line."""


# ----------------------------------------------------------------------------------------------
# Folders that survive interrupts


@contextmanager
def exclusive_lock(path: Path, on_busy: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `path` for the with-block; the OS drops it if the process dies. If another
    process holds it: call on_busy(its pid) and wait, or without on_busy raise BlockingIOError(its pid)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(fd)
            if on_busy is None:
                raise BlockingIOError(holder) from None
            on_busy(holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def lock_holder(fd: int) -> str:
    """The process that holds the lock on this open file: from the kernel's table of locks where there is
    one (/proc/locks, Linux), else the pid that the holder wrote into the file."""
    stat = os.fstat(fd)
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "->" not in fields and "FLOCK" in fields and device in fields:  # "->" marks a waiting process
                return fields[fields.index(device) - 1]
    except OSError:
        pass
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"


def check_writable_folder(folder: Path, what: str) -> None:
    """Make `folder` if needed and check that a file can be written in it (ConfigError otherwise)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{what} {folder} is not a writable folder ({e.strerror})") from None


def write_atomically(path: Path, text: str) -> None:
    """Write a results file through a temporary file renamed over it: an interrupt or a full disk leaves the
    previous version (or none), never half a file; a failure is one line (SaveFailed)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SaveFailed(f"could not write {path} ({e.strerror or e})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_figure(figure, path: Path) -> None:
    """A matplotlib figure written as write_atomically writes text: the previous file or none, never half of
    one; a failure is one line (SaveFailed)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        figure.savefig(tmp, format=path.suffix.lstrip("."), dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SaveFailed(f"could not write {path} ({e.strerror or e})") from None


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


# ----------------------------------------------------------------------------------------------
# The run folder and the machine


@contextmanager
def hold(cfg: Config):
    """Hold out_dir for the run's lifetime: refuse a folder that another run is using (a lock that the
    OS drops if that run dies) or that holds a finished run this one would replace. Nothing of the folder
    changes here: a new run replaces an old one only once it has its first checkpoint (RunFiles)."""
    out_dir = Path(cfg.out_dir)
    ckpt = out_dir / "ckpt.pt"
    check_run_files(out_dir)
    if cfg.resume and not ckpt.is_file():
        raise ConfigError(f"resume=true but {ckpt} does not exist; start without --resume=true")
    check_writable_folder(out_dir, "out_dir")
    with ExitStack() as held:
        try:
            held.enter_context(exclusive_lock(out_dir / ".lock"))
        except BlockingIOError as e:
            raise ConfigError(
                f"{out_dir} is in use by another run (process {e.args[0]}); wait for it or pick another out_dir"
            ) from None
        except OSError as e:
            raise ConfigError(
                f"{out_dir / '.lock'} cannot serve as the run's lock ({e.strerror}): remove it (no run holds it)"
            ) from None
        if ckpt.exists() and not cfg.resume and not cfg.overwrite:
            raise ConfigError(
                f"{out_dir} holds a run (ckpt.pt): continue it with --resume=true, pick another out_dir, "
                "or replace it with --overwrite=true"
            )
        yield


class RunFiles:
    """Where a run writes its settings, metrics log and checkpoint. A new run in a folder that holds another
    run's files writes its own to out_dir/.replacing/ until its first checkpoint is complete, then moves them
    in, the checkpoint last: a run that is refused, fails or is stopped before then leaves the old run as it
    was. The settings and the checkpoint carry the run's id, so a folder that a kill between those moves left
    mixed is refused (check_one_run)."""

    def __init__(self, out_dir: Path, run_id: str, fresh: bool, enabled: bool = True) -> None:
        self.out_dir, self.run_id = out_dir, run_id
        self.staging = out_dir / ".replacing"
        replacing = fresh and enabled and any((out_dir / name).exists() for name in RUN_FILES)
        if enabled:
            shutil.rmtree(self.staging, ignore_errors=True)  # a replacement that never got its checkpoint
        if replacing:
            self.staging.mkdir()
        self.folder = self.staging if replacing else out_dir

    def path(self, name: str) -> Path:
        return self.folder / name

    def __enter__(self) -> "RunFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.discard()

    def promote(self) -> None:
        """Once the first checkpoint is written: this run's files replace the old run's."""
        if self.folder == self.staging:
            for name in ("config.json", "metrics.jsonl", "ckpt.pt"):
                if (self.staging / name).exists():
                    os.replace(self.staging / name, self.out_dir / name)
            self.folder = self.out_dir
            shutil.rmtree(self.staging, ignore_errors=True)

    def discard(self) -> None:
        """A run that ends before its first checkpoint: what it staged goes, the old run stays."""
        if self.folder == self.staging:
            shutil.rmtree(self.staging, ignore_errors=True)


def check_one_run(out_dir: Path, checkpoint: dict) -> None:
    """The settings and checkpoint of out_dir are of one run (their run ids agree), or one line. RunFiles
    moves the settings in before the log and the checkpoint: a move cut short leaves them disagreeing."""
    try:
        settings_id = json.loads((out_dir / "config.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return  # a missing or damaged config.json: the checkpoint's settings are used
    if None not in (settings_id, checkpoint.get("run_id")) and settings_id != checkpoint["run_id"]:
        raise ConfigError(
            f"{out_dir} mixes two runs: its config.json belongs to another run than its ckpt.pt (a replacement was "
            "interrupted); move the folder away, or start afresh in it with --overwrite=true"
        )


def check_fits(config: GPTConfig, batch_size: int, device: torch.device) -> None:
    """Refuse a model that cannot fit: weights, gradients and AdamW state (16 bytes a parameter in fp32)
    plus one fp32 copy of the logits are a lower bound on what training needs."""
    d, T = config.n_embd, config.seq_len
    params = config.vocab_size * d + config.n_layer * (12 * d * d + 4 * d) + 2 * d
    params += T * d if config.pos_emb == "learned" else 0
    need = 16 * params + 4 * batch_size * T * config.vocab_size
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ConfigError(
            f"the model ({params / 1e6:,.1f}M parameters, {batch_size} x {T} tokens a micro-batch) needs about "
            f"{need / 1e9:,.1f} GB to train on {device.type}, and this machine has {have / 1e9:,.1f} GB"
        )


def setup_distributed(cfg: Config) -> tuple[int, int, torch.device]:
    """(rank, world_size, device). Under torchrun (WORLD_SIZE > 1) joins the process group: NCCL on GPU,
    gloo on CPU, one GPU per process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(cfg.device)
    if world_size == 1:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world_size, device


def agree(error: Exception | None) -> None:
    """Raise on every process the error that any process had (None: there was none). A collective under
    torchrun, so that an error on one process before a barrier stops them all with the same one line
    instead of leaving the others waiting."""
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else (type(error).__name__, str(error)))
    kinds = {"ConfigError": ConfigError, "DataError": data.DataError}
    for found in errors:
        if found is not None:
            raise kinds.get(found[0], ConfigError)(found[1])


def any_process(flag: bool, device: torch.device) -> bool:
    """True on every process if it is true on any (a collective: call it on all of them)."""
    flag_tensor = torch.tensor(float(flag), device=device)
    dist.all_reduce(flag_tensor, op=dist.ReduceOp.MAX)
    return bool(flag_tensor.item())


# ----------------------------------------------------------------------------------------------
# Checkpoints


def content_digest(value, digest=None) -> str:
    """sha256 of a checkpoint's content, in the order it is stored: every tensor's and array's dtype, shape
    and bytes, every other value's repr. Written into the checkpoint and checked on every read, so bytes
    changed inside the weights (which torch.load does not notice) refuse the file instead of being used."""
    top = digest is None
    digest = hashlib.sha256() if top else digest
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"tensor {flat.dtype} {tuple(value.shape)}".encode())
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    elif isinstance(value, np.ndarray):
        digest.update(f"array {value.dtype} {value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        digest.update(f"dict {len(value)}".encode())
        for key, item in value.items():
            digest.update(repr(key).encode())
            content_digest(item, digest)
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__} {len(value)}".encode())
        for item in value:
            content_digest(item, digest)
    elif isinstance(value, bytes):
        digest.update(f"bytes {len(value)}".encode() + value)
    else:
        digest.update(repr(value).encode())
    return digest.hexdigest() if top else ""


def save_checkpoint(path: Path, state: dict) -> None:
    """Write to a temporary file and rename it over the old one, so a kill or a failure mid-save leaves
    the previous checkpoint intact. The state's content digest goes in with it."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save({**state, "content_sha256": content_digest(state)}, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch reports a failed write (disk full, size limit) as RuntimeError
        tmp.unlink(missing_ok=True)
        reason = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0]
        raise SaveFailed(f"could not save the checkpoint {path} ({reason}); the previous checkpoint is kept") from None
    except BaseException:  # a second Ctrl-C while saving: the previous checkpoint stays, nothing half-written
        tmp.unlink(missing_ok=True)
        raise


CHECKPOINT_KEYS = {"model", "optimizer", "config", "model_config", "step", "data", "rng", "tokenizer_sha256"}


def read_checkpoint(path: Path) -> dict:
    """A checkpoint written by train.py whose content matches its digest, or one line saying why the file
    is not one. Every reader goes through here: resume, sampling, export and the studies."""
    if path.exists() and not path.is_file():
        raise ConfigError(f"{path} is not a file, where the run's checkpoint belongs: move it away")
    if not path.is_file():
        raise ConfigError(f"{path} not found; train first with: python train.py --out_dir={path.parent}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file fails in many ways inside torch and pickle
        raise ConfigError(f"{path} is not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
        raise ConfigError(f"{path} is not a checkpoint written by train.py")
    written = state.pop("content_sha256", None)
    if written is None:
        print(
            f"warning: {path} was written before checkpoints carried a digest: its content is not verified",
            file=sys.stderr,
        )
    elif written != content_digest(state):
        raise ConfigError(
            f"{path} is damaged: its content does not match the digest written with it (a changed byte); it is not used"
        )
    return state


def load_checkpoint(path: Path, cfg: Config, world_size: int) -> dict:
    """The checkpoint to resume from, checked against the settings of this run and its process count."""
    state = read_checkpoint(path)
    saved = state["config"]
    changed = sorted(k for k, v in dataclasses.asdict(cfg).items() if k not in RESUMABLE_CHANGES and saved.get(k) != v)
    if changed:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {getattr(cfg, k)!r}" for k in changed)
        raise ConfigError(f"cannot resume {path} with a different model or data setting ({detail})")
    if state["step"] > cfg.max_iters:
        raise ConfigError(
            f"{path} is at step {state['step']}, past max_iters={cfg.max_iters}: raise max_iters to train further"
        )
    if len(state["rng"]) != world_size:
        raise ConfigError(f"{path} was written by {len(state['rng'])} process(es): resume with as many")
    return state


class Checkpointer:
    """Writes out_dir/ckpt.pt: the model, the optimizer, the data position and every process's RNG state,
    with the settings, the tokenizer and the last evaluation, so the run resumes exactly and its folder
    stands alone (an export reads its loss from the same file as its weights)."""

    def __init__(
        self,
        files: RunFiles,
        cfg: Config,
        model_config: GPTConfig,
        shard_path: Path,
        shards: data.Shards,
        enc: tiktoken.Encoding,
    ) -> None:
        self.files = files
        self.kept = ""  # where this run's last checkpoint is, once it wrote one
        self.fixed = {
            "run_id": files.run_id,
            "config": dataclasses.asdict(cfg),
            "model_config": dataclasses.asdict(model_config),
            "tokenizer_sha256": shards.meta["tokenizer_sha256"],
            "tokenizer": {
                "name": enc.name,
                "pattern": enc._pat_str,
                "file": (shard_path / "tokenizer.tiktoken").read_bytes(),
                "eot_id": enc.eot_token,
                "bos_id": enc.encode_single_token(data.BOS_TEXT) if data.BOS_TEXT in enc.special_tokens_set else None,
            },
            "shards": str(shard_path.resolve()),
        }

    def save(
        self,
        step: int,
        model: GPT,
        optimizer: torch.optim.Optimizer,
        batches: data.PackedBatches,
        evaluation: dict | None = None,
    ) -> None:
        """A collective under DDP: every process calls it, process 0 writes. `evaluation`: the last one, at or
        before this step (its figures, not its per-position lists)."""
        rng = [rng_states()]
        if dist.is_initialized():
            rng = [None] * dist.get_world_size()
            dist.all_gather_object(rng, rng_states())
            if dist.get_rank() != 0:
                return
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "data": batches.state_dict(),
            "rng": rng,
            "evaluation": {k: v for k, v in (evaluation or {}).items() if not isinstance(v, list)},
            **self.fixed,
        }
        save_checkpoint(self.files.path("ckpt.pt"), state)
        self.files.promote()
        self.kept = f"the checkpoint of step {step} is kept in {self.files.path('ckpt.pt')}"


def checkpoint_shards(path: Path, state: dict) -> Path:
    """The shard folder a checkpoint trained on, if it is still there: a resumed run trains on it or not at all
    (preparing again could give other shards after the corpus changed)."""
    folder = Path(state["shards"])
    try:
        data.load_shards(folder)
    except data.DataError as e:
        raise ConfigError(
            f"{path} trained on the shards in {folder}, which cannot be read now ({e}); a resumed run trains on "
            "the data it started on: restore that folder, or start a new run"
        ) from None
    return folder


def rng_states() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def trained_model(state: dict, device: torch.device, attn_impl: str | None = None) -> GPT:
    """The model of a checkpoint, in eval mode; attn_impl overrides the attention it trained with."""
    known = {f.name for f in dataclasses.fields(GPTConfig)}  # checkpoints of earlier versions held doc_mask here
    config = GPTConfig(**{k: v for k, v in state["model_config"].items() if k in known})
    if attn_impl is not None:
        config.attn_impl = attn_impl
    model = GPT(config)
    model.load_state_dict(state["model"])
    return model.to(device).eval()


def checkpoint_tokenizer(state: dict) -> tiktoken.Encoding:
    """The tokenizer a checkpoint was trained with, stored in it so a run folder stands alone."""
    tok = state["tokenizer"]
    where = "the checkpoint's tokenizer"
    enc = data.read_tiktoken(tok["file"], tok["pattern"], tok["name"], where, tok.get("eot_id"))
    return data.with_start_marker(enc, tok.get("bos_id"))


class TrainedRun(NamedTuple):
    model: GPT
    tokenizer: tiktoken.Encoding
    checkpoint: dict


def load_run(out_dir: Path, device: torch.device, attn_impl: str | None = None) -> TrainedRun:
    """The trained model of a run folder (in eval mode), its tokenizer and its checkpoint; attn_impl
    overrides the attention the model trained with."""
    state = read_checkpoint(Path(out_dir) / "ckpt.pt")
    return TrainedRun(trained_model(state, device, attn_impl), checkpoint_tokenizer(state), state)


# ----------------------------------------------------------------------------------------------
# The metrics log and stop signals


def read_metrics(path: Path) -> list[tuple[str, dict]]:
    """(line, record) of each line of a metrics.jsonl. A last line cut short (a kill while it was written)
    is dropped with a warning; damage anywhere else is one line."""
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


class MetricsLog:
    """out_dir/metrics.jsonl, plus wandb when asked for, and the progress lines: each training record
    carries the throughput since the previous one (evaluations excluded) and the ETA. Its clock starts
    when the `with` block is entered, at the first step."""

    def __init__(
        self, files: RunFiles, cfg: Config, resume_step: int | None, world_size: int = 1, enabled: bool = True
    ) -> None:
        self.files, self.enabled, self.wandb_run = files, enabled, None
        out_dir = files.out_dir
        self.first_step, self.max_iters, self.world_size = resume_step or 0, cfg.max_iters, world_size
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * world_size
        self.counted_since_log: torch.Tensor | int = 0  # on the device until a log step: no per-step sync
        if not enabled:  # processes other than 0 under DDP
            return
        if resume_step is None:
            write_atomically(self.files.path("metrics.jsonl"), "")
        else:  # drop what was logged after the checkpoint, so the log reads as one run
            path = self.files.path("metrics.jsonl")
            kept = [line for line, record in read_metrics(path) if record["step"] <= resume_step]
            write_atomically(path, "".join(line + "\n" for line in kept))
        if cfg.wandb:
            try:
                import wandb

                self.wandb_run = wandb.init(
                    project=cfg.wandb_project,
                    name=cfg.wandb_run_name or out_dir.name,
                    config=dataclasses.asdict(cfg),
                    resume="allow",
                    dir=os.environ.get("WANDB_DIR", str(out_dir)),
                )
            except Exception as e:
                print(
                    f"warning: wandb logging is off ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                    "set WANDB_MODE=offline to log without an account",
                    file=sys.stderr,
                )

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        path = self.files.path("metrics.jsonl")
        try:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk, a file-size limit: one line, as for a checkpoint
            raise SaveFailed(f"could not write {path} ({e.strerror or e})") from None
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if not isinstance(v, list)}, step=record["step"])

    def count(self, batches: list[data.Batch]) -> None:
        """Add a step's counted targets, for the rate of useful tokens."""
        self.counted_since_log = self.counted_since_log + sum(b.counted.sum() for b in batches)

    def training(self, step: int, loss: torch.Tensor, lr: float) -> None:
        """Write and print the training record of this step."""
        if not self.enabled:
            return
        now = time.time()
        tok_s = (step - self.step_at_log) * self.tokens_per_step / (now - self.t_log)
        eta = (now - self.t_start) / (step - self.first_step) * (self.max_iters - step)
        record = {
            "step": step,
            "train_loss": round(loss.item(), 4),
            "lr": lr,
            "tokens_per_sec": round(tok_s),
            "counted_tokens_per_sec": round(float(self.counted_since_log) * self.world_size / (now - self.t_log)),
        }
        self.write(record)
        print(
            f"step {step:>5}/{self.max_iters} | loss {record['train_loss']:.4f} | lr {lr:.2e} | "
            f"{tok_s:,.0f} tok/s | ETA {format_duration(eta)}",
            flush=True,
        )
        self.t_log, self.step_at_log, self.counted_since_log = time.time(), step, 0

    def evaluated(self, result: dict, seconds: float) -> None:
        """Print the evaluation (written already, before its checkpoint); its time does not count against
        training throughput."""
        if self.enabled:
            print(
                f"eval {result['step']:>5} | val_loss {result['val_loss']:.4f} | "
                f"val_doc_loss {result['val_doc_loss']:.4f} | {seconds:.1f}s, checkpoint saved",
                flush=True,
            )
        self.t_log += seconds

    def __enter__(self) -> "MetricsLog":
        self.t_start = self.t_log = time.time()
        self.step_at_log = self.first_step
        return self

    def __exit__(self, *exc) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


class StopRequest:
    """Ctrl-C, SIGTERM or SIGHUP: finish the step in flight, checkpoint, exit 0; a second one stops at once.
    A context manager, so the previous handlers come back when training returns."""

    def __init__(self) -> None:
        self.requested = False

    def __enter__(self) -> "StopRequest":
        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        self._previous = {s: signal.signal(s, self._handle) for s in signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second one stops at once
            raise Interrupted(signum)
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint", flush=True)

    def agreed(self, step: int, every: int, device: torch.device) -> bool:
        """Stop after this step? Under DDP the processes agree every `every` steps (a collective, on all
        of them), so none is left waiting for the others."""
        if not dist.is_initialized():
            return self.requested
        return step % every == 0 and any_process(self.requested, device)
