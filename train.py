"""Train a GPT on packed documents.

    python train.py                                   # the CPU quickstart on the built-in corpus
    python train.py configs/gpt2_small_gpu.toml       # a config file
    python train.py --doc_mask=false --max_iters=100  # any field as --key=value, after the file

Every setting is a field of `Config` in config.py, with its default and help text (`--help` lists them).
The resolved config is saved to out_dir/config.json; metrics go to out_dir/metrics.jsonl; the checkpoint
to out_dir/ckpt.pt. This file is the recipe, top to bottom: data, model, optimizer, loss, evaluation, then
the run itself; run_folder.py holds what makes a run safe to stop, resume and share.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import sys
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import data
import run_folder
from config import Config, ConfigError, help_text, interrupted_exit_code, parse_config, run_main
from data import Batch, DataError, PackedBatches
from model import GPT, GPTConfig, attention_impl, attention_mask
from prepare import prepare_for
from run_folder import SaveFailed


class TrainingDiverged(Exception):
    """The loss became non-finite; printed as one line."""


# ----------------------------------------------------------------------------------------------
# Data, model, optimizer


def model_settings(cfg: Config, vocab_size: int) -> GPTConfig:
    same_names = ("seq_len", "n_layer", "n_head", "n_embd", "dropout", "pos_emb", "attn_impl")
    return GPTConfig(
        vocab_size=math.ceil(vocab_size / 64) * 64,  # a multiple of 64 is faster on GPU
        **{name: getattr(cfg, name) for name in same_names},
    )


def autocast(device: torch.device, dtype: str = "auto"):
    """The compute precision: bfloat16 autocast on CUDA (dtype auto), float32 elsewhere. The one place."""
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup, then cosine decay from lr to min_lr at max_iters."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    progress = (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - cfg.min_lr)


def make_optimizer(model: GPT, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")


# ----------------------------------------------------------------------------------------------
# The loss and evaluation


def token_losses(model: torch.nn.Module, batch: Batch, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's cross-entropy (B, T), 0 where the target does not count, and which targets count
    (B, T bool). The one loss of this repo: training sums it; evaluation and the ablation probes also read
    it by position. The attention mask is built here, once per batch and outside the (compiled) model,
    from the batch's document ids and its doc_mask flag."""
    mask = attention_mask(batch.doc_ids, batch.doc_mask, config.attn_impl)
    return model(batch.inputs, batch.position_ids, mask, batch.targets), batch.counted


