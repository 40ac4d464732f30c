"""The command line of every script: settings from defaults < a TOML file < --key=value arguments, checked
against the settings table (config.py), the --help text, the progress line of long work, and `run_main`, the
wrapper every script's main runs under."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import signal
import sys
import textwrap
import time
import tomllib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from config import Config, validate
from errors import ConfigError, Interrupted, interrupted_exit_code
from run.checkpoint import read_checkpoint

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
    for key, value in coerced.items():  # "" would be the working folder: never what a path with a default meant
        if fields[key].metadata["path"] and fields[key].default and not value.strip():
            raise ConfigError(f"{key} is empty: give a path")
    settings = cls(**{k: os.path.expanduser(v) if fields[k].metadata["path"] else v for k, v in coerced.items()})
    check_bounds(settings)
    return settings


def command_line_values(argv: list[str], hint: str = "") -> dict:
    if bad := [arg for arg in argv if not arg.startswith("--") or "=" not in arg]:
        raise ConfigError(f"bad argument {bad[0]!r}: use --key=value{hint}")
    return dict(arg[2:].split("=", 1) for arg in argv)


def parse_config(argv: list[str]) -> Config:
    """A checked Config from [CONFIG.toml] [--key=value ...]. With resume=true the settings in the run's
    checkpoint come first (those it may change are checked once, against the checkpoint, when the run loads it)."""
    values: dict = {}
    if argv and not argv[0].startswith("--"):
        values, argv = read_config_file(Path(os.path.expanduser(argv[0]))), argv[1:]
        values.pop("ablate", None)  # a study's own table: its top-level keys train the study's reference arm
    values.update(command_line_values(argv, " (a config file may come first)"))
    given = settings_from(Config, values, "python train.py --help")
    if given.resume:
        values = {**saved_settings(Path(given.out_dir)), **values}
    cfg = settings_from(Config, values, "python train.py --help")
    validate(cfg)
    return cfg


def saved_settings(out_dir: Path) -> dict:
    """The settings in out_dir's checkpoint that a resumed run starts from ({} without a checkpoint: the run
    folder's checks say so). The folder is where the run is now, and resuming is not overwriting."""
    path = Path(out_dir) / "ckpt.pt"
    if not path.is_file():
        return {}
    fields = {f.name for f in dataclasses.fields(Config)}
    saved = read_checkpoint(path, mmap=True)["config"]
    return {k: v for k, v in saved.items() if k in fields and k not in ("resume", "overwrite", "out_dir")}


def read_config_file(path: Path, corpus_hint: bool = True) -> dict:
    """A TOML file's values; `corpus_hint`: say how to train on a corpus given where a config belongs."""
    hint = f" (to train on a corpus, give it as --dataset={path})" if corpus_hint else ""
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


# ----------------------------------------------------------------------------------------------
# Every script's entry point


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
# Progress


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


class Progress:
    """The one progress line: `done` of `total`, rates of any counts and the ETA, as `show(progress)` makes it,
    at most every `every` seconds (rewritten in place on a terminal)."""

    def __init__(self, total: float, show: Callable[[Progress], str], print_line=print, every: float = 10.0) -> None:
        self.total, self.show, self.print_line = max(total, 1e-9), show, print_line
        self.tty = print_line is print and sys.stdout.isatty()
        self.every = min(every, 0.5) if self.tty else every
        self.done, self.counts = 0.0, Counter()
        self.start = self.last = time.time()

    def advance(self, done: float = 0, **counts: float) -> None:
        self.done += done
        self.counts.update(counts)
        if self.done and time.time() - self.last >= self.every:
            self.last = time.time()
            line = self.show(self)
            print(f"\r{line}\033[K", end="", flush=True) if self.tty else self.print_line(line)

    def rate(self, name: str) -> float:
        return self.counts[name] / max(time.time() - self.start, 1e-9)

    def eta(self) -> str:
        elapsed = time.time() - self.start
        return format_duration(elapsed / self.done * (self.total - self.done)) if self.done else "unknown"

    def close(self) -> None:
        if self.tty and self.last > self.start:
            print("\r\033[K", end="", flush=True)
