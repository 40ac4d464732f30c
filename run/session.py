"""The door train.py's loop goes through for every guarantee: `session.save(step, evaluation)`,
`if session.stop_requested(step): session.stop(step)`, `session.check_finite(loss, step, now)`."""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
from contextlib import ExitStack
from pathlib import Path

import tiktoken
import torch
import torch.distributed as dist

from config import Config
from errors import ConfigError, Stopped, TrainingDiverged
from run import checkpoint
from run.folder import MetricsFile, RunFiles, hold, write_atomically
from run.processes import StopRequest, agree


class Session:
    """One run on this process (its final settings, and its rank, process count and device), with process 0
    holding the run folder's lock for the run's lifetime; `resumed`: the state of the checkpoint it continues,
    read and checked against the settings before (resolve.py)."""

    def __init__(self, cfg: Config, processes: tuple[int, int, torch.device], resumed: dict | None = None) -> None:
        self.cfg, self.resumed = cfg, resumed
        self.rank, self.world_size, self.device = processes
        self.main_process = self.rank == 0  # the only one that prints, logs, evaluates and writes checkpoints
        self.print = print if self.main_process else lambda *args, **kwargs: None
        self.saved_step, self.last_evaluation, self.stop_signal = -1, {}, 0

    def __enter__(self) -> Session:
        self.held = ExitStack()
        try:
            refused = None
            if self.main_process:  # only process 0 writes to out_dir
                try:
                    self.held.enter_context(hold(Path(self.cfg.out_dir), self.cfg.resume, self.cfg.overwrite))
                    if self.resumed is not None:  # read before the lock was held: is it still the folder's?
                        now = checkpoint.read_checkpoint(Path(self.cfg.out_dir) / "ckpt.pt", mmap=True)
                        if (now["step"], now.get("run_id")) != (self.resumed["step"], self.resumed.get("run_id")):
                            raise ConfigError(f"{self.cfg.out_dir} changed while this run started: resume again")
                except ConfigError as e:
                    refused = e
            agree(refused)  # every process stops with process 0's error, none waits for it
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.held.close()
        if self.world_size > 1:
            dist.destroy_process_group()

    def start(self, model, optimizer, batches, shard_path: Path, meta: dict, enc: tiktoken.Encoding, mirror=None):
        """Restore a resumed run into what it tracks, and open the run's files (config.json, the record of its
        settings; metrics.jsonl, each record also to `mirror`, closed with the session); returns the last step."""
        if self.resumed is not None:
            model.load_state_dict(self.resumed["model"])
            optimizer.load_state_dict(self.resumed["optimizer"])
            batches.load_state_dict(self.resumed["data"])
            checkpoint.set_rng_states(self.resumed["rng"][self.rank])
        self.tracked = (model, optimizer, batches)
        self.first_step = self.resumed["step"] if self.resumed else 0
        run_id = (self.resumed or {}).get("run_id") or secrets.token_hex(8)
        files = RunFiles(Path(self.cfg.out_dir), run_id, self.resumed is None, self.main_process)
        self.files = self.held.enter_context(files)
        if self.main_process:
            record = json.dumps({"run_id": run_id, **dataclasses.asdict(self.cfg)}, indent=1)
            write_atomically(files.path("config.json"), record)
        self.metrics = MetricsFile(files, self.first_step if self.resumed else None, self.main_process, mirror)
        if mirror is not None:
            self.held.callback(mirror.close)
        self.record = checkpoint.run_record(self.cfg, run_id, shard_path, meta, enc)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        return self.first_step

    def log(self, record: dict) -> None:
        self.metrics.write(record)

    def kept(self) -> str:
        """Where the run's last checkpoint is, for an error that ends the run."""
        step = self.saved_step if self.saved_step > 0 else self.first_step
        if not step:  # a run replacing another leaves that one as it was until its own first checkpoint
            replaced = f"; {self.cfg.out_dir} keeps the run it held" if self.files.folder == self.files.staging else ""
            return f"no checkpoint was written{replaced}"
        return f"the checkpoint of step {step} is kept in {self.files.path('ckpt.pt')}"

    def check_finite(self, loss: torch.Tensor, step: int, now: bool) -> None:
        """Refuse a run whose training loss was ever non-finite, before anything is logged or saved; looked
        at (waiting for the device) only `now`."""
        self.nonfinite |= ~torch.isfinite(loss)
        if now and self.nonfinite.item():
            raise TrainingDiverged(
                f"training loss became non-finite by step {step} (last value {loss.item()}); {self.kept()}"
            )

    def save(self, step: int, evaluation: dict | None = None) -> None:
        """Log a new evaluation (process 0's; {} elsewhere), then checkpoint with the last one. A collective."""
        if evaluation:
            if not (math.isfinite(evaluation["val_loss"]) and math.isfinite(evaluation["val_doc_loss"])):
                raise TrainingDiverged(f"validation loss is non-finite at step {step}; {self.kept()}")
            self.log(evaluation)
            self.last_evaluation = evaluation
        rng = checkpoint.every_process_rng_states()
        if self.main_process:
            model, optimizer, batches = self.tracked
            state = {
                "model": model.state_dict(),
                "model_config": dataclasses.asdict(model.config),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "data": batches.state_dict(),
                "rng": rng,
                "evaluation": {k: v for k, v in self.last_evaluation.items() if not isinstance(v, list)},
                **self.record,
            }
            checkpoint.save_checkpoint(self.files.path("ckpt.pt"), state, self.kept())  # what a failure leaves
            self.files.promote()  # the first checkpoint of a run replacing another moves its files in
        self.saved_step = step

    def stop_requests(self) -> StopRequest:  # the with-block in which a stop signal finishes the step in flight
        self.stop_request = StopRequest()
        return self.stop_request

    def stop_requested(self, step: int) -> bool:
        self.stop_signal = self.stop_request.agreed(step, self.cfg.log_interval, self.device)
        return bool(self.stop_signal)

    def stop(self, step: int) -> None:
        """Checkpoint this step (unless it is saved already) and end the run, unfinished: raise Stopped."""
        if self.saved_step != step:
            self.save(step)
        raise Stopped(self.stop_signal, step, self.cfg.out_dir)
