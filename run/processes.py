"""The processes of a run: joining them under torchrun, and agreeing on errors and stop requests so that none
is left waiting."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from config import resolve_device
from errors import ConfigError, DataError, Interrupted


def setup_distributed(cfg) -> tuple[int, int, torch.device]:
    """(rank, world_size, device); under torchrun, joins the process group (NCCL on GPU, else gloo)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(cfg.device)
    if world_size == 1:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world_size, device


def agree(error: Exception | None) -> None:
    """Raise on every process the error any process had (None: none), so that under torchrun an error on one
    stops them all with the same line instead of leaving the others waiting."""
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else (type(error).__name__, str(error)))
    for found in errors:
        if found is not None:
            raise {"DataError": DataError}.get(found[0], ConfigError)(found[1])


class StopRequest:
    """Ctrl-C, SIGTERM or SIGHUP: finish the step in flight, checkpoint, raise Stopped; a second one stops at
    once."""

    def __init__(self) -> None:
        self.signum = 0  # the stop signal received, 0 while none

    def __enter__(self) -> StopRequest:
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum:  # a second one stops at once
            raise Interrupted(signum)
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint", flush=True)

    def agreed(self, step: int, every: int, device: torch.device) -> int:
        """The signal to stop on after this step (0: go on). Under DDP the processes agree every `every` steps,
        so none is left waiting, and all stop on the same signal (the largest number any received)."""
        if not dist.is_initialized():
            return self.signum
        if step % every:
            return 0
        signum = torch.tensor(float(self.signum), device=device)
        dist.all_reduce(signum, op=dist.ReduceOp.MAX)
        return int(signum.item())
