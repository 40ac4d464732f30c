"""Every exception of the repo, in one place. Each of the first five ends a script with one line `error: ...`
and a non-zero exit; an interrupt ends it with 128 + the signal's number, as for a process the signal stopped.
Imports nothing from the repo."""

from __future__ import annotations

import signal


class ConfigError(Exception):
    """Bad settings, or a folder that cannot serve."""


class DataError(Exception):
    """A problem with the user's data or prepared shards."""


class SaveFailed(Exception):
    """A result could not be written (disk full, file size limit)."""


class TrainingDiverged(Exception):
    """The loss became non-finite."""


class ExportError(Exception):
    """A run that cannot be exported, or an export that does not reproduce the run."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised as Ctrl-C is, so every way of stopping runs the same clean-up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stopped(Interrupted):
    """A stop signal the run obeyed: it finished the step in flight and saved its checkpoint, unfinished. Exit
    128 + the signal's number, as for any interrupt, so that `python train.py && python export_hf.py ...` does
    not export a run that did not finish."""

    def __init__(self, signum: int, step: int, out_dir: str) -> None:
        super().__init__(signum)
        self.step, self.out_dir = step, out_dir


def interrupted_exit_code(error: KeyboardInterrupt) -> int:
    return 128 + getattr(error, "signum", signal.SIGINT)
