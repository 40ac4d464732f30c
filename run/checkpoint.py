"""out_dir/ckpt.pt: model, optimizer, data position, every process's RNG, settings, tokenizer and the last
evaluation, so a run resumes exactly and its folder stands alone. The checkpoint is the one source of truth
for resuming: its settings, checked here once, are the run's (config.json is a record for people).

torch.save writes a zip whose every record carries a CRC-32; torch.load never checks them, so a byte changed
inside the weights loads without a word. Every read checks them first (zipfile's testzip)."""

from __future__ import annotations

import dataclasses
import json
import random
import shlex
import zipfile
from pathlib import Path

import numpy as np
import tiktoken
import torch
import torch.distributed as dist

from config import RESUMABLE, Config
from errors import ConfigError
from run.folder import replace_atomically
from shards import BOS_TEXT

KEYS = {"model", "optimizer", "config", "model_config", "step", "data", "rng", "tokenizer_sha256"}


def save_checkpoint(path: Path, state: dict, kept: str = "") -> None:
    """Atomically: a kill or a failure mid-save leaves the previous file intact; `kept` says what the run has left."""
    failed = "could not save the checkpoint {path} ({reason})" + (f"; {kept}" if kept else "")
    replace_atomically(path, lambda file: torch.save(state, file), failed)


def read_checkpoint(path: Path, mmap: bool = False) -> dict:
    """A checkpoint written by train.py whose every record matches its CRC-32, or one line saying why not.
    mmap=True: only its settings are wanted, the records are not read (nor checked)."""
    if path.exists() and not path.is_file():
        raise ConfigError(f"{path} is not a file, where the run's checkpoint belongs: move it away")
    if not path.is_file():
        raise ConfigError(
            f"{path} not found; train first with: {shlex.join(['python', 'train.py', f'--out_dir={path.parent}'])}"
        )
    try:
        if not mmap:
            with zipfile.ZipFile(path) as archive:
                damaged = archive.testzip()
            if damaged is not None:
                raise ConfigError(
                    f"{path} is damaged: its record {damaged} does not match the CRC-32 written with it (a changed "
                    "byte); it is not used"
                )
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except ConfigError:
        raise
    except Exception as e:  # a truncated or foreign file fails in many ways inside zipfile, torch and pickle
        raise ConfigError(f"{path} is not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(state, dict) or not KEYS <= state.keys():
        raise ConfigError(f"{path} is not a checkpoint written by train.py")
    state.pop("content_sha256", None)  # the digest checkpoints carried before the CRC-32 check replaced it
    return state


def check_resumable(path: Path, state: dict, cfg: Config, world_size: int) -> None:
    """The one check of a resumed run against its checkpoint: its settings, step, process count and folder."""
    defaults = Config()  # a setting added after the run started: it ran as the default does
    before = {f.name: state["config"].get(f.name, getattr(defaults, f.name)) for f in dataclasses.fields(Config)}
    changed = [k for k in before if k not in RESUMABLE and before[k] != getattr(cfg, k)]
    if changed:
        detail = ", ".join(f"{k}: {before[k]!r} -> {getattr(cfg, k)!r}" for k in changed)
        raise ConfigError(
            f"cannot resume {path.parent} with other settings ({detail}); when resuming only "
            f"{', '.join(sorted(RESUMABLE - {'resume', 'overwrite'}))} may change"
        )
    if state["step"] > cfg.max_iters:
        raise ConfigError(
            f"{path} is at step {state['step']}, past max_iters={cfg.max_iters}: raise max_iters to train further"
        )
    if len(state["rng"]) != world_size:
        raise ConfigError(f"{path} was written by {len(state['rng'])} process(es): resume with as many")
    try:  # the folder's settings and checkpoint are of one run: a replacement cut short leaves their ids apart
        settings_id = json.loads((path.parent / "config.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return  # a missing or damaged config.json: a record only
    if None not in (settings_id, state.get("run_id")) and settings_id != state["run_id"]:
        raise ConfigError(
            f"{path.parent} mixes two runs: its config.json belongs to another run than its ckpt.pt (a replacement was "
            "interrupted); move the folder away, or start afresh in it with --overwrite=true"
        )


def run_record(cfg: Config, run_id: str, shard_path: Path, meta: dict, enc: tiktoken.Encoding) -> dict:
    """What each checkpoint of a run carries besides its state: settings, tokenizer and shards, so that its
    folder stands alone (sample.py and export_hf.py need nothing else)."""
    bos = enc.encode_single_token(BOS_TEXT) if BOS_TEXT in enc.special_tokens_set else None
    file = (shard_path / "tokenizer.tiktoken").read_bytes()
    tokenizer = {"name": enc.name, "pattern": enc._pat_str, "file": file, "eot_id": enc.eot_token, "bos_id": bos}
    return {
        "run_id": run_id,
        "config": dataclasses.asdict(cfg),
        "tokenizer_sha256": meta["tokenizer_sha256"],
        "tokenizer": tokenizer,
        "shards": str(shard_path.resolve()),
    }


def every_process_rng_states() -> list[dict]:
    """Each process's RNG states, gathered: a collective under DDP."""
    if not dist.is_initialized():
        return [rng_states()]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_states())
    return states


def rng_states() -> dict:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
