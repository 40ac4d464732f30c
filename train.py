"""Train a GPT on packed documents.

    python train.py                                   # the CPU quickstart on the built-in corpus
    python train.py configs/gpt2_small_gpu.toml       # a config file
    python train.py --doc_mask=false --max_iters=100  # any field of config.Config as --key=value (--help)

Writes out_dir/config.json, metrics.jsonl and ckpt.pt. The recipe, top to bottom: the run in its steps, the
loop, one training step, the evaluation, model and optimizer, the data, the training log, and `main`. Every
guarantee (the run folder's lock, atomic checkpoints, resuming, stop signals, several processes) is behind
the `Session` the loop calls (run/). A stop signal (Ctrl-C, SIGTERM, SIGHUP) finishes the step, saves the
checkpoint and exits with 128 + its number: the run is unfinished.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import reports
import shards
from cli import Progress, help_text, parse_config, run_main
from config import Config, warmup_steps
from data import Batch, Flags, PackedBatches
from errors import ConfigError, DataError, SaveFailed, Stopped, TrainingDiverged, interrupted_exit_code
from model import GPT, GPTConfig, attention_impl, attention_mask
from resolve import Plan, resolve, warn_about
from run import Session


def train(plan: Plan) -> dict:
    """Run the plan (resolve.resolve); returns the last evaluation (on process 0)."""
    cfg = plan.cfg
    with Session(cfg, plan.processes, plan.resumed) as session:
        run = load_data(plan)
        model, optimizer = build_model(plan)
        mirror = reports.WandbMirror(cfg) if cfg.wandb and session.main_process else None
        first_step = session.start(
            model, optimizer, run.train, plan.shard_path, plan.shards.meta, plan.tokenizer, mirror
        )
        warn_about(cfg, session.print)
        attention = attention_impl(cfg.doc_mask, cfg.attn_impl, session.device)
        reports.describe_run(cfg, session, model, attention, run.train, run.val_alone, run.val_tokens)
        with session.stop_requests():  # from here a stop signal finishes the step in flight (session.stop)
            result = loop(cfg, session, run, model, optimizer, TrainingLog(cfg, session, first_step))
        if session.main_process and cfg.sample_prompt and cfg.sample_tokens and result.get("step") == cfg.max_iters:
            print(f"\nsample:\n{sample(model, plan)}")
    return result


def loop(cfg: Config, session: Session, run: RunData, model: GPT, optimizer, log: TrainingLog) -> dict:
    """The training steps, with logging, evaluation and checkpoints; returns the last evaluation. The loss
    stays on the device between log steps: looking at it every step would wait for the GPU."""
    # Three handles on one set of weights: `model` is saved, clipped and sampled from; `fast_model` (compiled
    # when asked) evaluates; `training_model` trains, wrapped under torchrun to average gradients.
    fast_model = torch.compile(model) if cfg.compile else model
    training_model = data_parallel(fast_model, session.device) if session.world_size > 1 else fast_model
    precision = autocast(session.device, cfg.dtype)
    result: dict = {}
    for step in range(log.first_step + 1, cfg.max_iters + 1):
        lr = lr_at(step - 1, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = [run.train.next().to(session.device) for _ in range(cfg.grad_accum)]
        loss = accumulate_gradients(training_model, micro_batches, precision, model.config, cfg.doc_mask)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.count(micro_batches)

        last, stopping = step == cfg.max_iters, session.stop_requested(step)
        should_log = step % cfg.log_interval == 0 or last or stopping
        should_eval = step % cfg.eval_interval == 0 or last
        session.check_finite(loss, step, now=should_log or should_eval)
        if should_log:
            log.training(step, loss, lr)
        if should_eval:
            t_eval = time.time()
            if session.main_process:  # the unwrapped model: a DDP forward on one process alone would hang
                sets = (run.val_packed, run.val_alone)
                val = evaluate(fast_model, model.config, *sets, session.device, precision, print, run.token_bytes)
                result = {"step": step, **val}
            session.save(step, result)
            log.evaluated(result, time.time() - t_eval)
        if stopping:
            session.stop(step)  # checkpoints this step unless it just did, and raises Stopped
    return result


# ----------------------------------------------------------------------------------------------
# One step: the learning rate, the loss, the gradients


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup, then cosine decay from lr to min_lr at max_iters."""
    warmup = warmup_steps(cfg)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.max_iters - warmup)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - cfg.min_lr)


