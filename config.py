"""The settings of a run: every key of train.py is a field of `Config`, with its default, help, bounds and
role, declared once. Values come from the defaults, then a TOML file, then --key=value arguments. Every other
script's settings are a dataclass of such fields, parsed the same way (script_settings)."""

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


@dataclass
class Config:
    # data
    dataset: str = setting(
        "stdlib",
        "'stdlib' (top-level definitions of the Python standard library), 'stdlib-files' (whole modules), "
        "'packages' and 'packages-files' (the same for the packages requirements.txt pins); a directory of text "
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
    seq_len: int = setting(256, "tokens per row (the context length)", minimum=2, decides="model")
    n_layer: int = setting(4, "transformer blocks", minimum=1, decides="model")
    n_head: int = setting(4, "attention heads", minimum=1, decides="model")
    n_embd: int = setting(128, "model width", minimum=2, decides="model")
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
    batch_size: int = setting(8, "rows per micro-batch", minimum=1)
    grad_accum: int = setting(1, "micro-batches per optimizer step", minimum=1)
    max_iters: int = setting(
        600, "optimizer steps, the end of the cosine (re-timed on resume)", minimum=0, resumable=True
    )
    lr: float = setting(3e-3, "peak learning rate", minimum=0.0, maximum=10.0)
    min_lr: float = setting(3e-4, "learning rate at the end of the cosine decay", minimum=0.0, maximum=10.0)
    warmup_iters: int = setting(-1, "linear warmup steps (-1: a tenth of max_iters)", minimum=-1)
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
    compile: bool = setting(False, "torch.compile the model (CUDA)", resumable=True)
    wandb: bool = setting(
        False, "log to Weights & Biases (WANDB_MODE=offline: no account)", decides=None, resumable=True
    )
    wandb_project: str = setting("packed-gpt", "wandb project", decides=None, resumable=True)
    wandb_run_name: str = setting("", "wandb run name ('': out_dir's name)", decides=None, resumable=True)

    @property
    def flags(self) -> Flags:
        return Flags(self.doc_mask, self.reset_position_ids, self.mask_boundary_loss)


def fields_where(**role) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Config) if all(f.metadata[k] == v for k, v in role.items()))


RESUMABLE = set(fields_where(resumable=True))  # they change neither the model's shape nor the data
NOT_DECIDING = set(fields_where(decides=None))  # they cannot change a run's numbers
DATA_SETTINGS = fields_where(decides="data")  # what a preparation depends on


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised as Ctrl-C is, so every way of stopping runs the same clean-up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupted_exit_code(error: KeyboardInterrupt) -> int:
    return 128 + getattr(error, "signum", signal.SIGINT)  # as for a process the signal stopped


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(signum)


def run_main(main) -> None:
    """Every script's entry point. A stop signal that reaches here is one line and exit 128 + its number
    (writes are atomic: nothing half-written is left); a pipe closed early (| head) ends quietly."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_interrupted)
    try:
        code = main(sys.argv[1:])
        sys.stdout.flush()
    except KeyboardInterrupt as e:
        print("\ninterrupted: stopped at once; nothing half-written was kept", file=sys.stderr)
        code = interrupted_exit_code(e)
    except BrokenPipeError:
        _silence_stdout()
        code = 141  # 128 + SIGPIPE
    except OSError as e:  # what reaches here is the output itself failing (a full disk or device under stdout):
        _silence_stdout()  # the scripts' own files fail as SaveFailed or DataError, with their own line
        try:
            print(f"error: cannot write the output ({e.strerror or e}); what was saved before is kept", file=sys.stderr)
        except OSError:
            pass
        code = 1
    sys.exit(code)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit does not fail a second time."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# ----------------------------------------------------------------------------------------------
# Configuration: defaults < TOML file < --key=value

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _coerce(name: str, value, kind: str):
    """A value of type `kind` (bool, int, float, str, list[...], dict[str, ...]) from TOML or command-line
    text; lists and tables are comma-separated there (--probe_offsets=64,128, --seeds_by_variant=a=8,b=4)."""
    if kind.startswith(("list[", "dict[str, ")):
        item, is_list = kind[kind.index("[") + 1 : -1].removeprefix("str, "), kind.startswith("list")
        if isinstance(value, str) and is_list:
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, str):
            pairs = [v.split("=", 1) for v in value.split(",") if v.strip()]
            if not all(len(pair) == 2 for pair in pairs):
                raise ConfigError(f"{name}={value!r}: expected name=value pairs separated by commas")
            value = {k.strip(): v for k, v in pairs}
        if is_list and isinstance(value, list):
            return [_coerce(name, v, item) for v in value]
        if not is_list and isinstance(value, dict):
            return {str(k): _coerce(f"{name}.{k}", v, item) for k, v in value.items()}
        raise ConfigError(f"{name}={value!r}: expected {'a list of' if is_list else 'a table of name ='} {item}")
    accepted = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str, int, float)}[kind]
    if isinstance(value, accepted) and (kind == "bool" or not isinstance(value, bool)):
        return {"bool": bool, "int": int, "float": float, "str": str}[kind](value)
    if isinstance(value, str) and kind == "bool" and value.lower() in TRUE + FALSE:
        return value.lower() in TRUE
    if isinstance(value, str) and kind in ("int", "float"):
        try:
            return int(value) if kind == "int" else float(value)
        except ValueError:
            pass
    raise ConfigError(f"{name}={value!r}: expected {kind}")


def script_settings(cls: type, argv: list[str], usage: str, command: str):
    """A script's --key=value arguments as its settings dataclass; --help lists them; a bad one is one line
    `error: ...` and exit 2."""
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
    """The settings dataclass `cls` from raw values, each of its field's type and within its bounds."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}; run '{help_command}' for the keys")
    coerced = {k: _coerce(k, v, fields[k].type) for k, v in values.items()}
    settings = cls(**{k: os.path.expanduser(v) if fields[k].metadata["path"] else v for k, v in coerced.items()})
    check_bounds(settings)
    return settings


