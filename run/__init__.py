"""The run's guarantees, behind the narrow door of `Session` (session.py): the run folder (folder.py: lock,
atomic writes, replacement, metrics log), the checkpoint (checkpoint.py: save, verify, resume) and the
processes (processes.py: agreeing, stop requests)."""

from run.session import Session

__all__ = ["Session"]