def token_losses(
    model: torch.nn.Module, batch: Batch, config: GPTConfig, doc_mask: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one loss of this repo: each token's cross-entropy (B, T), 0 where the target does not count, and
    which targets count. The attention mask is built here, once per batch, outside the (compiled) model."""
    mask = attention_mask(batch.doc_ids, doc_mask, config.attn_impl)
    return model(batch.inputs, batch.position_ids, mask, batch.targets), batch.counted


def accumulate_gradients(
    model: torch.nn.Module, micro_batches: list[Batch], precision, config: GPTConfig, doc_mask: bool
) -> torch.Tensor:
    """Backward over one step's micro-batches; returns its mean loss. Normalised by the counted targets of the
    whole step on every process, so each target weighs the same wherever it falls."""
    n_counted = sum(b.counted.sum() for b in micro_batches)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size > 1:
        dist.all_reduce(n_counted)
    n_counted = n_counted.clamp(min=1)
    total = torch.zeros((), device=micro_batches[0].inputs.device)
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # DDP averages gradients over processes at the last backward; the others skip that all-reduce
        with nullcontext() if last or world_size == 1 else model.no_sync():
            with precision:
                loss = token_losses(model, batch, config, doc_mask)[0].sum() / n_counted
            (loss * world_size).backward()  # undo DDP's average: the loss is already a global mean
        total += loss.detach()
    if world_size > 1:
        dist.all_reduce(total)
    return total


# ----------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    model_config: GPTConfig,
    packed: PackedBatches,
    alone: PackedBatches,
    device: torch.device,
    precision,
    print_progress=None,
    token_bytes: torch.Tensor | None = None,
) -> dict:
    """On the fixed validation documents. val_loss: `packed`, rows under the run's packing and flags, where each
    document is also scored in context (val_doc_loss_in_context). val_doc_loss and its sums: `alone`, every
    document as from its start, the inference setting (reports.DocumentLosses). With `token_bytes` (each id's
    UTF-8 bytes) also bits per byte. Progress goes to `print_progress` every 10 seconds (None: nowhere)."""
    model.eval()
    n_batches = sum(-(-len(rows) // rows.batch_size) for rows in (packed, alone))
    progress = evaluation_progress(n_batches, print_progress)
    sums = {}
    for scored, rows in (("in_context", packed), ("alone", alone)):
        sums[scored] = reports.DocumentLosses(rows, device, token_bytes)
        for first_row, batch in zip(range(0, len(rows), rows.batch_size), rows.all_batches()):
            batch = batch.to(device)
            with precision:
                losses, counted = token_losses(model, batch, model_config, rows.flags.doc_mask)
            sums[scored].add(first_row, losses, counted, batch)
            progress.advance(1)
    model.train()
    return {**sums["in_context"].packed_result(), **sums["alone"].result(), **sums["in_context"].in_context_result()}


def evaluation_progress(n_batches: int, print_progress) -> Progress:
    show = lambda p: f"eval: {p.done:.0f}/{p.total:.0f} batches, ETA {p.eta()}"  # noqa: E731
    return Progress(n_batches, show, print_progress or (lambda line: None))


def validation_sets(
    val: np.ndarray, eot_id: int, cfg: Config, bos_id: int | None = None
) -> tuple[PackedBatches, PackedBatches]:
    """The validation documents as `evaluate` takes them: packed as the run packs, and each alone, which needs no
    row of its own: under the document mask and reset positions whole documents share rows (best fit)."""
    common = dict(eot_id=eot_id, seq_len=cfg.seq_len, batch_size=cfg.batch_size, bos_id=bos_id, shuffle=False)
    packed = PackedBatches(val, packing=cfg.packing, flags=cfg.flags, split="val", keep_tail=True, **common)
    return packed, PackedBatches(val, packing="bestfit", flags=Flags(), split="val", **common)


# ----------------------------------------------------------------------------------------------
# Model and optimizer


def build_model(plan: Plan):
    """The model and its optimizer: fresh, or with the weights of a pretrained folder (plan.start); a resumed
    run's states are restored into them by session.start."""
    torch.manual_seed(plan.cfg.seed)
    model = GPT(plan.model).to(plan.device)
    if plan.start is not None:
        plan.start.load_into(model, plan.tokenizer)
    if plan.world_size > 1:
        torch.manual_seed(plan.cfg.seed + plan.rank)  # the same init everywhere, different dropout masks per process
    return model, optimizer_for(model, plan.cfg)


def optimizer_for(model: GPT, cfg: Config) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=next(model.parameters()).is_cuda)


def autocast(device: torch.device, dtype: str = "auto"):
    """The compute precision, in one place: bfloat16 autocast on CUDA (dtype auto), float32 elsewhere."""
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def data_parallel(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """The model wrapped to average gradients over the processes. Its only buffers (RoPE's tables) are the
    same on every process, so they need no sync at each forward."""
    ddp_devices = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ddp_devices, forward_sync_buffers=False)


def sample(model: GPT, plan: Plan) -> str:
    cfg, device = plan.cfg, plan.device
    prompt = torch.tensor([shards.document_opening(plan.tokenizer, cfg.sample_prompt)], device=device)
    with autocast(device, cfg.dtype):
        out = model.eval().generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=50, stop_token=plan.shards.eot_id)
    return shards.decoded(plan.tokenizer, out[0].tolist())


# ----------------------------------------------------------------------------------------------
# The data


@dataclasses.dataclass
class RunData:
    train: PackedBatches
    val_packed: PackedBatches  # the validation documents packed as the run packs
    val_alone: PackedBatches  # and each alone (best-fit rows under the document mask and reset positions)
    val_tokens: int
    token_bytes: torch.Tensor  # each id's UTF-8 bytes (0 for EOT and BOS), for bits per byte