def command_line_values(argv: list[str], hint: str = "") -> dict:
    if bad := [arg for arg in argv if not arg.startswith("--") or "=" not in arg]:
        raise ConfigError(f"bad argument {bad[0]!r}: use --key=value{hint}")
    return dict(arg[2:].split("=", 1) for arg in argv)


def parse_config(argv: list[str]) -> Config:
    """A checked Config from [CONFIG.toml] [--key=value ...]. With resume=true the run's saved settings
    (out_dir/config.json) come first, and the given ones may change only what RESUMABLE allows."""
    values: dict = {}
    if argv and not argv[0].startswith("--"):
        values, argv = read_config_file(Path(os.path.expanduser(argv[0]))), argv[1:]
    values.update(command_line_values(argv, " (a config file may come first)"))
    given = settings_from(Config, values, "python train.py --help")
    if given.resume:
        values = {**saved_settings(given, values), **values}
    cfg = settings_from(Config, values, "python train.py --help")
    validate(cfg)
    return cfg


def saved_settings(given: Config, values: dict) -> dict:
    """The settings a run started with ({} when it has none), after checking `values` change only what may
    change when resuming. A damaged config.json falls back to the checkpoint's copy."""
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
        try:  # the checkpoint's content is verified when the run loads it
            saved = torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=False)["config"]
        except Exception as error:  # a damaged checkpoint fails in many ways inside torch and pickle
            raise ConfigError(f"{path} cannot be read ({e}), nor can the settings in ckpt.pt ({error})") from None
        print(f"warning: {path} cannot be read ({e}); resuming with the settings in ckpt.pt", file=sys.stderr)
    fields = {f.name for f in dataclasses.fields(Config)}
    # the folder is where the run is now (it may have moved), and resuming is not overwriting
    saved = {k: v for k, v in saved.items() if k in fields and k not in ("resume", "overwrite", "out_dir")}
    if detail := changed_on_resume(saved, given, [k for k in values if k in saved]):
        raise ConfigError(
            f"cannot resume {given.out_dir} with other settings ({detail}); when resuming only "
            f"{', '.join(sorted(RESUMABLE - {'resume', 'overwrite'}))} may change"
        )
    return saved


def changed_on_resume(saved: dict, cfg: Config, keys: list[str]) -> str:
    """'key: saved -> now' for each of `keys` that `cfg` changes from `saved` and a resumed run may not."""
    defaults = Config()  # a setting added after the run started: it ran as the default does
    before = {k: saved.get(k, getattr(defaults, k, None)) for k in keys}
    changed = [k for k in keys if k not in RESUMABLE and before[k] != getattr(cfg, k)]
    return ", ".join(f"{k}: {before[k]!r} -> {getattr(cfg, k)!r}" for k in changed)


def read_config_file(path: Path) -> dict:
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
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        choices, minimum, maximum = (f.metadata[k] for k in ("choices", "min", "max"))
        for item in value if isinstance(value, list) else [value]:
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


def help_text(usage: str, keys: tuple[str, ...] | None = None, cls: type = Config) -> str:
    """`usage`, then every setting of `cls` (or those in `keys`) with its default, choices and help."""
    lines = [usage.strip(), "", "settings (--key=default):"]
    for f in dataclasses.fields(cls):
        if keys is not None and f.name not in keys:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, (list, dict)):
            default = ",".join(f"{k}={v}" for k, v in default.items()) if isinstance(default, dict) else default
            default = ",".join(map(str, default)) if isinstance(default, list) else default
        choices = f"  [{' | '.join(f.metadata['choices'])}]" if f.metadata["choices"] else ""
        lines.append(f"  --{f.name}={str(default).lower() if isinstance(default, bool) else default}{choices}")
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
