"""Train a GPT on packed documents.

    python train.py                                   # the CPU quickstart on the built-in corpus
    python train.py configs/gpt2_small_gpu.toml       # a config file
    python train.py --doc_mask=false --max_iters=100  # any field of config.Config as --key=value (--help)

Writes out_dir/config.json, metrics.jsonl and ckpt.pt. The recipe, top to bottom: model, optimizer, loss,
evaluation, several processes, the metrics log, then the run in its steps: data, model, the loop, a sample,
and the summary it ends with. A stop signal (Ctrl-C, SIGTERM, SIGHUP) finishes the step, saves the checkpoint
and exits with 128 + its number: the run is unfinished.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import checkpoints
import shards
from config import Config, Interrupted, help_text, interrupted_exit_code, parse_config, resolve_device, run_main
from data import Batch, DataError, Flags, PackedBatches, describe_packing
from files import (
    ConfigError,
    Progress,
    RunFiles,
    SaveFailed,
    format_duration,
    hold,
    read_metrics,
    shell_command,
    write_atomically,
)
from model import GPT, GPTConfig, attention_impl, attention_mask

if TYPE_CHECKING:
    from pretrained import Pretrained


class TrainingDiverged(Exception):
    """The loss became non-finite."""


# ----------------------------------------------------------------------------------------------
# Model, optimizer


def model_settings(cfg: Config, vocab_size: int) -> GPTConfig:
    names = ("seq_len", "n_layer", "n_head", "n_embd", "dropout", "bias", "gelu", "pos_emb")
    same = {name: getattr(cfg, name) for name in names}
    return GPTConfig(vocab_size=math.ceil(vocab_size / 64) * 64, attn_impl=cfg.attn_impl, **same)  # 64: fast on GPU


def check_fits(config: GPTConfig, batch_size: int, device: torch.device) -> None:
    """Refuse a model that cannot fit: weights, gradients and AdamW state (16 bytes a parameter) plus one fp32
    copy of the logits are a lower bound on what training needs."""
    d, T = config.n_embd, config.seq_len
    params = config.vocab_size * d + config.n_layer * (12 * d * d + 4 * d) + 2 * d
    params += T * d if config.pos_emb == "learned" else 0
    need = 16 * params + 4 * batch_size * T * config.vocab_size
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ConfigError(
            f"the model ({params / 1e6:,.1f}M parameters, {batch_size} x {T} tokens a micro-batch) needs about "
            f"{need / 1e9:,.1f} GB to train on {device.type}, and this machine has {have / 1e9:,.1f} GB"
        )


def autocast(device: torch.device, dtype: str = "auto"):
    """The compute precision, in one place: bfloat16 autocast on CUDA (dtype auto), float32 elsewhere."""
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def warmup_steps(cfg: Config) -> int:
    """warmup_iters, or by default (-1) a tenth of max_iters: a run made longer warms up longer, since a
    short warmup at a high learning rate split small learned-position runs into fast and slow ones
    (results/LOG.md, 2026-12-02). The quickstart's 600 steps get 60."""
    return cfg.warmup_iters if cfg.warmup_iters >= 0 else cfg.max_iters // 10


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup, then cosine decay from lr to min_lr at max_iters."""
    warmup = warmup_steps(cfg)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.max_iters - warmup)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - cfg.min_lr)


def make_optimizer(model: GPT, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")


# ----------------------------------------------------------------------------------------------
# The loss and evaluation


def token_losses(model: torch.nn.Module, batch: Batch, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The one loss of this repo: each token's cross-entropy (B, T), 0 where the target does not count, and
    which targets count. The attention mask is built here, once per batch, outside the (compiled) model."""
    mask = attention_mask(batch.doc_ids, batch.doc_mask, config.attn_impl, config.flex_mask)
    return model(batch.inputs, batch.position_ids, mask, batch.targets), batch.counted