def accumulate_gradients(
    model: torch.nn.Module, micro_batches: list[Batch], precision, config: GPTConfig
) -> torch.Tensor:
    """Backward over all micro-batches of one step; returns the step's mean loss. The loss is normalised
    by the counted targets of the whole step (on every process), so every target weighs the same
    however they fall into micro-batches and processes."""
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
                loss = token_losses(model, batch, config)[0].sum() / n_counted
            (loss * world_size).backward()  # undo DDP's average: the loss is already a global mean
        total += loss.detach()
    if world_size > 1:
        dist.all_reduce(total)
    return total


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    model_config: GPTConfig,
    packed: PackedBatches,
    alone: PackedBatches,
    device: torch.device,
    precision,
    print_progress=None,
) -> dict:
    """On the fixed validation subset (whole documents), planned once per run:
    val_loss: `packed`, rows under this run's packing and flags.
    val_doc_loss: `alone`, every document alone from its start (the inference setting; the same
    computation for every run with the same start marker). Under the marker it scores each document's first
    token too (predicted from the BOS); val_doc_loss_from_second scores the targets both conventions share
    (every token from the second on, and the EOT), so the two can be compared. Loss sums and counted
    targets by position within the document's text (the input's position, below seq_len: position p predicts
    the token after the p-th) and by document are kept too, so that any band of positions, or any subset of
    documents, can be scored from metrics.jsonl without running the model again. `print_progress`: where to
    print progress every 10 seconds, when there is that much to do."""
    model.eval()
    seq_len, batch_size = alone.seq_len, alone.batch_size
    n_batches = -(-len(packed) // packed.batch_size) - (-len(alone) // batch_size)
    progress = EvaluationProgress(n_batches, print_progress)
    total, count = torch.zeros((), device=device), torch.zeros((), device=device)
    for batch in packed.all_batches():
        progress.step()
        batch = batch.to(device)
        with precision:
            losses, counted = token_losses(model, batch, model_config)
        total, count = total + losses.sum(), count + counted.sum()
    document_of_row = torch.from_numpy(alone.document_of_rows()).to(device)  # a long document has several rows
    n_documents = len(alone.documents)
    by_position = torch.zeros(2, seq_len, dtype=torch.float64, device=device)  # loss sum, counted targets
    by_document = torch.zeros(2, n_documents, dtype=torch.float64, device=device)
    first_token = torch.zeros(n_documents, dtype=torch.float64, device=device)  # predicted from the BOS
    for first_row, batch in zip(range(0, len(alone), batch_size), alone.all_batches()):
        progress.step()
        batch = batch.to(device)
        with precision:
            losses, counted = token_losses(model, batch, model_config)
        rows = document_of_row[first_row : first_row + batch_size]
        real = slice(0, len(rows))  # the last batch is filled up with empty rows
        by_document[0].index_add_(0, rows, losses[real].sum(1).double())
        by_document[1].index_add_(0, rows, counted[real].sum(1).double())
        from_bos = counted & (batch.doc_positions == -1)
        first_token.index_add_(0, rows, (losses * from_bos)[real].sum(1).double())
        in_text = counted & (batch.doc_positions >= 0) & (batch.doc_positions < seq_len)  # not later chunks
        positions = batch.doc_positions[in_text]
        by_position[0].index_add_(0, positions, losses[in_text].double())
        by_position[1].index_add_(0, positions, torch.ones_like(positions, dtype=torch.float64))
    model.train()
    n_positions = int((by_position[1] > 0).sum())
    by_position = by_position[:, :n_positions].tolist()
    by_document = by_document.tolist()
    marker = alone.documents.marker
    result = {
        "val_loss": (total / count.clamp(min=1)).item(),
        "val_doc_loss": sum(by_document[0]) / max(1.0, sum(by_document[1])),
        "val_doc_loss_from_second": (sum(by_document[0]) - float(first_token.sum()))
        / max(1.0, sum(by_document[1]) - marker * n_documents),
        "val_doc_loss_sum_by_position": [round(x, 4) for x in by_position[0]],
        "val_doc_count_by_position": [int(x) for x in by_position[1]],
        "val_doc_loss_sum_by_document": [round(x, 4) for x in by_document[0]],
        "val_doc_count_by_document": [int(x) for x in by_document[1]],
    }
    if marker:
        result["val_first_token_loss"] = float(first_token.mean())
        result["val_doc_first_token_loss_by_document"] = [round(x, 4) for x in first_token.tolist()]
    return result


def validation_sets(
    val: data.TokenStream | np.ndarray, eot_id: int, cfg: Config, bos_id: int | None = None
) -> tuple[PackedBatches, PackedBatches]:
    """The validation documents as `evaluate` takes them: rows under the run's packing and flags, and each
    document alone (pad rows, every fix on: the inference setting)."""
    common = dict(eot_id=eot_id, seq_len=cfg.seq_len, batch_size=cfg.batch_size, bos_id=bos_id, shuffle=False)
    packed = PackedBatches(val, packing=cfg.packing, flags=cfg.flags, split="val", **common)
    return packed, PackedBatches(val, packing="pad", split="val", **common)


class EvaluationProgress:
    """A line every 10 seconds of a long evaluation: batches done of all, and the ETA."""

    def __init__(self, batches: int, print_progress) -> None:
        self.total, self.done, self.print = batches, 0, print_progress
        self.start = self.last = time.time()

    def step(self) -> None:
        now = time.time()
        if self.print is not None and self.done and now - self.last >= 10:
            eta = (now - self.start) / self.done * (self.total - self.done)
            self.print(f"eval: {self.done}/{self.total} batches, ETA {run_folder.format_duration(eta)}", flush=True)
            self.last = now
        self.done += 1


# ----------------------------------------------------------------------------------------------
# The run


def train(cfg: Config) -> dict:
    """Run training as configured; returns the last evaluation (on process 0)."""
    rank, world_size, device = run_folder.setup_distributed(cfg)
    try:
        with ExitStack() as held:
            refused = None
            if rank == 0:  # only process 0 writes to out_dir
                try:
                    held.enter_context(run_folder.hold(cfg))
                except ConfigError as e:
                    refused = e
            run_folder.agree(refused)  # every process stops with process 0's error, none waits for it
            return fit(cfg, rank, world_size, device)
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def eval_token_budget(cfg: Config, world_size: int = 1) -> int:
    """eval_tokens, with -1 (the default) made to suit the run: a quarter of the tokens trained between two
    evaluations, within [32,768, 1,000,000] (0: every validation document)."""
    if cfg.eval_tokens >= 0:
        return cfg.eval_tokens
    between = cfg.batch_size * cfg.grad_accum * cfg.seq_len * world_size * min(cfg.eval_interval, cfg.max_iters)
    return min(1_000_000, max(32_768, between // 4))


def fit(cfg: Config, rank: int, world_size: int, device: torch.device) -> dict:
    """The run on this process: data, model and optimizer (from the checkpoint when resuming), the loop."""
    main_process = rank == 0  # the only one that prints, logs, evaluates and writes checkpoints
    print0 = print if main_process else (lambda *args, **kwargs: None)
    out_dir = Path(cfg.out_dir)
    ckpt_path = out_dir / "ckpt.pt"
    checkpoint = run_folder.load_checkpoint(ckpt_path, cfg, world_size) if cfg.resume else None
    if checkpoint is not None:
        run_folder.check_one_run(out_dir, checkpoint)
    if cfg.packing == "pad" and cfg.flags != data.Flags():
        print0(
            "warning: with packing=pad each row holds one document, so the three flags change nothing", file=sys.stderr
        )

    # Data. A model that cannot fit is refused before the data is prepared (the vocabulary is a guess until then).
    guessed_vocab = (cfg.tokenizer_vocab_size if cfg.tokenizer == "bpe" else 256) + cfg.bos
    run_folder.check_fits(model_settings(cfg, guessed_vocab), cfg.batch_size, device)
    failed = None
    if checkpoint is not None:  # a resumed run trains on the shards it started on, or not at all
        shard_path = run_folder.checkpoint_shards(ckpt_path, checkpoint)
    elif main_process:  # process 0 prepares the data first; the others then find it
        try:
            shard_path = prepare_for(cfg, log=print0)
        except (ConfigError, DataError) as e:
            failed = e
    run_folder.agree(failed)
    if checkpoint is None and not main_process:
        shard_path = prepare_for(cfg, log=print0)
    shards = data.load_shards(shard_path)
    if cfg.eval_tokens == -1:  # resolved once, and kept in config.json and the checkpoint: a resumed run
        # (whose max_iters or eval_interval may change) evaluates on the same documents
        saved = checkpoint["config"]["eval_tokens"] if checkpoint is not None else -1
        cfg.eval_tokens = saved if saved >= 0 else eval_token_budget(cfg, world_size)
    val = data.leading_documents(shards.val, shards.eot_id, cfg.eval_tokens)
    if checkpoint is not None and checkpoint["tokenizer_sha256"] != shards.meta["tokenizer_sha256"]:
        raise ConfigError(f"{ckpt_path} was trained with another tokenizer than the shards in {shard_path}")
    enc = data.load_tokenizer(shard_path)
    bos_id = data.start_marker_id(enc) if cfg.bos else None
    enc = data.with_start_marker(enc, bos_id)
    # every split's rows are planned once, here, from the data alone
    train_batches = PackedBatches(
        shards.train,
        shards.eot_id,
        cfg.seq_len,
        cfg.batch_size,
        cfg.packing,
        flags=cfg.flags,
        bos_id=bos_id,
        seed=cfg.seed,
        rank=rank,
        world_size=world_size,
    )
    val_packed, val_alone = validation_sets(val, shards.eot_id, cfg, bos_id)

    # Model and optimizer, from the checkpoint when resuming.
    torch.manual_seed(cfg.seed)
    model_config = model_settings(cfg, enc.n_vocab)
    run_folder.check_fits(model_config, cfg.batch_size, device)
    model = GPT(model_config).to(device)
    if world_size > 1:
        torch.manual_seed(cfg.seed + rank)  # the same init everywhere, different dropout masks per process
    optimizer = make_optimizer(model, cfg, device)
    start_step = 0
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        train_batches.load_state_dict(checkpoint["data"])
        run_folder.set_rng_states(checkpoint["rng"][rank])
        start_step = checkpoint["step"]
    # Three handles on one set of weights: `model` is saved, clipped and sampled from; `fast_model` (compiled
    # when asked) evaluates; `training_model` trains, wrapped under torchrun to average gradients.
    fast_model = torch.compile(model) if cfg.compile else model
    training_model = fast_model
    if world_size > 1:
        ddp_devices = [device.index] if device.type == "cuda" else None
        training_model = DistributedDataParallel(fast_model, device_ids=ddp_devices, broadcast_buffers=False)
    precision = autocast(device, cfg.dtype)

    run_id = (checkpoint or {}).get("run_id") or secrets.token_hex(8)
    files = run_folder.RunFiles(out_dir, run_id, fresh=checkpoint is None, enabled=main_process)
    if main_process:
        settings = json.dumps({"run_id": run_id, **dataclasses.asdict(cfg)}, indent=1)
        run_folder.write_atomically(files.path("config.json"), settings)
    log = run_folder.MetricsLog(files, cfg, start_step if checkpoint else None, world_size, enabled=main_process)
    checkpoints = run_folder.Checkpointer(files, cfg, model_config, shard_path, shards, enc)
    print0(
        f"model: {model.num_params() / 1e6:.2f}M parameters, pos_emb={cfg.pos_emb}, device={device}, "
        f"attention={attention_impl(cfg.doc_mask, cfg.attn_impl, device)}"
        + (f", {world_size} processes" if world_size > 1 else "")
    )
    print0(
        f"run: {cfg.max_iters} steps of {log.tokens_per_step:,} tokens, packing={cfg.packing}, bos={cfg.bos}, "
        f"doc_mask={cfg.doc_mask}, reset_position_ids={cfg.reset_position_ids}, "
        f"mask_boundary_loss={cfg.mask_boundary_loss}" + (f", resuming after step {start_step}" if checkpoint else "")
    )
    packing_statistics = train_batches.statistics()
    print0(f"data: {data.describe_packing(cfg.packing, packing_statistics)}")
    if checkpoint is None:
        log.write({"step": 0, "packing_statistics": packing_statistics})
    print0(f"eval: {len(val):,} validation tokens ({len(val_alone.documents):,} documents) per evaluation")

    # The loop. The loss stays on the device between log steps: checking it every step would wait for the GPU.
    result: dict = {}
    nonfinite = torch.zeros((), dtype=torch.bool, device=device)
    kept = f"the checkpoint of step {start_step} is kept in {ckpt_path}" if checkpoint else "no checkpoint was written"
    with run_folder.StopRequest() as stop, log, files:
        for step in range(start_step + 1, cfg.max_iters + 1):
            lr = lr_at(step - 1, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micro_batches = [train_batches.next().to(device) for _ in range(cfg.grad_accum)]
            loss = accumulate_gradients(training_model, micro_batches, precision, model_config)
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            nonfinite |= ~torch.isfinite(loss)
            log.count(micro_batches)

            last = step == cfg.max_iters
            stopping = stop.agreed(step, cfg.log_interval, device)
            should_log = step % cfg.log_interval == 0 or last or stopping
            should_eval = step % cfg.eval_interval == 0 or last
            if (should_log or should_eval) and nonfinite.item():  # before anything is logged or saved
                raise TrainingDiverged(
                    f"training loss became non-finite by step {step} (last value {loss.item()}); "
                    f"{checkpoints.kept or kept}"
                )
            if should_log:
                log.training(step, loss, lr)
            if should_eval:
                t_eval = time.time()
                if main_process:  # the unwrapped model: a DDP forward on one process alone would hang
                    result = {
                        "step": step,
                        **evaluate(fast_model, model_config, val_packed, val_alone, device, precision, print0),
                    }
                    if not (math.isfinite(result["val_loss"]) and math.isfinite(result["val_doc_loss"])):
                        raise TrainingDiverged(
                            f"validation loss is non-finite at step {step}; {checkpoints.kept or kept}"
                        )
                    log.write(result)
                checkpoints.save(step, model, optimizer, train_batches, result)
                log.evaluated(result, time.time() - t_eval)
            if stopping and not last:
                checkpoints.save(step, model, optimizer, train_batches, result)
                print0(f"stopped after step {step}; resume with: python train.py --out_dir={cfg.out_dir} --resume=true")
                return result

    # The end: a short sample from the trained model.
    if main_process and cfg.sample_prompt and cfg.sample_tokens and result:
        prompt = torch.tensor([data.document_opening(enc, cfg.sample_prompt)], device=device)
        with precision:
            out = model.eval().generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=50, stop_token=shards.eot_id)
        text = data.decoded(enc, out[0].tolist())
        print0(f"\nfinal val_doc_loss {result['val_doc_loss']:.4f} (val_loss {result['val_loss']:.4f})")
        print0(f"sample:\n{text}")
    return result


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(__doc__))
        return 0
    first_process = int(os.environ.get("RANK", "0")) == 0
    cfg = None
    try:
        cfg = parse_config(argv)
        train(cfg)
    except (ConfigError, DataError, TrainingDiverged, SaveFailed) as e:
        if first_process:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # a second stop signal (the first finishes the step and saves), or one before
        if first_process:
            resumable = cfg is not None and (Path(cfg.out_dir) / "ckpt.pt").exists()
            resume = f"; resume from the last checkpoint with: python train.py --out_dir={cfg.out_dir} --resume=true"
            print(
                f"\ninterrupted: stopped at once, nothing half-written kept{resume if resumable else ''}",
                file=sys.stderr,
            )
        return interrupted_exit_code(e)
    return 0


if __name__ == "__main__":
    run_main(main)