def load_data(plan: Plan) -> RunData:
    """Every split's rows, from the plan's shards: this process's share of the training rows, and the
    validation documents within the evaluation budget."""
    cfg, eot_id = plan.cfg, plan.shards.eot_id
    val = shards.leading_documents(plan.shards.val, eot_id, cfg.eval_tokens)
    shape = dict(eot_id=eot_id, seq_len=cfg.seq_len, batch_size=cfg.batch_size, bos_id=plan.bos_id)
    train_rows = PackedBatches(
        plan.shards.train,
        packing=cfg.packing,
        flags=cfg.flags,
        seed=cfg.seed,
        rank=plan.rank,
        world_size=plan.world_size,
        **shape,
    )
    val_packed, val_alone = validation_sets(val, eot_id, cfg, plan.bos_id)
    n_bytes = torch.from_numpy(shards.token_bytes(plan.tokenizer)).to(plan.device)
    return RunData(train_rows, val_packed, val_alone, len(val), n_bytes)


# ----------------------------------------------------------------------------------------------
# The training log


class TrainingLog:
    """The training lines and their records in metrics.jsonl: the throughput since the previous record,
    evaluations excluded, and the ETA, on a clock that starts here, just before the loop."""

    def __init__(self, cfg: Config, session: Session, first_step: int) -> None:
        self.session, self.first_step, self.max_iters = session, first_step, cfg.max_iters
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * session.world_size
        self.counted_since_log: torch.Tensor | int = 0  # on the device until a log step: no per-step sync
        self.progress = Progress(cfg.max_iters - first_step, str, lambda line: None)  # for the ETA
        self.t_log, self.step_at_log = time.time(), first_step

    def count(self, batches: list[Batch]) -> None:
        self.counted_since_log = self.counted_since_log + sum(b.counted.sum() for b in batches)

    def training(self, step: int, loss: torch.Tensor, lr: float) -> None:
        if not self.session.main_process:
            return
        seconds = time.time() - self.t_log
        tok_s = (step - self.step_at_log) * self.tokens_per_step / seconds
        counted_s = float(self.counted_since_log) * self.session.world_size / seconds
        record = dict(step=step, train_loss=round(loss.item(), 4), lr=lr, tokens_per_sec=round(tok_s))
        self.session.log({**record, "counted_tokens_per_sec": round(counted_s)})
        self.progress.done = step - self.first_step
        print(
            f"step {step:>5}/{self.max_iters} | loss {record['train_loss']:.4f} | lr {lr:.2e} | "
            f"{tok_s:,.0f} tok/s | ETA {self.progress.eta()}",
            flush=True,
        )
        self.t_log, self.step_at_log, self.counted_since_log = time.time(), step, 0

    def evaluated(self, result: dict, seconds: float) -> None:
        """Print the evaluation (logged already, before its checkpoint), whose time is not training's."""
        if result:
            self.session.print(
                f"eval {result['step']:>5} | val_loss {result['val_loss']:.4f} | "
                f"val_doc_loss {result['val_doc_loss']:.4f} | {seconds:.1f}s, checkpoint saved",
                flush=True,
            )
        self.t_log += seconds


# ----------------------------------------------------------------------------------------------
# main


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(__doc__))
        return 0
    started = time.time()
    first_process = int(os.environ.get("RANK", "0")) == 0
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    say = print if first_process else lambda *args, **kwargs: None
    cfg = None
    try:
        cfg = parse_config(argv)
        plan = resolve(cfg)
        cfg = plan.cfg  # the final settings: a resume command names them
        train(plan)
    except (ConfigError, DataError, TrainingDiverged, SaveFailed) as e:
        say(f"error: {e}", file=sys.stderr)
        return 1
    except Stopped as e:  # the first stop signal: the step finished and its checkpoint is saved
        if e.step == cfg.max_iters:  # during the last step: the run is finished all the same
            say(reports.run_summary(cfg, time.time() - started, world_size))
            return 0
        say(reports.run_summary(cfg, time.time() - started, world_size, stopped_after=e.step), flush=True)
        say(
            f"interrupted: {e} stopped the run after step {e.step} with its checkpoint saved; exit "
            f"{interrupted_exit_code(e)} (unfinished); resume it with: {reports.train_command(cfg, world_size)}",
            file=sys.stderr,
        )
        return interrupted_exit_code(e)
    except KeyboardInterrupt as e:  # a second stop signal (the first finishes the step and saves), or one before
        resumable = cfg is not None and (Path(cfg.out_dir) / "ckpt.pt").exists()
        resume = (
            f"; resume from the last checkpoint with: {reports.train_command(cfg, world_size)}" if resumable else ""
        )
        say(f"\ninterrupted: stopped at once, nothing half-written kept{resume}", file=sys.stderr)
        return interrupted_exit_code(e)
    say(reports.run_summary(cfg, time.time() - started, world_size))
    return 0


if __name__ == "__main__":
    run_main(main)
