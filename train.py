"""Train a GPT on packed documents.

    python train.py                                   # the CPU quickstart on the built-in corpus
    python train.py configs/gpt2_small_gpu.toml       # a config file
    python train.py --doc_mask=false --max_iters=100  # any field as --key=value, after the file

Every setting is a field of `Config` below, with its default and help text. The resolved config is
saved to out_dir/config.json; metrics go to out_dir/metrics.jsonl; the checkpoint to out_dir/ckpt.pt.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import random
import re
import signal
import sys
import textwrap
import time
import tomllib
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import data
from data import IGNORE_INDEX, Batch, DataError, PackedBatches, format_duration
from model import GPT, GPTConfig, attention_mask, use_flex

MAX_SEED = 2**63 - 1  # what torch, numpy and the data hash all take


def _f(default, help: str, choices: tuple | None = None, minimum: float | None = None, maximum: float | None = None):
    return field(default=default, metadata={"help": help, "choices": choices, "min": minimum, "max": maximum})


@dataclass
class Config:
    # data
    dataset: str = _f(
        "stdlib",
        "'stdlib' (top-level functions and classes of the Python standard library), "
        "'stdlib-files' (whole modules), a directory of text files (one document each), a .jsonl, .jsonl.gz or "
        ".jsonl.zst file (one document per line), a .parquet file (one per row), a glob or directory of such "
        "files, a text file of documents separated by <|endoftext|>, or a folder prepared by data.py",
    )
    text_field: str = _f("text", "the field (.jsonl) or column (.parquet) that holds each document's text")
    data_dir: str = _f("data", "where prepared shards are kept (one folder per corpus content and tokenizer)")
    tokenizer: str = _f(
        "bpe",
        "'bpe' (train one on the corpus with rustbpe), a tiktoken name such as 'gpt2' "
        "(downloads on first use), or a path to a .tiktoken file",
    )
    tokenizer_vocab_size: int = _f(
        8192, "vocabulary size of a trained 'bpe' tokenizer, EOT included", minimum=257, maximum=65536
    )
    tokenizer_train_mb: int = _f(
        100, "a 'bpe' tokenizer trains on a fixed sample of this many million characters of training text", minimum=1
    )
    val_fraction: float = _f(0.05, "fraction of documents held out for validation", minimum=0.0)
    packing: str = _f(
        "concat",
        "'concat': contiguous rows of the document stream; 'pad': one document (or chunk) per row, padded",
        choices=("concat", "pad"),
    )
    # the three fixes (README: "The three flags")
    doc_mask: bool = _f(True, "attend only within the document (block-diagonal causal); false: causal across documents")
    reset_position_ids: bool = _f(True, "restart position ids at 0 after each EOT; false: 0..seq_len-1 across the row")
    mask_boundary_loss: bool = _f(True, "ignore the target predicted from each EOT (the next document's first token)")
    # model
    pos_emb: str = _f("learned", "position encoding", choices=("learned", "rope"))
    seq_len: int = _f(256, "tokens per row (the context length)", minimum=2)
    n_layer: int = _f(4, "transformer blocks", minimum=1)
    n_head: int = _f(4, "attention heads", minimum=1)
    n_embd: int = _f(128, "model width", minimum=2)
    dropout: float = _f(0.0, "dropout on embeddings and residual branches (attention itself has none)", minimum=0.0)
    attn_impl: str = _f("auto", "'auto': FlexAttention on CUDA, SDPA elsewhere", choices=("auto", "flex", "sdpa"))
    # optimisation
    batch_size: int = _f(8, "rows per micro-batch", minimum=1)
    grad_accum: int = _f(1, "micro-batches per optimizer step", minimum=1)
    max_iters: int = _f(600, "optimizer steps", minimum=0)
    lr: float = _f(3e-3, "peak learning rate", minimum=0.0, maximum=10.0)
    min_lr: float = _f(3e-4, "learning rate at the end of the cosine decay", minimum=0.0, maximum=10.0)
    warmup_iters: int = _f(60, "linear warmup steps", minimum=0)
    weight_decay: float = _f(0.1, "AdamW weight decay on matrices (not on norms)", minimum=0.0, maximum=10.0)
    beta1: float = _f(0.9, "AdamW beta1", minimum=0.0)
    beta2: float = _f(0.99, "AdamW beta2", minimum=0.0)
    grad_clip: float = _f(1.0, "clip the gradient norm to this (0: off)", minimum=0.0)
    # evaluation, logging, checkpoints
    eval_interval: int = _f(300, "evaluate and checkpoint every this many steps (and at the end)", minimum=1)
    eval_tokens: int = _f(
        1_000_000,
        "validation tokens per evaluation: the whole documents at the start of the (shuffled) validation split "
        "that fit, the same for every run (0: all)",
        minimum=0,
    )
    log_interval: int = _f(20, "print and log training metrics every this many steps", minimum=1)
    sample_prompt: str = _f("def ", "prompt of the sample printed at the end ('' for none)")
    sample_tokens: int = _f(80, "tokens in that sample", minimum=0)
    out_dir: str = _f("out", "where config.json, metrics.jsonl and ckpt.pt are written")
    resume: bool = _f(False, "continue from out_dir/ckpt.pt")
    overwrite: bool = _f(False, "start afresh in an out_dir that holds a run, replacing it (without this: refused)")
    seed: int = _f(0, "seed of the model init and the data order", minimum=0, maximum=MAX_SEED)
    data_seed: int = _f(
        1337,
        "seed of the train/val split, the document order and the tokenizer sample (kept fixed across runs)",
        minimum=0,
        maximum=MAX_SEED,
    )
    device: str = _f("auto", "'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:N'")
    dtype: str = _f(
        "auto", "'auto' (bfloat16 autocast on CUDA, float32 elsewhere)", choices=("auto", "float32", "bfloat16")
    )
    compile: bool = _f(False, "torch.compile the model (CUDA)")
    wandb: bool = _f(False, "log to Weights & Biases (mode from WANDB_MODE, e.g. offline)")
    wandb_project: str = _f("packed-gpt", "wandb project")
    wandb_run_name: str = _f("", "wandb run name ('' for out_dir's name)")


# Keys that may change when resuming: they alter neither the model nor the data it sees.
RESUMABLE_CHANGES = {
    "max_iters",
    "eval_interval",
    "eval_tokens",
    "log_interval",
    "sample_prompt",
    "sample_tokens",
    "resume",
    "overwrite",
    "device",
    "compile",
    "wandb",
    "wandb_project",
    "wandb_run_name",
    "data_dir",
    "out_dir",
}


class ConfigError(Exception):
    """Bad settings; printed as one line."""


class TrainingDiverged(Exception):
    """The loss became non-finite; printed as one line."""


class SaveFailed(Exception):
    """A checkpoint could not be written (disk full, file size limit); printed as one line."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the other scripts, reporting a bad argument as one line `error: ...` like all bad input."""

    def __init__(self, **kwargs) -> None:
        super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


