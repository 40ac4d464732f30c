"""The settings of a run: every key of train.py is a field of `Config`, with its default, help text and
bounds. Values come from the defaults, then a TOML file, then --key=value arguments, in that order.

    cfg = parse_config(["configs/quickstart.toml", "--doc_mask=false"])
    cfg.flags  # the three fixes of packing, as one Flags value for the batches and the model
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
import sys
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data import Flags

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

    @property
    def flags(self) -> Flags:
        return Flags(
            doc_mask=self.doc_mask,
            reset_position_ids=self.reset_position_ids,
            mask_boundary_loss=self.mask_boundary_loss,
        )


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
    """A checked Config from [CONFIG.toml] [--key=value ...]."""
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
    """Each value within its field's bounds, and the settings consistent with each other."""
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
    if resolve_device(cfg.device).type != "cuda" and cfg.attn_impl == "flex":  # resolve: a device this machine has
        raise ConfigError("attn_impl=flex needs CUDA: FlexAttention has no backward on CPU; use attn_impl=sdpa")
    if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
        raise ConfigError(f"n_embd={cfg.n_embd} must split into n_head={cfg.n_head} heads of even size")
    if not 0 < cfg.val_fraction < 1:
        raise ConfigError(f"val_fraction={cfg.val_fraction}: must be between 0 and 1")
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"min_lr={cfg.min_lr} is above lr={cfg.lr}")
    if not (cfg.dropout < 1 and cfg.beta1 < 1 and cfg.beta2 < 1):
        raise ConfigError("dropout, beta1 and beta2 must be below 1")


def help_text(usage: str, keys: tuple[str, ...] | None = None) -> str:
    """`usage`, then every setting (or those in `keys`) with its default, choices and help."""
    lines = [usage.strip(), "", "settings (--key=default):"]
    for f in dataclasses.fields(Config):
        if keys is not None and f.name not in keys:
            continue
        default = str(f.default).lower() if isinstance(f.default, bool) else f.default
        choices = f"  [{' | '.join(f.metadata['choices'])}]" if f.metadata["choices"] else ""
        lines.append(f"  --{f.name}={default}{choices}")
        lines += textwrap.wrap(f.metadata["help"], width=100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def resolve_device(name: str) -> torch.device:
    """The device a `device` setting names, if this machine has it."""
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
