"""The settings of a run: every key of train.py is a field of `Config`, with its default, help text,
bounds and role (what it decides; whether a resumed run may change it). Values come from the defaults, then
a TOML file, then --key=value arguments, in that order. Every other script's settings are a dataclass of
such fields, parsed the same way (script_settings).

    cfg = parse_config(["configs/quickstart.toml", "--doc_mask=false"])
    cfg.flags  # the three fixes of packing, as one Flags value for the batches and the model
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import signal
import sys
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data import Flags
from files import ConfigError, check_run_files

MAX_SEED = 2**63 - 1  # what torch, numpy and the data hash all take


def setting(
    default,
    help: str,
    choices: tuple | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    path: bool = False,
    decides: str | None = "result",
    resumable: bool = False,
):
    """A dataclass field with its help text and bounds (a list's bounds and choices apply to each item);
    `path`: a leading ~ is the home folder, wherever the value comes from. Its role, declared once here:
    what it `decides` (the "model", the prepared "data", else the "result"; None: nothing a run's numbers
    depend on) and whether a resumed run may change it."""
    metadata = {"help": help, "choices": choices, "min": minimum, "max": maximum, "path": path}
    metadata |= {"decides": decides, "resumable": resumable}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Config:
    # data
    dataset: str = setting(
        "stdlib",
        "'stdlib' (top-level functions and classes of the Python standard library), "
        "'stdlib-files' (whole modules), 'packages' (top-level definitions of the installed packages that "
        "requirements.txt pins, and what they require), 'packages-files' (the same modules whole), a directory "
        "of text files (one document each), a .jsonl, .jsonl.gz or .jsonl.zst file (one document per line), a "
        ".parquet file (one per row), a glob or directory of such files, a text file of documents separated by "
        "<|endoftext|>, or a folder prepared by prepare.py",
        path=True,
        decides="data",
    )
    text_field: str = setting(
        "text", "the field (.jsonl) or column (.parquet) that holds each document's text", decides="data"
    )
    data_dir: str = setting(
        "data",
        "where prepared shards are kept (one folder per corpus content and tokenizer)",
        path=True,
        decides=None,
        resumable=True,
    )
    tokenizer: str = setting(
        "bpe",
        "'bpe' (train one on the corpus with rustbpe), a tiktoken name such as 'gpt2' "
        "(downloads on first use), or a path to a .tiktoken file",
        path=True,
        decides="data",
    )
    tokenizer_vocab_size: int = setting(
        8192, "vocabulary size of a trained 'bpe' tokenizer, EOT included", minimum=257, maximum=65536, decides="data"
    )
    tokenizer_train_mb: int = setting(
        100,
        "a 'bpe' tokenizer trains on a fixed sample of this many million characters of training text",
        minimum=1,
        decides="data",
    )
    val_fraction: float = setting(0.05, "fraction of documents held out for validation", minimum=0.0, decides="data")
    packing: str = setting(
        "concat",
        "'concat': contiguous rows of the document stream (documents cut at row edges); 'bestfit': whole "
        "documents best-fit-decreasing into rows, longer ones in row-sized chunks, the rest padded; 'pad': one "
        "document (or chunk) per row, padded",
        choices=("concat", "bestfit", "pad"),
    )
    bos: bool = setting(
        False,
        "begin every document with a start marker (BOS, one id past the tokenizer's) that belongs to it, so its "
        "first token is predicted from the BOS in training, evaluation, sampling and the export alike; false: a "
        "document starts right after the previous one's EOT",
    )
    # the three fixes (README: "The three flags")
    doc_mask: bool = setting(
        True, "attend only within the document (block-diagonal causal); false: causal across documents"
    )
    reset_position_ids: bool = setting(
        True, "restart position ids at 0 after each EOT; false: 0..seq_len-1 across the row"
    )
    mask_boundary_loss: bool = setting(
        True, "ignore the target predicted from each EOT (the next document's first token)"
    )
    # model
    pos_emb: str = setting("learned", "position encoding", choices=("learned", "rope"), decides="model")
    seq_len: int = setting(256, "tokens per row (the context length)", minimum=2, decides="model")
    n_layer: int = setting(4, "transformer blocks", minimum=1, decides="model")
    n_head: int = setting(4, "attention heads", minimum=1, decides="model")
    n_embd: int = setting(128, "model width", minimum=2, decides="model")
    dropout: float = setting(
        0.0, "dropout on embeddings and residual branches (attention itself has none)", minimum=0.0, decides="model"
    )
    attn_impl: str = setting(
        "auto", "'auto': FlexAttention on CUDA, SDPA elsewhere", choices=("auto", "flex", "sdpa"), decides="model"
    )
    # optimisation
    batch_size: int = setting(8, "rows per micro-batch", minimum=1)
    grad_accum: int = setting(1, "micro-batches per optimizer step", minimum=1)
    max_iters: int = setting(600, "optimizer steps", minimum=0, resumable=True)
    lr: float = setting(3e-3, "peak learning rate", minimum=0.0, maximum=10.0)
    min_lr: float = setting(3e-4, "learning rate at the end of the cosine decay", minimum=0.0, maximum=10.0)
    warmup_iters: int = setting(60, "linear warmup steps", minimum=0)
    weight_decay: float = setting(0.1, "AdamW weight decay on matrices (not on norms)", minimum=0.0, maximum=10.0)
    beta1: float = setting(0.9, "AdamW beta1", minimum=0.0)
    beta2: float = setting(0.99, "AdamW beta2", minimum=0.0)
    grad_clip: float = setting(1.0, "clip the gradient norm to this (0: off)", minimum=0.0)
    # evaluation, logging, checkpoints
    eval_interval: int = setting(
        300, "evaluate and checkpoint every this many steps (and at the end)", minimum=1, resumable=True
    )
    eval_tokens: int = setting(
        -1,
        "validation tokens per evaluation: the whole documents at the start of the (shuffled) validation split "
        "that fit, the same for every run of these settings (0: all; -1: a quarter of the tokens trained between "
        "two evaluations, at least 32,768 and at most 1,000,000)",
        minimum=-1,
        resumable=True,
    )
    log_interval: int = setting(
        20, "print and log training metrics every this many steps", minimum=1, decides=None, resumable=True
    )
    sample_prompt: str = setting(
        "def ", "prompt of the sample printed at the end ('' for none)", decides=None, resumable=True
    )
    sample_tokens: int = setting(80, "tokens in that sample", minimum=0, decides=None, resumable=True)
    out_dir: str = setting(
        "out", "where config.json, metrics.jsonl and ckpt.pt are written", path=True, decides=None, resumable=True
    )
    resume: bool = setting(False, "continue from out_dir/ckpt.pt", decides=None, resumable=True)
    overwrite: bool = setting(
        False,
        "start afresh in an out_dir that holds a run, replacing it (without this: refused)",
        decides=None,
        resumable=True,
    )
    seed: int = setting(0, "seed of the model init and the data order", minimum=0, maximum=MAX_SEED)
    data_seed: int = setting(
        1337,
        "seed of the train/val split, the document order and the tokenizer sample (kept fixed across runs)",
        minimum=0,
        maximum=MAX_SEED,
        decides="data",
    )
    device: str = setting("auto", "'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:N'", resumable=True)
    dtype: str = setting(
        "auto", "'auto' (bfloat16 autocast on CUDA, float32 elsewhere)", choices=("auto", "float32", "bfloat16")
    )
    compile: bool = setting(False, "torch.compile the model (CUDA)", resumable=True)
    wandb: bool = setting(
        False, "log to Weights & Biases (mode from WANDB_MODE, e.g. offline)", decides=None, resumable=True
    )
    wandb_project: str = setting("packed-gpt", "wandb project", decides=None, resumable=True)
    wandb_run_name: str = setting("", "wandb run name ('' for out_dir's name)", decides=None, resumable=True)

    @property
    def flags(self) -> Flags:
        return Flags(
            doc_mask=self.doc_mask,
            reset_position_ids=self.reset_position_ids,
            mask_boundary_loss=self.mask_boundary_loss,
        )


def fields_where(**role) -> tuple[str, ...]:
    """The names of Config's fields with this role, e.g. fields_where(resumable=True)."""
    return tuple(f.name for f in dataclasses.fields(Config) if all(f.metadata[k] == v for k, v in role.items()))


RESUMABLE = set(fields_where(resumable=True))  # they change neither the model's shape nor the data
NOT_DECIDING = set(fields_where(decides=None))  # they cannot change a run's numbers
DATA_SETTINGS = fields_where(decides="data")  # what a preparation depends on


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C raises KeyboardInterrupt, so that every way of stopping a
    script runs the same clean-up (temporary folders removed, nothing half-written kept)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupted_exit_code(error: KeyboardInterrupt) -> int:
    """128 + the signal's number, as for a process the signal stopped: 130 for Ctrl-C, 143 for SIGTERM."""
    return 128 + getattr(error, "signum", signal.SIGINT)


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(signum)


def run_main(main) -> None:
    """Every script's entry point: exits with main's code. Ctrl-C, SIGTERM or SIGHUP that reaches here (a
    second one during training, or any during the other scripts) is one line and exit 128 + its number: what
    the scripts write is atomic, so nothing half-written is left. Output into a pipe that closes early
    (| head) ends quietly."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_interrupted)
    try:
        code = main(sys.argv[1:])
        sys.stdout.flush()
    except KeyboardInterrupt as e:
        print("\ninterrupted: stopped at once; nothing half-written was kept", file=sys.stderr)
        code = interrupted_exit_code(e)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail too
        code = 141  # 128 + SIGPIPE, as for a program that the closed pipe stopped
    sys.exit(code)


# ----------------------------------------------------------------------------------------------
# Configuration: defaults < TOML file < --key=value


def _coerce(name: str, value, kind: str):
    """A value of a setting of type `kind` ("bool", "int", "float", "str", "list[...]", "dict[str, int]"),
    from TOML or from the command line's text; lists and tables on the command line are comma-separated
    (--probe_offsets=64,128, --seeds_by_variant=reference=8,pad=4)."""
    if kind.startswith("list["):
        item = kind[5:-1]
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list):
            return [_coerce(name, v, item) for v in value]
        raise ConfigError(f"{name}={value!r}: expected a list of {item}")
    if kind.startswith("dict[str, "):
        item = kind[10:-1]
        if isinstance(value, str):
            pairs = [v.split("=", 1) for v in value.split(",") if v.strip()]
            if not all(len(pair) == 2 for pair in pairs):
                raise ConfigError(f"{name}={value!r}: expected name=value pairs separated by commas")
            value = {k.strip(): v for k, v in pairs}
        if isinstance(value, dict):
            return {str(k): _coerce(f"{name}.{k}", v, item) for k, v in value.items()}
        raise ConfigError(f"{name}={value!r}: expected a table of name = {item}")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind == "str" and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{name}={value!r}: expected {kind}")


def script_settings(cls: type, argv: list[str], usage: str, command: str):
    """Another script's settings: --key=value arguments for the fields of dataclass `cls`, checked like
    Config's. --help prints them; a bad argument is one line `error: ...` and exit 2."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(usage, cls=cls))
        sys.exit(0)
    try:
        return settings_from(cls, command_line_values(argv), f"{command} --help")
    except ConfigError as e:
        named = any(str(e).startswith(f"{f.name}=") for f in dataclasses.fields(cls))
        print(f"error: {'--' if named else ''}{e}", file=sys.stderr)  # as it was typed: --key=value
        sys.exit(2)


def settings_from(cls: type, values: dict, help_command: str):
    """An instance of the settings dataclass `cls` from raw values (TOML or command-line text), each of its
    field's type and within its bounds; an unknown key is refused with the closest valid one."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}; run '{help_command}' for the keys")
    coerced = {k: _coerce(k, v, fields[k].type) for k, v in values.items()}
    for key, value in coerced.items():
        if fields[key].metadata["path"]:
            coerced[key] = os.path.expanduser(value)
    settings = cls(**coerced)
    check_bounds(settings)
    return settings


def command_line_values(argv: list[str], hint: str = "") -> dict:
    """{key: text} from --key=value arguments."""
    values = {}
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"bad argument {arg!r}: use --key=value{hint}")
        key, value = arg[2:].split("=", 1)
        values[key] = value
    return values


def parse_config(argv: list[str]) -> Config:
    """A checked Config from [CONFIG.toml] [--key=value ...]. With resume=true the run's saved settings
    (out_dir/config.json) come first, and the given ones may change only what RESUMABLE allows."""
    values: dict = {}
    if argv and not argv[0].startswith("--"):
        values.update(read_config_file(Path(os.path.expanduser(argv[0]))))
        argv = argv[1:]
    values.update(command_line_values(argv, " (a config file may come first)"))
    given = settings_from(Config, values, "python train.py --help")
    if given.resume:
        values = {**saved_settings(given, values), **values}
    cfg = settings_from(Config, values, "python train.py --help")
    validate(cfg)
    return cfg


def saved_settings(given: Config, values: dict) -> dict:
    """The settings a run was started with, from its out_dir/config.json ({} when there is none), after
    checking that `values` change only what may change when resuming."""
    out_dir = Path(given.out_dir)
    check_run_files(out_dir)
    path = out_dir / "config.json"
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict):
            raise ValueError("not a table of settings")
    except FileNotFoundError:
        return {}  # no run there: files.hold says so
    except (OSError, ValueError) as e:
        if not (out_dir / "ckpt.pt").is_file():
            raise ConfigError(f"{path} cannot be read ({e}) and there is no checkpoint to resume from") from None
        try:  # the checkpoint holds the settings too (its content is verified when the run loads it)
            saved = torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=False)["config"]
        except Exception as error:  # a damaged checkpoint fails in many ways inside torch and pickle
            raise ConfigError(f"{path} cannot be read ({e}), nor can the settings in ckpt.pt ({error})") from None
        print(f"warning: {path} cannot be read ({e}); resuming with the settings in ckpt.pt", file=sys.stderr)
    fields = {f.name for f in dataclasses.fields(Config)}
    # the folder is where the run is now (it may have moved), and resuming is not overwriting
    saved = {k: v for k, v in saved.items() if k in fields and k not in ("resume", "overwrite", "out_dir")}
    changed = [k for k in values if k not in RESUMABLE and k in saved and getattr(given, k) != saved[k]]
    if changed:
        detail = ", ".join(f"{k}: {saved[k]!r} -> {getattr(given, k)!r}" for k in changed)
        raise ConfigError(
            f"cannot resume {given.out_dir} with other settings ({detail}); when resuming only "
            f"{', '.join(sorted(RESUMABLE - {'resume', 'overwrite'}))} may change"
        )
    return saved


def read_config_file(path: Path) -> dict:
    """A TOML config file's values, or one line saying what is wrong with the file."""
    hint = f" (to train on a corpus, give it as --dataset={path})"
    if path.is_dir():
        raise ConfigError(f"{path} is a folder, not a config file{hint}")
    if path.suffix != ".toml" and path.exists():  # a corpus there could even read as an empty config
        raise ConfigError(f"{path} is not a .toml config file{hint}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} does not parse: {e}") from None


def check_bounds(settings) -> None:
    """Each value of a settings dataclass within its field's choices and bounds (each item of a list)."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        for item in value if isinstance(value, list) else [value]:
            choices, minimum, maximum = f.metadata["choices"], f.metadata["min"], f.metadata["max"]
            if choices and item not in choices:
                raise ConfigError(f"{f.name}={item!r}: choose one of {', '.join(choices)}")
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(f"{f.name}={item}: must be a finite number")
            if minimum is not None and item < minimum:
                raise ConfigError(f"{f.name}={item!r}: must be at least {minimum}")
            if maximum is not None and item > maximum:
                raise ConfigError(f"{f.name}={item!r}: must be at most {maximum}")


def validate(cfg: Config) -> None:
    """The settings consistent with each other (each value's own bounds: check_bounds)."""
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


def help_text(usage: str, keys: tuple[str, ...] | None = None, cls: type = Config) -> str:
    """`usage`, then every setting of `cls` (or those in `keys`) with its default, choices and help."""
    lines = [usage.strip(), "", "settings (--key=default):"]
    for f in dataclasses.fields(cls):
        if keys is not None and f.name not in keys:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, bool):
            default = str(default).lower()
        elif isinstance(default, list):
            default = ",".join(map(str, default))
        elif isinstance(default, dict):
            default = ",".join(f"{k}={v}" for k, v in default.items())
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
