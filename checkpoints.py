"""out_dir/ckpt.pt: model, optimizer, data position, every process's RNG, settings, tokenizer and the last
evaluation, so a run resumes exactly and its folder stands alone. A digest of the content is checked on
every read: bytes changed inside the weights, which torch.load does not notice, refuse the file."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
from pathlib import Path

import numpy as np
import tiktoken
import torch
import torch.distributed as dist

from config import Config, changed_on_resume
from data import DataError
from files import ConfigError, RunFiles, replace_atomically, shell_command
from model import GPT, GPTConfig
from shards import BOS_TEXT, load_shards

KEYS = {"model", "optimizer", "config", "model_config", "step", "data", "rng", "tokenizer_sha256"}


def content_digest(value, digest=None) -> str:
    """sha256 of a checkpoint's content as stored: each tensor's and array's dtype, shape and bytes, else repr."""
    top = digest is None
    digest = hashlib.sha256() if top else digest
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"tensor {flat.dtype} {tuple(value.shape)}".encode())
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    elif isinstance(value, np.ndarray):
        digest.update(f"array {value.dtype} {value.shape}".encode() + np.ascontiguousarray(value).tobytes())
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
    """Atomically: a kill or a failure mid-save leaves the previous checkpoint intact."""
    content = {**state, "content_sha256": content_digest(state)}
    failed = "could not save the checkpoint {path} ({reason}); the previous checkpoint is kept"
    replace_atomically(path, lambda tmp: torch.save(content, tmp), failed)


def read_checkpoint(path: Path) -> dict:
    """A checkpoint written by train.py whose content matches its digest, or one line saying why not."""
    if path.exists() and not path.is_file():
        raise ConfigError(f"{path} is not a file, where the run's checkpoint belongs: move it away")
    if not path.is_file():
        raise ConfigError(
            f"{path} not found; train first with: {shell_command('python', 'train.py', f'--out_dir={path.parent}')}"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file fails in many ways inside torch and pickle
        raise ConfigError(f"{path} is not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(state, dict) or not KEYS <= state.keys():
        raise ConfigError(f"{path} is not a checkpoint written by train.py")
    written = state.pop("content_sha256", None)
    if written is None:
        print(f"warning: {path} was written before checkpoints carried a digest: it is not verified", file=sys.stderr)
    elif written != content_digest(state):
        raise ConfigError(
            f"{path} is damaged: its content does not match the digest written with it (a changed byte); it is not used"
        )
    return state


def load_checkpoint(path: Path, cfg: Config, world_size: int) -> dict:
    """The checkpoint to resume from, checked against this run's settings, process count and folder."""
    state = read_checkpoint(path)
    saved = state["config"]
    if detail := changed_on_resume(saved, cfg, sorted(dataclasses.asdict(cfg))):
        raise ConfigError(f"cannot resume {path} with a different model or data setting ({detail})")
    if state["step"] > cfg.max_iters:
        raise ConfigError(
            f"{path} is at step {state['step']}, past max_iters={cfg.max_iters}: raise max_iters to train further"
        )
    if len(state["rng"]) != world_size:
        raise ConfigError(f"{path} was written by {len(state['rng'])} process(es): resume with as many")
    check_one_run(path.parent, state)
    return state


def check_one_run(out_dir: Path, state: dict) -> None:
    """The folder's settings and checkpoint are of one run: a replacement cut short leaves their ids apart."""
    try:
        settings_id = json.loads((out_dir / "config.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return  # a missing or damaged config.json: the checkpoint's settings are used
    if None not in (settings_id, state.get("run_id")) and settings_id != state["run_id"]:
        raise ConfigError(
            f"{out_dir} mixes two runs: its config.json belongs to another run than its ckpt.pt (a replacement was "
            "interrupted); move the folder away, or start afresh in it with --overwrite=true"
        )


def checkpoint_shards(path: Path, state: dict) -> Path:
    """The shard folder a checkpoint trained on: a resumed run trains on it or not at all."""
    folder = Path(state["shards"])
    try:
        load_shards(folder)
    except DataError as e:
        raise ConfigError(
            f"{path} trained on the shards in {folder}, which cannot be read now ({e}); a resumed run trains on "
            "the data it started on: restore that folder, or start a new run"
        ) from None
    return folder


class Checkpointer:
    """Writes the run's checkpoint; the first one moves the run's files in (RunFiles.promote)."""

    def __init__(
        self,
        files: RunFiles,
        cfg: Config,
        model_config: GPTConfig,
        shard_path: Path,
        meta: dict,
        enc: tiktoken.Encoding,
    ) -> None:
        self.files = files
        self.kept = ""  # where this run's last checkpoint is, once it wrote one
        bos = enc.encode_single_token(BOS_TEXT) if BOS_TEXT in enc.special_tokens_set else None
        self.fixed = {
            "run_id": files.run_id,
            "config": dataclasses.asdict(cfg),
            "model_config": dataclasses.asdict(model_config),
            "tokenizer_sha256": meta["tokenizer_sha256"],
            "tokenizer": {
                "name": enc.name,
                "pattern": enc._pat_str,
                "file": (shard_path / "tokenizer.tiktoken").read_bytes(),
                "eot_id": enc.eot_token,
                "bos_id": bos,
            },
            "shards": str(shard_path.resolve()),
        }

    def save(self, step: int, model: GPT, optimizer, batches, evaluation: dict | None = None) -> None:
        """A collective under DDP: every process calls it, process 0 writes. `evaluation`: the last one."""
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