def accumulate_gradients(
    model: torch.nn.Module, micro_batches: list[Batch], precision, config: GPTConfig
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
    """On the fixed validation documents. val_loss: `packed`, rows under the run's packing and flags.
    val_doc_loss: `alone`, each document alone from its start (the inference setting), with its first token
    under the marker; val_doc_loss_from_second: the targets both conventions share. Sums by position in the
    text (position p predicts the token after the p-th) and by document are kept, so any band or subset can
    be scored from metrics.jsonl. Progress goes to `print_progress` every 10 seconds (None: nowhere)."""
    model.eval()
    n_batches = -(-len(packed) // packed.batch_size) - (-len(alone) // alone.batch_size)
    progress = evaluation_progress(n_batches, print_progress)

    def losses_of(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Batch]:
        progress.advance(1)
        batch = batch.to(device)
        with precision:
            return *token_losses(model, batch, model_config), batch

    total = count = torch.zeros((), device=device)
    for batch in packed.all_batches():
        losses, counted, _ = losses_of(batch)
        total, count = total + losses.sum(), count + counted.sum()
    document_of_row = torch.from_numpy(alone.document_of_rows()).to(device)  # a long document has several rows
    n_documents, seq_len, marker = len(alone.documents), alone.seq_len, alone.documents.marker
    by_position = torch.zeros(2, seq_len, dtype=torch.float64, device=device)  # loss sum, counted targets
    by_document = torch.zeros(3, n_documents, dtype=torch.float64, device=device)  # and the first token's loss
    for first_row, batch in zip(range(0, len(alone), alone.batch_size), alone.all_batches()):
        losses, counted, batch = losses_of(batch)
        rows = document_of_row[first_row : first_row + alone.batch_size]
        real = slice(0, len(rows))  # the last batch is filled up with empty rows
        from_bos = counted & (batch.doc_positions == -1)
        sums = [losses[real].sum(1), counted[real].sum(1), (losses * from_bos)[real].sum(1)]
        by_document.index_add_(1, rows, torch.stack([x.double() for x in sums]))
        # a document's first row holds its text up to position seq_len - 1 - marker; a later chunk starts
        # there or beyond, with nothing before it, and would make the last position's mean a row start's
        in_text = counted & (batch.doc_positions >= 0) & (batch.doc_positions < seq_len - marker)
        positions = batch.doc_positions[in_text]
        by_position.index_add_(
            1, positions, torch.stack([losses[in_text].double(), torch.ones_like(positions, dtype=torch.float64)])
        )
    model.train()
    by_position = by_position[:, : int((by_position[1] > 0).sum())].tolist()
    (loss_sums, counts, first_token), first_token_sum = by_document.tolist(), by_document[2].sum().item()
    result = {
        "val_loss": (total / count.clamp(min=1)).item(),
        "val_doc_loss": sum(loss_sums) / max(1.0, sum(counts)),
        "val_doc_loss_from_second": (sum(loss_sums) - first_token_sum) / max(1.0, sum(counts) - marker * n_documents),
        "val_doc_loss_sum_by_position": [round(x, 4) for x in by_position[0]],
        "val_doc_count_by_position": [int(x) for x in by_position[1]],
        "val_doc_loss_sum_by_document": [round(x, 4) for x in loss_sums],
        "val_doc_count_by_document": [int(x) for x in counts],
    }
    if marker:
        result["val_first_token_loss"] = by_document[2].mean().item()
        result["val_doc_first_token_loss_by_document"] = [round(x, 4) for x in first_token]
    return result


def evaluation_progress(n_batches: int, print_progress) -> Progress:
    return Progress(
        n_batches,
        lambda p: f"eval: {p.done:.0f}/{p.total:.0f} batches, ETA {p.eta()}",
        print_progress or (lambda line: None),
    )


def validation_sets(
    val: np.ndarray, eot_id: int, cfg: Config, bos_id: int | None = None
) -> tuple[PackedBatches, PackedBatches]:
    """The validation documents as `evaluate` takes them: packed as the run packs, and each alone."""
    common = dict(eot_id=eot_id, seq_len=cfg.seq_len, batch_size=cfg.batch_size, bos_id=bos_id, shuffle=False)
    packed = PackedBatches(val, packing=cfg.packing, flags=cfg.flags, split="val", **common)
    return packed, PackedBatches(val, packing="pad", split="val", **common)


def eval_token_budget(cfg: Config, world_size: int = 1) -> int:
    """eval_tokens, with -1 made to suit the run: a quarter of the tokens trained between two evaluations,
    within [32,768, 1,000,000]."""
    if cfg.eval_tokens >= 0:
        return cfg.eval_tokens
    between = cfg.batch_size * cfg.grad_accum * cfg.seq_len * world_size * min(cfg.eval_interval, cfg.max_iters)
    return min(1_000_000, max(32_768, between // 4))


# ----------------------------------------------------------------------------------------------
# Several processes (torchrun)


def setup_distributed(cfg: Config) -> tuple[int, int, torch.device]:
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


class Stopped(Interrupted):
    """A stop signal the run obeyed: it finished the step in flight and saved its checkpoint, unfinished. Exit
    128 + the signal's number, as for any interrupt, so that `python train.py && python export_hf.py ...` does
    not export a run that did not finish."""

    def __init__(self, signum: int, step: int, out_dir: str) -> None:
        super().__init__(signum)
        self.step, self.out_dir = step, out_dir


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


# ----------------------------------------------------------------------------------------------
# The metrics log


class MetricsLog:
    """out_dir/metrics.jsonl (and wandb when asked for), and the training lines: the throughput since the
    previous record, evaluations excluded, and the ETA, on a clock that starts at the `with` block."""

    def __init__(self, files: RunFiles, cfg: Config, resume_step: int | None, world_size=1, enabled=True) -> None:
        self.files, self.enabled, self.world_size, self.wandb_run = files, enabled, world_size, None
        self.first_step, self.max_iters = resume_step or 0, cfg.max_iters
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * world_size
        self.counted_since_log: torch.Tensor | int = 0  # on the device until a log step: no per-step sync
        if not enabled:  # processes other than 0 under DDP
            return
        path = files.path("metrics.jsonl")  # a resumed log drops what was logged after the checkpoint
        kept = [] if resume_step is None else [line for line, r in read_metrics(path) if r["step"] <= resume_step]
        write_atomically(path, "".join(line + "\n" for line in kept))
        try:
            if cfg.wandb:
                import wandb

                name, folder = cfg.wandb_run_name or files.out_dir.name, os.environ.get("WANDB_DIR", str(files.out_dir))
                config = dataclasses.asdict(cfg)
                self.wandb_run = wandb.init(
                    project=cfg.wandb_project, name=name, config=config, resume="allow", dir=folder
                )
        except Exception as e:
            print(
                f"warning: wandb logging is off ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                "set WANDB_MODE=offline to log without an account",
                file=sys.stderr,
            )

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        path = self.files.path("metrics.jsonl")
        try:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk, a file-size limit: one line, as for a checkpoint
            raise SaveFailed(f"could not write {path} ({e.strerror or e})") from None
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if not isinstance(v, list)}, step=record["step"])

    def count(self, batches: list[Batch]) -> None:
        self.counted_since_log = self.counted_since_log + sum(b.counted.sum() for b in batches)

    def training(self, step: int, loss: torch.Tensor, lr: float) -> None:
        if not self.enabled:
            return
        seconds = time.time() - self.t_log
        tok_s = (step - self.step_at_log) * self.tokens_per_step / seconds
        counted_s = float(self.counted_since_log) * self.world_size / seconds
        record = dict(step=step, train_loss=round(loss.item(), 4), lr=lr, tokens_per_sec=round(tok_s))
        self.write({**record, "counted_tokens_per_sec": round(counted_s)})
        self.progress.done = step - self.first_step
        print(
            f"step {step:>5}/{self.max_iters} | loss {record['train_loss']:.4f} | lr {lr:.2e} | "
            f"{tok_s:,.0f} tok/s | ETA {self.progress.eta()}",
            flush=True,
        )
        self.t_log, self.step_at_log, self.counted_since_log = time.time(), step, 0

    def evaluated(self, result: dict, seconds: float) -> None:
        """Print the evaluation (written already, before its checkpoint), whose time is not training's."""
        if self.enabled:
            print(
                f"eval {result['step']:>5} | val_loss {result['val_loss']:.4f} | "
                f"val_doc_loss {result['val_doc_loss']:.4f} | {seconds:.1f}s, checkpoint saved",
                flush=True,
            )
        self.t_log += seconds

    def __enter__(self) -> MetricsLog:
        self.progress = Progress(self.max_iters - self.first_step, str, lambda line: None)  # for the ETA
        self.t_log, self.step_at_log = time.time(), self.first_step
        return self

    def __exit__(self, *exc) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


# ----------------------------------------------------------------------------------------------
# The run, in its steps


def train(cfg: Config) -> dict:
    """Run training as configured; returns the last evaluation (on process 0)."""
    rank, world_size, device = setup_distributed(cfg)
    try:
        start = pretrained_start(cfg, print if rank == 0 else (lambda *args: None))
        with ExitStack() as held:
            refused = None
            if rank == 0:  # only process 0 writes to out_dir
                try:
                    held.enter_context(hold(Path(cfg.out_dir), cfg.resume, cfg.overwrite))
                except ConfigError as e:
                    refused = e
            agree(refused)  # every process stops with process 0's error, none waits for it
            return fit(cfg, rank, world_size, device, start)
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def pretrained_start(cfg: Config, log: Callable[[str], None]) -> Pretrained | None:
    """The weights of the folder init_from names, with its model settings made the run's; read before out_dir
    is touched, so that a folder that cannot serve is refused with nothing written (its tokenizer is compared
    with the run's in build_model, before any run file). None when resuming: the checkpoint holds the weights
    then (the folder may be gone)."""
    if not cfg.init_from or cfg.resume:
        return None
    import pretrained  # only a run that starts from a folder needs it (and safetensors)

    start = pretrained.read_pretrained(Path(cfg.init_from))
    pretrained.adopt_settings(cfg, start, log)
    return start


def adopt_prepared_settings(cfg: Config, folder: Path, log=print) -> None:
    """The data settings a prepared folder was made with become the run's, so that config.json records what
    the run used; a setting given otherwise (not its default) contradicts the data and is refused."""
    meta = shards.load_shards(folder).meta
    made, defaults, adopted = meta["settings"], Config(), []
    same_tokenizer = cfg.tokenizer == meta["tokenizer"] or (  # a .tiktoken file is known by its content
        Path(cfg.tokenizer).is_file()
        and hashlib.sha256(Path(cfg.tokenizer).read_bytes()).hexdigest() == made["tokenizer"]
    )
    used = {
        "tokenizer": cfg.tokenizer if same_tokenizer else meta["tokenizer"],
        "tokenizer_vocab_size": made.get("vocab_size", cfg.tokenizer_vocab_size),
        "tokenizer_train_mb": made.get("tokenizer_train_mb", cfg.tokenizer_train_mb),
        "val_fraction": made["val_fraction"],
        "data_seed": made["seed"],
        "text_field": made["text_field"],
    }
    for key, value in used.items():
        if getattr(cfg, key) == value:
            continue
        if getattr(cfg, key) != getattr(defaults, key):
            raise ConfigError(
                f"{key}={getattr(cfg, key)!r}, but {folder} was prepared with {key}={value!r}: drop the setting to "
                "train on that folder, or give the corpus itself to prepare it with yours"
            )
        setattr(cfg, key, value)
        adopted.append(f"{key}={value!r}")
    if adopted:
        log(f"data: {folder} was prepared with {', '.join(adopted)}; the run uses (and records) those")


def prepared_data(cfg: Config, main_process: bool, log) -> Path:
    """The run's shard folder: a prepared folder given as the dataset (whose data settings the run adopts),
    or the corpus prepared first: process 0 prepares, the others then find it. Preparation (prepare.py and
    corpora.py) is imported only then: training on a prepared folder needs neither."""
    if shards.is_prepared_folder(cfg.dataset):
        adopt_prepared_settings(cfg, Path(cfg.dataset), log)
        return Path(cfg.dataset)
    from prepare import prepare_for

    failed, shard_path = None, None
    if main_process:
        try:
            shard_path = prepare_for(cfg, log=log)
        except (ConfigError, DataError) as e:
            failed = e
    agree(failed)
    return shard_path or prepare_for(cfg, log=log)


@dataclasses.dataclass
class RunData:
    shard_path: Path
    eot_id: int
    tokenizer: object  # the run's tiktoken Encoding, with the start marker when the run has it
    train: PackedBatches
    val_packed: PackedBatches
    val_alone: PackedBatches
    val_tokens: int


def load_data(cfg: Config, state: dict | None, rank: int, world_size: int, device, log) -> RunData:
    """The shards (a resumed run's own, or prepared), the tokenizer, and every split's rows, planned once."""
    guessed_vocab = (cfg.tokenizer_vocab_size if cfg.tokenizer == "bpe" else 256) + cfg.bos
    check_fits(model_settings(cfg, guessed_vocab), cfg.batch_size, device)  # before a long preparation
    ckpt_path = Path(cfg.out_dir) / "ckpt.pt"
    if state is not None:  # a resumed run trains on the shards it started on, or not at all
        shard_path = checkpoints.checkpoint_shards(ckpt_path, state)
    else:
        shard_path = prepared_data(cfg, rank == 0, log)
    prepared = shards.load_shards(shard_path)
    if state is not None and state["tokenizer_sha256"] != prepared.meta["tokenizer_sha256"]:
        raise ConfigError(f"{ckpt_path} was trained with another tokenizer than the shards in {shard_path}")
    if cfg.eval_tokens == -1:  # resolved once, and kept in config.json and the checkpoint: a resumed run
        # (whose max_iters or eval_interval may change) evaluates on the same documents
        saved = state["config"]["eval_tokens"] if state is not None else -1
        cfg.eval_tokens = saved if saved >= 0 else eval_token_budget(cfg, world_size)
    eot_id, enc = prepared.eot_id, shards.load_tokenizer(shard_path)
    val = shards.leading_documents(prepared.val, eot_id, cfg.eval_tokens)
    bos_id = shards.start_marker_id(enc) if cfg.bos else None
    shape = dict(eot_id=eot_id, seq_len=cfg.seq_len, batch_size=cfg.batch_size, packing=cfg.packing, bos_id=bos_id)
    train_rows = PackedBatches(
        prepared.train, flags=cfg.flags, seed=cfg.seed, rank=rank, world_size=world_size, **shape
    )
    val_packed, val_alone = validation_sets(val, eot_id, cfg, bos_id)
    tokenizer = shards.with_start_marker(enc, bos_id)
    return RunData(shard_path, eot_id, tokenizer, train_rows, val_packed, val_alone, len(val))


def build_model(
    cfg: Config, run: RunData, state: dict | None, rank: int, world_size: int, device, start: Pretrained | None = None
):
    """The model and its optimizer, from the checkpoint when resuming (with the data position and RNG), or
    with the weights of a pretrained folder (`start`) and a fresh optimizer."""
    torch.manual_seed(cfg.seed)
    model_config = model_settings(cfg, run.tokenizer.n_vocab)
    if state is not None or start is not None:  # a run from a folder has its rows, not a multiple of 64
        model_config.vocab_size = state["model_config"]["vocab_size"] if state else start.vocab_size(run.tokenizer)
    check_fits(model_config, cfg.batch_size, device)
    model = GPT(model_config).to(device)
    if start is not None:
        start.load_into(model, run.tokenizer)
    if world_size > 1:
        torch.manual_seed(cfg.seed + rank)  # the same init everywhere, different dropout masks per process
    optimizer = make_optimizer(model, cfg, device)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        run.train.load_state_dict(state["data"])
        checkpoints.set_rng_states(state["rng"][rank])
    return model, optimizer


def fit(cfg: Config, rank: int, world_size: int, device: torch.device, start: Pretrained | None = None) -> dict:
    """The run on this process: data, model and optimizer (from the checkpoint when resuming, or from the
    weights of a pretrained folder), the run's files, the loop, a sample."""
    main_process = rank == 0  # the only one that prints, logs, evaluates and writes checkpoints
    print0 = print if main_process else (lambda *args, **kwargs: None)
    out_dir = Path(cfg.out_dir)
    state = checkpoints.load_checkpoint(out_dir / "ckpt.pt", cfg, world_size) if cfg.resume else None
    if cfg.packing == "pad" and cfg.flags != Flags():
        print0(
            "warning: with packing=pad each row holds one document, so the three flags change nothing", file=sys.stderr
        )
    if cfg.max_iters <= warmup_steps(cfg):
        print0(
            f"warning: max_iters={cfg.max_iters} is not past warmup_iters={warmup_steps(cfg)}: the learning rate never "
            "reaches its peak or decays; give warmup_iters about a tenth of max_iters",
            file=sys.stderr,
        )
    run = load_data(cfg, state, rank, world_size, device, print0)
    model, optimizer = build_model(cfg, run, state, rank, world_size, device, start)
    start_step = state["step"] if state else 0

    run_id = (state or {}).get("run_id") or secrets.token_hex(8)
    files = RunFiles(out_dir, run_id, fresh=state is None, enabled=main_process)
    if main_process:
        write_atomically(files.path("config.json"), json.dumps({"run_id": run_id, **dataclasses.asdict(cfg)}, indent=1))
    log = MetricsLog(files, cfg, start_step if state else None, world_size, enabled=main_process)
    meta = shards.load_shards(run.shard_path).meta
    saver = checkpoints.Checkpointer(files, cfg, model.config, run.shard_path, meta, run.tokenizer)
    print0(
        f"model: {model.num_params() / 1e6:.2f}M parameters, pos_emb={cfg.pos_emb}, device={device}, "
        f"attention={attention_impl(cfg.doc_mask, cfg.attn_impl, device)}"
        + (f", {world_size} processes" if world_size > 1 else "")
    )
    print0(
        f"run: {cfg.max_iters} steps of {log.tokens_per_step:,} tokens, packing={cfg.packing}, bos={cfg.bos}, "
        f"doc_mask={cfg.doc_mask}, reset_position_ids={cfg.reset_position_ids}, "
        f"mask_boundary_loss={cfg.mask_boundary_loss}" + (f", resuming after step {start_step}" if state else "")
    )
    statistics = run.train.statistics()
    print0(f"data: {describe_packing(cfg.packing, statistics)}")
    if state is None:
        log.write({"step": 0, "packing_statistics": statistics})
    print0(f"eval: {run.val_tokens:,} validation tokens ({len(run.val_alone.documents):,} documents) per evaluation")
    with files:
        result = loop(cfg, run, model, optimizer, start_step, log, saver, device, world_size)
    if main_process and cfg.sample_prompt and cfg.sample_tokens and result.get("step") == cfg.max_iters:
        prompt = torch.tensor([shards.document_opening(run.tokenizer, cfg.sample_prompt)], device=device)
        with autocast(device, cfg.dtype):
            out = model.eval().generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=50, stop_token=run.eot_id)
        print0(f"\nsample:\n{shards.decoded(run.tokenizer, out[0].tolist())}")
    return result


def loop(cfg, run: RunData, model, optimizer, start_step: int, log: MetricsLog, saver, device, world_size) -> dict:
    """The training steps, with logging, evaluation and checkpoints; returns the last evaluation. The loss
    stays on the device between log steps: checking it every step would wait for the GPU."""
    main_process = log.enabled
    # Three handles on one set of weights: `model` is saved, clipped and sampled from; `fast_model` (compiled
    # when asked) evaluates; `training_model` trains, wrapped under torchrun to average gradients.
    fast_model = torch.compile(model) if cfg.compile else model
    training_model = data_parallel(fast_model, device) if world_size > 1 else fast_model
    precision = autocast(device, cfg.dtype)
    ckpt_path = Path(cfg.out_dir) / "ckpt.pt"
    kept = f"the checkpoint of step {start_step} is kept in {ckpt_path}" if start_step else "no checkpoint was written"
    result: dict = {}
    nonfinite = torch.zeros((), dtype=torch.bool, device=device)
    with StopRequest() as stop, log:
        for step in range(start_step + 1, cfg.max_iters + 1):
            lr = lr_at(step - 1, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micro_batches = [run.train.next().to(device) for _ in range(cfg.grad_accum)]
            loss = accumulate_gradients(training_model, micro_batches, precision, model.config)
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
                    f"training loss became non-finite by step {step} (last value {loss.item()}); {saver.kept or kept}"
                )
            if should_log:
                log.training(step, loss, lr)
            if should_eval:
                t_eval = time.time()
                if main_process:  # the unwrapped model: a DDP forward on one process alone would hang
                    result = {
                        "step": step,
                        **evaluate(fast_model, model.config, run.val_packed, run.val_alone, device, precision, print),
                    }
                    if not (math.isfinite(result["val_loss"]) and math.isfinite(result["val_doc_loss"])):
                        raise TrainingDiverged(f"validation loss is non-finite at step {step}; {saver.kept or kept}")
                    log.write(result)
                saver.save(step, model, optimizer, run.train, result)
                log.evaluated(result, time.time() - t_eval)
            if stopping:  # raised at the last step too, so that a study running this run stops as asked
                if not last:  # the last step's checkpoint is saved above, with its evaluation
                    saver.save(step, model, optimizer, run.train, result)
                raise Stopped(stopping, step, cfg.out_dir)
    return result


def data_parallel(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """The model wrapped to average gradients over the processes. Its only buffers (RoPE's tables) are the
    same on every process, so they need no sync at each forward."""
    ddp_devices = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ddp_devices, forward_sync_buffers=False)


# ----------------------------------------------------------------------------------------------
# The end of a run


def train_command(cfg: Config, world_size: int, *settings: str) -> str:
    """The command that resumes the run in cfg.out_dir, as many processes as wrote it, quoted to paste."""
    launcher = ["python"] if world_size == 1 else ["torchrun", f"--nproc_per_node={world_size}"]
    return shell_command(*launcher, "train.py", f"--out_dir={cfg.out_dir}", "--resume=true", *settings)


def run_summary(cfg: Config, seconds: float, world_size: int = 1, stopped_after: int | None = None) -> str:
    """The lines every run ends with: the losses of its last evaluation (the last one metrics.jsonl holds),
    the wall time, the checkpoint and the commands that come next; a stopped run's only one is its resume."""
    out_dir = Path(cfg.out_dir)
    try:
        records = [record for _, record in read_metrics(out_dir / "metrics.jsonl")]
    except ConfigError:  # a damaged log: what else the run has is still summarised
        records = []
    evaluation = next((r for r in reversed(records) if "val_doc_loss" in r), None)
    trained = next((r for r in reversed(records) if "train_loss" in r), None)
    if stopped_after is None:
        lines = [f"\nrun finished: {cfg.max_iters} steps, {format_duration(seconds)} wall time"]
    else:
        lines = [f"\nrun stopped after step {stopped_after} of {cfg.max_iters}, {format_duration(seconds)} wall time"]
    if evaluation is not None:
        names = ["val_doc_loss", "val_loss"] + ["val_doc_loss_from_second"] * cfg.bos
        losses = " | ".join(f"{name} {evaluation[name]:.4f}" for name in names if name in evaluation)
        final = stopped_after is None and evaluation["step"] == cfg.max_iters
        lines.append(f"  final {losses}" if final else f"  last evaluation (step {evaluation['step']}): {losses}")
    elif trained is not None:
        lines.append(f"  no evaluation; last train_loss {trained['train_loss']:.4f} (step {trained['step']})")
    else:
        lines.append("  no evaluation and no training step logged")
    ckpt = out_dir / "ckpt.pt"
    lines.append(f"  checkpoint: {ckpt}" if ckpt.is_file() else "  checkpoint: none written")
    if stopped_after is not None:
        return "\n".join([*lines, f"  resume:   {train_command(cfg, world_size)}"])
    out = f"--out_dir={cfg.out_dir}"
    return "\n".join(
        [
            *lines,
            f"  sample:   {shell_command('python', 'sample.py', out)}",
            f"  export:   {shell_command('python', 'export_hf.py', out, f'--to=hf/{out_dir.resolve().name}')}",
            f"  continue: {train_command(cfg, world_size, f'--max_iters={2 * cfg.max_iters}')}"
            "  (the learning-rate schedule is re-timed: README, Runs)",
        ]
    )


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(__doc__))
        return 0
    started = time.time()
    first_process = int(os.environ.get("RANK", "0")) == 0
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = None
    try:
        cfg = parse_config(argv)
        train(cfg)
    except (ConfigError, DataError, TrainingDiverged, SaveFailed) as e:
        if first_process:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except Stopped as e:  # the first stop signal: the step finished and its checkpoint is saved
        if e.step == cfg.max_iters:  # during the last step: the run is finished all the same
            if first_process:
                print(run_summary(cfg, time.time() - started, world_size))
            return 0
        if first_process:
            print(run_summary(cfg, time.time() - started, world_size, stopped_after=e.step), flush=True)
            print(
                f"interrupted: {e} stopped the run after step {e.step} with its checkpoint saved; exit "
                f"{interrupted_exit_code(e)} (unfinished); resume it with: {train_command(cfg, world_size)}",
                file=sys.stderr,
            )
        return interrupted_exit_code(e)
    except KeyboardInterrupt as e:  # a second stop signal (the first finishes the step and saves), or one before
        if first_process:
            resumable = cfg is not None and (Path(cfg.out_dir) / "ckpt.pt").exists()
            resume = f"; resume from the last checkpoint with: {train_command(cfg, world_size)}" if resumable else ""
            print(f"\ninterrupted: stopped at once, nothing half-written kept{resume}", file=sys.stderr)
        return interrupted_exit_code(e)
    if first_process:
        print(run_summary(cfg, time.time() - started, world_size))
    return 0


if __name__ == "__main__":
    run_main(main)