# ----------------------------------------------------------------------------------------------
# Configuration: defaults < TOML file < --key=value


def _coerce(name: str, value, kind: type):
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{name}={value!r}: expected {kind.__name__}")


def parse_config(argv: list[str]) -> Config:
    fields = {f.name: f for f in dataclasses.fields(Config)}
    types = {"bool": bool, "int": int, "float": float, "str": str}
    values: dict = {}
    if argv and not argv[0].startswith("--"):
        values.update(read_config_file(Path(argv[0])))
        argv = argv[1:]
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"bad argument {arg!r}: use --key=value (a config file may come first)")
        key, value = arg[2:].split("=", 1)
        values[key] = value
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}; run 'python train.py --help' for the keys")
    cfg = Config(**{k: _coerce(k, v, types[fields[k].type]) for k, v in values.items()})
    validate(cfg)
    return cfg


def read_config_file(path: Path) -> dict:
    """A TOML config file's values, or one line saying what is wrong with the file."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a folder, not a config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} does not parse: {e}") from None


def validate(cfg: Config) -> None:
    for f in dataclasses.fields(Config):
        value, choices = getattr(cfg, f.name), f.metadata["choices"]
        minimum, maximum = f.metadata["min"], f.metadata["max"]
        if choices and value not in choices:
            raise ConfigError(f"{f.name}={value!r}: choose one of {', '.join(choices)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name}={value}: must be a finite number")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{f.name}={value!r}: must be at least {minimum}")
        if maximum is not None and value > maximum:
            raise ConfigError(f"{f.name}={value!r}: must be at most {maximum}")
    for name in ("dataset", "data_dir", "out_dir", "text_field"):
        if not getattr(cfg, name).strip():
            raise ConfigError(f"{name} is empty: give a {'field name' if name == 'text_field' else 'path'}")
    resolve_device(cfg.device)  # a device this machine has
    if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
        raise ConfigError(f"n_embd={cfg.n_embd} must split into n_head={cfg.n_head} heads of even size")
    if not 0 < cfg.val_fraction < 1:
        raise ConfigError(f"val_fraction={cfg.val_fraction}: must be between 0 and 1")
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"min_lr={cfg.min_lr} is above lr={cfg.lr}")
    if not (cfg.dropout < 1 and cfg.beta1 < 1 and cfg.beta2 < 1):
        raise ConfigError("dropout, beta1 and beta2 must be below 1")


def help_text(keys: tuple[str, ...] | None = None, usage: str | None = None) -> str:
    lines = [(usage or __doc__).strip(), "", "settings (--key=default):"]
    for f in dataclasses.fields(Config):
        if keys is not None and f.name not in keys:
            continue
        default = str(f.default).lower() if isinstance(f.default, bool) else f.default
        choices = f"  [{' | '.join(f.metadata['choices'])}]" if f.metadata["choices"] else ""
        lines.append(f"  --{f.name}={default}{choices}")
        lines += textwrap.wrap(f.metadata["help"], width=100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def prepare_data(cfg: Config, log=print) -> Path:
    """The run's shards, prepared first if needed (the run's own folders are never read as corpus)."""
    settings = data.PrepareSettings(
        tokenizer=cfg.tokenizer,
        vocab_size=cfg.tokenizer_vocab_size,
        val_fraction=cfg.val_fraction,
        seed=cfg.data_seed,
        text_field=cfg.text_field,
        tokenizer_train_mb=cfg.tokenizer_train_mb,
    )
    return data.prepare(cfg.dataset, cfg.data_dir, settings, exclude=(Path(cfg.data_dir), Path(cfg.out_dir)), log=log)


# ----------------------------------------------------------------------------------------------
# Training pieces


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ConfigError(f"device={name!r}: use auto, cpu, cuda or cuda:N")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available here; use device=cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"device={name!r} but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


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


def model_settings(cfg: Config, vocab_size: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=math.ceil(vocab_size / 64) * 64,  # a multiple of 64 is faster on GPU
        seq_len=cfg.seq_len,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.n_embd,
        dropout=cfg.dropout,
        pos_emb=cfg.pos_emb,
        doc_mask=cfg.doc_mask,
        attn_impl=cfg.attn_impl,
    )


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup, then cosine decay from lr to min_lr at max_iters."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    progress = (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - cfg.min_lr)


def make_optimizer(model: GPT, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")


def token_losses(model: torch.nn.Module, batch: Batch, config: GPTConfig) -> torch.Tensor:
    """Each token's cross-entropy (B, T), 0 where the target is not counted. The one loss of this repo:
    training sums it, evaluation also reads it by position. The attention mask is built here, once per
    batch and outside the (compiled) model, from the batch's document ids."""
    mask = attention_mask(batch.doc_ids, config)
    return model(batch.inputs, batch.position_ids, mask, batch.targets)


