"""The settings table: every key of train.py is a field of `Config`, with its default, help, bounds and role,
declared once (cli.py reads them from a TOML file and --key=value arguments). Every other script's settings are
a dataclass of such fields. Also here: how the data settings are named in a prepared folder, both ways."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data import Flags
from errors import ConfigError

MAX_SEED = 2**63 - 1  # what torch, numpy and the data hash all take


def setting(
    default, help: str, choices: tuple | None = None, minimum: float | None = None, maximum: float | None = None,
    path: bool = False, decides: str | None = "result", resumable: bool = False,
):  # fmt: skip
    """A field with its help and bounds (a list's apply to each item); `path`: ~ is the home folder. Its role:
    what it `decides` ("model", prepared "data", else "result"; None: no number of a run) and whether a
    resumed run may change it."""
    metadata = dict(
        help=help, choices=choices, min=minimum, max=maximum, path=path, decides=decides, resumable=resumable
    )
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Config:
    # data
    dataset: str = setting(
        "stdlib",
        "'stdlib' (top-level definitions of the Python standard library), 'stdlib-files' (whole modules), "
        "'packages' and 'packages-files' (the same for the packages requirements.txt pins), 'packages-docs' (their "
        "docstrings: English prose); a directory of text "
        "files, a .jsonl(.gz|.zst) or .parquet file, or a glob or directory of them (one document per file, line "
        "or row); a text file of documents separated by <|endoftext|>; or a folder prepared by prepare.py",
        path=True,
        decides="data",
    )
    text_field: str = setting("text", "the .jsonl field or .parquet column of the text", decides="data")
    data_dir: str = setting("data", "where prepared shards are kept", path=True, decides=None, resumable=True)
    tokenizer: str = setting(
        "bpe",
        "'bpe' (trained on the corpus), a tiktoken name such as 'gpt2' (downloaded once), or a .tiktoken file",
        path=True,
        decides="data",
    )
    tokenizer_vocab_size: int = setting(
        8192, "vocabulary of a 'bpe' tokenizer, EOT included", minimum=257, maximum=65536, decides="data"
    )
    tokenizer_train_mb: int = setting(
        100, "a 'bpe' tokenizer trains on this many million characters", minimum=1, decides="data"
    )
    val_fraction: float = setting(0.05, "fraction of documents held out for validation", minimum=0.0, decides="data")
    packing: str = setting(
        "concat",
        "'concat': windows of the document stream; 'bestfit': whole documents best-fit into rows, long ones in "
        "row-sized chunks; 'pad': one document (or chunk) a row",
        choices=("concat", "bestfit", "pad"),
    )
    bos: bool = setting(
        False, "begin each document with a start marker (BOS) of its own; false: it starts after the previous EOT"
    )
    # the three fixes (README: "Why packing needs care")
    doc_mask: bool = setting(True, "attend only within the document; false: causal across documents")
    reset_position_ids: bool = setting(True, "positions restart at 0 in each document; false: 0..seq_len-1")
    mask_boundary_loss: bool = setting(True, "ignore the target predicted from each EOT")
    # model
    pos_emb: str = setting("learned", "position encoding", choices=("learned", "rope"), decides="model")
    seq_len: int = setting(256, "tokens per row (the context length)", minimum=2, maximum=2**20, decides="model")
    n_layer: int = setting(4, "transformer blocks", minimum=1, maximum=1024, decides="model")
    n_head: int = setting(4, "attention heads", minimum=1, maximum=1024, decides="model")
    n_embd: int = setting(128, "model width", minimum=2, maximum=2**16, decides="model")
    dropout: float = setting(0.0, "dropout on embeddings and residual branches", minimum=0.0, decides="model")
    bias: bool = setting(False, "biases in the attention and MLP layers, as GPT-2 has", decides="model")
    gelu: str = setting(
        "exact", "the MLP's GELU: 'exact', or 'tanh' (GPT-2's own)", choices=("exact", "tanh"), decides="model"
    )
    init_from: str = setting(
        "",
        "start from the weights of a Hugging Face folder (config.json, model.safetensors, tokenizer.json): OpenAI's "
        "gpt2 or export_hf.py's export of a run; it decides the model's shape, and the run starts at step 0 with "
        "a fresh optimizer ('': from a random init)",
        path=True,
    )
    attn_impl: str = setting(
        "auto", "'auto': FlexAttention on CUDA, SDPA elsewhere", choices=("auto", "flex", "sdpa"), decides="model"
    )
    # optimisation
    batch_size: int = setting(8, "rows per micro-batch", minimum=1, maximum=2**16)
    grad_accum: int = setting(1, "micro-batches per optimizer step", minimum=1, maximum=2**16)
    max_iters: int = setting(
        600, "optimizer steps, the end of the cosine (re-timed on resume)", minimum=0, resumable=True
    )
    lr: float = setting(3e-3, "peak learning rate", minimum=0.0, maximum=10.0)
    min_lr: float = setting(3e-4, "learning rate at the end of the cosine decay", minimum=0.0, maximum=10.0)
    warmup_iters: int = setting(
        -1, "linear warmup steps (-1: a tenth of max_iters, fixed when the run starts)", minimum=-1, resumable=True
    )
    weight_decay: float = setting(0.1, "AdamW weight decay on matrices", minimum=0.0, maximum=10.0)
    beta1: float = setting(0.9, "AdamW beta1", minimum=0.0)
    beta2: float = setting(0.99, "AdamW beta2", minimum=0.0)
    grad_clip: float = setting(1.0, "clip the gradient norm to this (0: off)", minimum=0.0)
    # evaluation, logging, checkpoints
    eval_interval: int = setting(300, "evaluate and checkpoint every this many steps", minimum=1, resumable=True)
    eval_tokens: int = setting(
        -1,
        "validation tokens per evaluation, whole documents from the split's start (0: all; -1: a quarter of "
        "the tokens trained between evaluations, within 32,768 and 1,000,000)",
        minimum=-1,
        resumable=True,
    )
    log_interval: int = setting(20, "log every this many steps", minimum=1, decides=None, resumable=True)
    sample_prompt: str = setting("def ", "prompt of the final sample ('': none)", decides=None, resumable=True)
    sample_tokens: int = setting(80, "tokens in that sample", minimum=0, decides=None, resumable=True)
    out_dir: str = setting("out", "the run's folder", path=True, decides=None, resumable=True)
    resume: bool = setting(False, "continue from out_dir/ckpt.pt", decides=None, resumable=True)
    overwrite: bool = setting(False, "replace a run in out_dir", decides=None, resumable=True)
    seed: int = setting(0, "seed of the model init and the data order", minimum=0, maximum=MAX_SEED)
    data_seed: int = setting(
        1337, "seed of the split, document order and tokenizer sample", minimum=0, maximum=MAX_SEED, decides="data"
    )
    device: str = setting("auto", "'auto' (cuda if available), 'cpu', 'cuda', 'cuda:N'", resumable=True)
    dtype: str = setting("auto", "'auto': bfloat16 on CUDA", choices=("auto", "float32", "bfloat16"))
    compile: bool = setting(False, "torch.compile the model (on CUDA, and on the CPU for the studies)", resumable=True)
    wandb: bool = setting(
        False, "log to Weights & Biases (WANDB_MODE=offline: no account)", decides=None, resumable=True
    )
    wandb_project: str = setting("packed-gpt", "wandb project", decides=None, resumable=True)
    wandb_run_name: str = setting("", "wandb run name ('': out_dir's name)", decides=None, resumable=True)

    @property
    def flags(self) -> Flags:
        return Flags(self.doc_mask, self.reset_position_ids, self.mask_boundary_loss)


def setting_problem(key: str, value) -> str | None:
    """What is wrong with `value` as setting `key` when a file gives it as it is (a folder's meta.json or
    config.json, nothing converted from text): its type, or its bounds; None when nothing is."""
    f = Config.__dataclass_fields__[key]
    kinds = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}[f.type]
    if not isinstance(value, kinds) or (isinstance(value, bool) and f.type != "bool"):
        return f"is not {'text' if f.type == 'str' else 'a whole number' if f.type == 'int' else f'a {f.type}'}"
    choices, minimum, maximum = (f.metadata[k] for k in ("choices", "min", "max"))
    if choices and value not in choices:
        return f"is not one of {', '.join(choices)}"
    if isinstance(value, float) and not math.isfinite(value):
        return "is not a finite number"
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        return f"is outside [{minimum}, {maximum}]" if maximum is not None else f"is below {minimum}"
    return None


def fields_where(**role) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Config) if all(f.metadata[k] == v for k, v in role.items()))


RESUMABLE = set(fields_where(resumable=True))  # they change neither the model's shape nor the data
NOT_DECIDING = set(fields_where(decides=None))  # they cannot change a run's numbers
DATA_SETTINGS = fields_where(decides="data")  # what a preparation depends on


def warmup_steps(cfg: Config) -> int:
    """warmup_iters, or by default (-1) a tenth of max_iters: a longer run warms up longer, since a
    short warmup at a high learning rate split small learned-position runs into fast and slow ones
    (results/LOG.md, 2026-12-02). The quickstart's 600 steps get 60."""
    return cfg.warmup_iters if cfg.warmup_iters >= 0 else cfg.max_iters // 10


def eval_token_budget(cfg: Config, world_size: int = 1) -> int:
    """eval_tokens, with -1 made to suit the run: a quarter of the tokens trained between two evaluations,
    within [32,768, 1,000,000]."""
    if cfg.eval_tokens >= 0:
        return cfg.eval_tokens
    between = cfg.batch_size * cfg.grad_accum * cfg.seq_len * world_size * min(cfg.eval_interval, cfg.max_iters)
    return min(1_000_000, max(32_768, between // 4))


def validate(cfg: Config) -> None:
    """The settings consistent with each other (each value's own bounds: check_bounds)."""
    if not cfg.text_field.strip():  # an empty path is refused with its value (cli.settings_from)
        raise ConfigError("text_field is empty: give a field name")
    if resolve_device(cfg.device).type != "cuda" and cfg.attn_impl == "flex":
        raise ConfigError("attn_impl=flex needs CUDA: FlexAttention has no backward on CPU; use attn_impl=sdpa")
    if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
        raise ConfigError(f"n_embd={cfg.n_embd} must split into n_head={cfg.n_head} heads of even size")
    if not 0 < cfg.val_fraction < 1:
        raise ConfigError(f"val_fraction={cfg.val_fraction}: must be between 0 and 1")
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"min_lr={cfg.min_lr} is above lr={cfg.lr}")
    if not (cfg.dropout < 1 and cfg.beta1 < 1 and cfg.beta2 < 1):
        raise ConfigError("dropout, beta1 and beta2 must be below 1")
    if cfg.init_from and Path(cfg.init_from).resolve() == Path(cfg.out_dir).resolve():
        raise ConfigError(
            f"init_from and out_dir are the same folder ({cfg.out_dir}): the run's config.json would replace the "
            "folder's; give another out_dir"
        )


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


# ----------------------------------------------------------------------------------------------
# The data settings by their names in a prepared folder's meta.json ("settings"): prepare.py writes them
# (prepared_settings), and a run given the folder reads them back (resolve.with_prepared_settings)

SETTINGS_IN_META = {"val_fraction": "val_fraction", "data_seed": "seed", "text_field": "text_field"}
BPE_SETTINGS_IN_META = {"tokenizer_vocab_size": "vocab_size", "tokenizer_train_mb": "tokenizer_train_mb"}


def prepared_settings(cfg: Config) -> dict:
    """The settings that decide a preparation's content, by their names in meta.json (hashed, in this order,
    into the folder's name): a .tiktoken file is known by its content's SHA-256."""
    made = {name: getattr(cfg, key) for key, name in SETTINGS_IN_META.items()}
    if cfg.tokenizer == "bpe":
        made.update(tokenizer="bpe", **{name: getattr(cfg, key) for key, name in BPE_SETTINGS_IN_META.items()})
    elif cfg.tokenizer.endswith(".tiktoken") and Path(cfg.tokenizer).is_file():
        made.update(tokenizer=hashlib.sha256(Path(cfg.tokenizer).read_bytes()).hexdigest())
    else:
        made.update(tokenizer=cfg.tokenizer)
    return made