def accumulate_gradients(
    model: torch.nn.Module, micro_batches: list[Batch], autocast, config: GPTConfig
) -> torch.Tensor:
    """Backward over all micro-batches of one step; returns the step's mean loss. The loss is normalised
    by the counted targets of the whole step (on every process), so every target weighs the same
    however they fall into micro-batches and processes."""
    n_counted = sum((b.targets != IGNORE_INDEX).sum() for b in micro_batches)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size > 1:
        dist.all_reduce(n_counted)
    n_counted = n_counted.clamp(min=1)
    total = torch.zeros((), device=micro_batches[0].inputs.device)
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # DDP averages gradients over processes at the last backward; the others skip that all-reduce
        with nullcontext() if last or world_size == 1 else model.no_sync():
            with autocast:
                loss = token_losses(model, batch, config).sum() / n_counted
            (loss * world_size).backward()  # undo DDP's average: the loss is already a global mean
        total += loss.detach()
    if world_size > 1:
        dist.all_reduce(total)
    return total


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    model_config: GPTConfig,
    val: data.TokenStream | np.ndarray,
    eot_id: int,
    cfg: Config,
    device: torch.device,
    autocast,
) -> dict:
    """On `val`, the fixed validation subset (whole documents):
    val_loss: packed rows under this run's packing and flags.
    val_doc_loss: every document alone from position 0 (the inference setting; the same computation for
    every run), with its loss by position within the document."""
    model.eval()
    common = dict(stream=val, eot_id=eot_id, seq_len=cfg.seq_len, batch_size=cfg.batch_size, shuffle=False)
    packed = PackedBatches(
        packing=cfg.packing,
        reset_position_ids=cfg.reset_position_ids,
        mask_boundary_loss=cfg.mask_boundary_loss,
        split="val",
        **common,
    )
    alone = PackedBatches(packing="pad", split="val", **common)
    total, count = torch.zeros((), device=device), torch.zeros((), device=device)
    for batch in packed.all_batches():
        batch = batch.to(device)
        with autocast:
            total += token_losses(model, batch, model_config).sum()
        count += (batch.targets != IGNORE_INDEX).sum()
    doc_total, doc_count = torch.zeros((), device=device), torch.zeros((), device=device)
    by_pos_sum = torch.zeros(cfg.seq_len, device=device)
    by_pos_count = torch.zeros(cfg.seq_len, device=device)
    for batch in alone.all_batches():
        batch = batch.to(device)
        with autocast:
            losses = token_losses(model, batch, model_config).flatten()
        counted = batch.targets.flatten() != IGNORE_INDEX
        doc_total, doc_count = doc_total + losses.sum(), doc_count + counted.sum()
        early = counted & (batch.doc_positions.flatten() < cfg.seq_len)  # later chunks of long documents
        positions = batch.doc_positions.flatten()[early]
        by_pos_sum.index_add_(0, positions, losses[early])
        by_pos_count.index_add_(0, positions, torch.ones_like(positions, dtype=torch.float))
    model.train()
    n_positions = int((by_pos_count > 0).sum())
    by_position = (by_pos_sum / by_pos_count.clamp(min=1))[:n_positions]
    return {
        "val_loss": (total / count.clamp(min=1)).item(),
        "val_doc_loss": (doc_total / doc_count.clamp(min=1)).item(),
        "val_doc_loss_by_position": [round(x, 4) for x in by_position.tolist()],
    }


# ----------------------------------------------------------------------------------------------
# Checkpoints and logs


def save_checkpoint(path: Path, state: dict) -> None:
    """Write to a temporary file and rename it over the old one, so a kill or a failure mid-save leaves
    the previous checkpoint intact."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch reports a failed write (disk full, size limit) as RuntimeError
        tmp.unlink(missing_ok=True)
        reason = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0]
        raise SaveFailed(f"could not save the checkpoint {path} ({reason}); the previous checkpoint is kept") from None


CHECKPOINT_KEYS = {"model", "optimizer", "config", "model_config", "step", "data", "rng", "tokenizer_sha256"}


def read_checkpoint(path: Path) -> dict:
    """A checkpoint written by train.py, or one line saying why the file is not one."""
    if not path.is_file():
        raise ConfigError(f"{path} not found; train first with: python train.py --out_dir={path.parent}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file fails in many ways inside torch and pickle
        raise ConfigError(f"{path} is not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
        raise ConfigError(f"{path} is not a checkpoint written by train.py")
    return state


def load_checkpoint(path: Path, cfg: Config) -> dict:
    """The checkpoint to resume from, checked against the settings of this run."""
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
    return state


def trained_model(state: dict, device: torch.device, attn_impl: str | None = None) -> GPT:
    """The model of a checkpoint, in eval mode; attn_impl overrides the attention it trained with."""
    config = GPTConfig(**state["model_config"])
    if attn_impl is not None:
        config.attn_impl = attn_impl
    model = GPT(config)
    model.load_state_dict(state["model"])
    return model.to(device).eval()


def checkpoint_tokenizer(state: dict):
    """The tokenizer a checkpoint was trained with, stored in it so a run folder stands alone."""
    if "tokenizer" not in state:  # written before checkpoints held their tokenizer
        if not (Path(state["shards"]) / "tokenizer.tiktoken").is_file():
            raise ConfigError(f"this checkpoint's tokenizer was beside its shards, {state['shards']}, which are gone")
        return data.load_tokenizer(Path(state["shards"]))
    tok = state["tokenizer"]
    return data.encoding_from_file_bytes(tok["file"], tok["pattern"], tok["name"])


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


class MetricsLog:
    """out_dir/metrics.jsonl, plus wandb when asked for."""

    def __init__(self, out_dir: Path, cfg: Config, resume_step: int | None, enabled: bool = True) -> None:
        self.path, self.enabled, self.wandb_run = out_dir / "metrics.jsonl", enabled, None
        if not enabled:  # processes other than 0 under DDP
            return
        if resume_step is None:
            self.path.write_text("")
        else:  # drop what was logged after the checkpoint, so the log reads as one run
            lines = self.path.read_text().splitlines() if self.path.exists() else []
            self.path.write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= resume_step))
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
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if not isinstance(v, list)}, step=record["step"])

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


class StopRequest:
    """Ctrl-C / SIGTERM: finish the step in flight, checkpoint, exit 0. A context manager, so the
    previous handlers come back when training returns."""

    def __init__(self) -> None:
        self.requested = False

    def __enter__(self) -> "StopRequest":
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint", flush=True)


# ----------------------------------------------------------------------------------------------
# The run


@contextmanager
def run_folder(cfg: Config):
    """Hold out_dir for the run's lifetime: refuse a folder that another run is using (a lock that the
    OS drops if that run dies) or that holds a finished run this one would replace."""
    out_dir = Path(cfg.out_dir)
    ckpt = out_dir / "ckpt.pt"
    if cfg.resume and not ckpt.is_file():
        raise ConfigError(f"resume=true but {ckpt} does not exist; start without --resume=true")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"out_dir {out_dir} is not writable ({e.strerror})") from None
    with ExitStack() as held:
        try:
            held.enter_context(data.exclusive_lock(out_dir / ".lock"))
        except BlockingIOError as e:
            raise ConfigError(
                f"{out_dir} is in use by another run (process {e.args[0]}); wait for it or pick another out_dir"
            ) from None
        if ckpt.exists() and not cfg.resume and not cfg.overwrite:
            raise ConfigError(
                f"{out_dir} holds a run (ckpt.pt): continue it with --resume=true, pick another out_dir, "
                "or replace it with --overwrite=true"
            )
        yield


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


def any_process(flag: bool, device: torch.device) -> bool:
    """True on every process if it is true on any (a collective: call it on all of them)."""
    flag_tensor = torch.tensor(float(flag), device=device)
    dist.all_reduce(flag_tensor, op=dist.ReduceOp.MAX)
    return bool(flag_tensor.item())


def train(cfg: Config) -> dict:
    """Run training as configured; returns the last evaluation (on process 0)."""
    rank, world_size, device = setup_distributed(cfg)
    try:
        with run_folder(cfg) if rank == 0 else nullcontext():  # only process 0 writes to out_dir
            return _train(cfg, rank, world_size, device)
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def _train(cfg: Config, rank: int, world_size: int, device: torch.device) -> dict:
    main_process = rank == 0  # the only one that prints, logs, evaluates and writes checkpoints
    say = print if main_process else (lambda *args, **kwargs: None)
    if device.type != "cuda" and cfg.attn_impl == "flex":
        raise ConfigError("attn_impl=flex needs CUDA: FlexAttention has no backward on CPU; use attn_impl=sdpa")
    out_dir = Path(cfg.out_dir)
    ckpt_path = out_dir / "ckpt.pt"
    checkpoint = load_checkpoint(ckpt_path, cfg) if cfg.resume else None
    if checkpoint is not None and len(checkpoint["rng"]) != world_size:
        raise ConfigError(f"{ckpt_path} was written by {len(checkpoint['rng'])} process(es): resume with as many")
    if cfg.packing == "pad" and not (cfg.doc_mask and cfg.reset_position_ids and cfg.mask_boundary_loss):
        say("warning: with packing=pad each row holds one document, so the three flags change nothing", file=sys.stderr)

    # a model that cannot fit is refused before the data is prepared (the vocabulary is a guess until then)
    check_fits(model_settings(cfg, cfg.tokenizer_vocab_size if cfg.tokenizer == "bpe" else 256), cfg.batch_size, device)
    if world_size > 1 and not main_process:
        dist.barrier()  # process 0 prepares the data first
    shard_path = prepare_data(cfg, log=say)
    if world_size > 1 and main_process:
        dist.barrier()
    shards = data.load_shards(shard_path)
    val = data.leading_documents(shards.val, shards.eot_id, cfg.eval_tokens)
    if checkpoint is not None and checkpoint["tokenizer_sha256"] != shards.meta["tokenizer_sha256"]:
        raise ConfigError(f"{ckpt_path} was trained with another tokenizer than the shards in {shard_path}")
    train_batches = PackedBatches(
        shards.train,
        shards.eot_id,
        cfg.seq_len,
        cfg.batch_size,
        cfg.packing,
        shuffle=True,
        seed=cfg.seed,
        reset_position_ids=cfg.reset_position_ids,
        mask_boundary_loss=cfg.mask_boundary_loss,
        rank=rank,
        world_size=world_size,
    )
    PackedBatches(val, shards.eot_id, cfg.seq_len, 1, cfg.packing, shuffle=False, split="val")  # fails early: no row

    torch.manual_seed(cfg.seed)
    model_config = model_settings(cfg, shards.vocab_size)
    check_fits(model_config, cfg.batch_size, device)
    model = GPT(model_config).to(device)
    if world_size > 1:
        torch.manual_seed(cfg.seed + rank)  # the same init everywhere, different dropout masks per process
    optimizer = make_optimizer(model, cfg, device)
    start_step = 0
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        train_batches.load_state_dict(checkpoint["data"])
        set_rng_states(checkpoint["rng"][rank])
        start_step = checkpoint["step"]
    compiled_model = torch.compile(model) if cfg.compile else model
    step_model = compiled_model
    if world_size > 1:
        ddp_devices = [device.index] if device.type == "cuda" else None
        step_model = DistributedDataParallel(compiled_model, device_ids=ddp_devices, broadcast_buffers=False)
    use_bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()

    if main_process:
        (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    log = MetricsLog(out_dir, cfg, start_step if checkpoint else None, enabled=main_process)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * world_size
    say(
        f"model: {model.num_params() / 1e6:.2f}M parameters, pos_emb={cfg.pos_emb}, device={device}, "
        f"attention={'flex' if model_config.doc_mask and use_flex(model_config, device) else 'sdpa'}"
        + (f", {world_size} processes" if world_size > 1 else "")
    )
    say(
        f"run: {cfg.max_iters} steps of {tokens_per_step:,} tokens, packing={cfg.packing}, doc_mask={cfg.doc_mask}, "
        f"reset_position_ids={cfg.reset_position_ids}, mask_boundary_loss={cfg.mask_boundary_loss}"
        + (f", resuming after step {start_step}" if checkpoint else "")
    )
    n_val_docs = len(data.eot_positions(val, shards.eot_id))
    say(f"eval: {len(val):,} validation tokens ({n_val_docs:,} documents) per evaluation")

    enc = data.load_tokenizer(shard_path)
    tokenizer = {"name": enc.name, "pattern": enc._pat_str, "file": (shard_path / "tokenizer.tiktoken").read_bytes()}

    def save(step: int) -> None:
        """A collective under DDP (every process's RNG state goes into the checkpoint)."""
        rng = [rng_states()]
        if world_size > 1:
            rng = [None] * world_size
            dist.all_gather_object(rng, rng_states())
        if not main_process:
            return
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "config": dataclasses.asdict(cfg),
            "model_config": dataclasses.asdict(model_config),
            "step": step,
            "data": train_batches.state_dict(),
            "rng": rng,
            "tokenizer_sha256": shards.meta["tokenizer_sha256"],
            "tokenizer": tokenizer,
            "shards": str(shard_path.resolve()),
        }
        save_checkpoint(ckpt_path, state)

    result: dict = {}
    t_log, counted_since_log = time.time(), torch.zeros((), device=device)
    nonfinite = torch.zeros((), dtype=torch.bool, device=device)  # checked at log steps: no per-step sync
    t_start, step_at_log = time.time(), start_step
    with StopRequest() as stop, log:
        for step in range(start_step + 1, cfg.max_iters + 1):
            lr = lr_at(step - 1, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micro_batches = [train_batches.next().to(device) for _ in range(cfg.grad_accum)]
            loss = accumulate_gradients(step_model, micro_batches, autocast, model_config)
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            nonfinite |= ~torch.isfinite(loss)
            counted_since_log += sum((b.targets != IGNORE_INDEX).sum() for b in micro_batches)

            last = step == cfg.max_iters
            # Under DDP the processes agree on stopping at log steps, so none is left waiting for the others.
            if world_size == 1:
                stopping = stop.requested
            else:
                stopping = step % cfg.log_interval == 0 and any_process(stop.requested, device)
            should_log = step % cfg.log_interval == 0 or last or stopping
            should_eval = step % cfg.eval_interval == 0 or last
            if (should_log or should_eval) and nonfinite.item():  # before anything is logged or saved
                raise TrainingDiverged(
                    f"training loss became non-finite by step {step} (last value {loss.item()}); "
                    f"the last good checkpoint is kept in {ckpt_path}"
                )
            if should_log:
                now = time.time()
                tok_s = (step - step_at_log) * tokens_per_step / (now - t_log)
                eta = (now - t_start) / (step - start_step) * (cfg.max_iters - step)
                record = {
                    "step": step,
                    "train_loss": round(loss.item(), 4),
                    "lr": lr,
                    "tokens_per_sec": round(tok_s),
                    "counted_tokens_per_sec": round(counted_since_log.item() * world_size / (now - t_log)),
                }
                log.write(record)
                say(
                    f"step {step:>5}/{cfg.max_iters} | loss {record['train_loss']:.4f} | lr {lr:.2e} | "
                    f"{tok_s:,.0f} tok/s | ETA {format_duration(eta)}",
                    flush=True,
                )
                t_log, step_at_log, counted_since_log = time.time(), step, torch.zeros((), device=device)
            if should_eval:
                t_eval = time.time()
                if main_process:  # the unwrapped model: a DDP forward on one process alone would hang
                    metrics = evaluate(compiled_model, model_config, val, shards.eot_id, cfg, device, autocast)
                    result = {"step": step, **metrics}
                    if not (math.isfinite(result["val_loss"]) and math.isfinite(result["val_doc_loss"])):
                        raise TrainingDiverged(
                            f"validation loss is non-finite at step {step}; "
                            f"the last good checkpoint is kept in {ckpt_path}"
                        )
                    log.write(result)
                save(step)
                if main_process:
                    print(
                        f"eval {step:>5} | val_loss {result['val_loss']:.4f} | "
                        f"val_doc_loss {result['val_doc_loss']:.4f} | {time.time() - t_eval:.1f}s, checkpoint saved",
                        flush=True,
                    )
                t_log += time.time() - t_eval  # evaluation time does not count against training throughput
            if stopping and not last:
                save(step)
                say(f"stopped after step {step}; resume with: python train.py {' '.join(sys.argv[1:])} --resume=true")
                return result

    if main_process and cfg.sample_prompt and cfg.sample_tokens and result:
        prompt = torch.tensor([enc.encode_ordinary(cfg.sample_prompt)], device=device)
        with autocast:
            out = model.eval().generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=50, stop_token=shards.eot_id)
        text = enc.decode([t for t in out[0].tolist() if t < enc.n_vocab and t != shards.eot_id])
        say(f"\nfinal val_doc_loss {result['val_doc_loss']:.4f} (val_loss {result['val_loss']:.4f})")
        say(f"sample:\n{text}")
    return result


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    try:
        train(parse_config(argv))
    except (ConfigError, DataError, TrainingDiverged, SaveFailed) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
