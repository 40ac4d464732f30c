"""What a run reports, computed apart from the recipe: how a packing holds the documents, the evaluation's sums
by position and by document (from which any band or subset of the validation documents can be scored), and
the summary a run ends with."""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from cli import format_duration
from config import Config
from data import Batch, Documents, PackedBatches, Rows
from errors import ConfigError
from run.folder import read_metrics

if TYPE_CHECKING:  # the model (and torch.compile's import) only for the type: the benchmarks' children import this
    from model import GPT
    from run import Session

# ----------------------------------------------------------------------------------------------
# Packing statistics


def packing_statistics(documents: Documents, rows: Rows, seq_len: int, max_rows: int = 8192) -> dict:
    """How a packing holds the documents. From every row: the padding, the documents split or cut and the
    stream's tokens in no row; per row and token (documents a row, tokens with their document's start, tokens
    that could see another document) from up to max_rows rows spread over the split, `rows_sampled` of them."""
    chosen = np.unique(np.linspace(0, len(rows) - 1, min(max_rows, len(rows))).astype(np.int64))
    index, _ = rows.index(chosen, seq_len + 1)
    index = index[:, :-1]  # the input slots
    real = index >= 0
    document = np.where(real, documents.document_of(np.maximum(index, 0)), -1)
    run_starts = real & np.concatenate([np.ones((len(chosen), 1), bool), document[:, 1:] != document[:, :-1]], 1)
    column = np.arange(seq_len)[None, :]
    run_start_column = np.maximum.accumulate(np.where(run_starts, column, 0), axis=1)
    from_document_start = index - documents.starts[np.maximum(document, 0)]  # counting the BOS
    holds_start = real & (from_document_start == column - run_start_column)
    sees_another = real & (np.cumsum(run_starts, axis=1) > 1)
    whole = documents.starts + documents.lengths  # a document is whole when one piece holds all of it
    by_start = np.argsort(rows.start, kind="stable")
    piece = by_start[np.maximum(np.searchsorted(rows.start[by_start], documents.starts, side="right") - 1, 0)]
    is_whole = (rows.start[piece] <= documents.starts) & (whole <= rows.start[piece] + rows.length[piece])
    n_real = real.sum()
    real_inputs = np.minimum(np.add.reduceat(rows.length, rows.offsets[:-1]), seq_len)  # every row, its T input slots
    return {
        "rows": len(rows),
        "rows_sampled": len(chosen),
        "documents": len(documents),
        "documents_per_row": float(run_starts.sum(1).mean()),
        "padding_share": float(1 - real_inputs.sum() / (len(rows) * seq_len)),
        "documents_split_or_cut": float(1 - is_whole.mean()),
        "tokens_with_their_document_start_in_the_row": float(holds_start.sum() / max(1, n_real)),
        "tokens_seeing_another_document_without_the_mask": float(sees_another.sum() / max(1, n_real)),
        "tokens_in_no_row": tokens_in_no_row(documents, rows),
    }


def tokens_in_no_row(documents: Documents, rows: Rows) -> int:
    """The document stream's tokens that no row holds: under concat the split's last (n_tokens - 1) mod T, too
    few for a row of T + 1 (Megatron-LM leaves them out too); under pad and bestfit none."""
    order = np.argsort(rows.start, kind="stable")
    start, end = rows.start[order], rows.start[order] + rows.length[order]
    reached = np.concatenate([[0], np.maximum.accumulate(end)[:-1]])  # how far the pieces before each reach
    return int(documents.n_tokens - np.maximum(end - np.maximum(start, reached), 0).sum())


def plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def describe_packing(packing: str, stats: dict) -> str:
    sampled = stats["rows_sampled"] < stats["rows"]
    return (
        f"packing={packing}: {stats['rows']:,} rows, {stats['padding_share']:.1%} padding, "
        f"{stats['documents_split_or_cut']:.1%} of documents split or cut; "
        + (f"in {stats['rows_sampled']:,} rows spread over the split: " if sampled else "")
        + f"{stats['documents_per_row']:.2f} documents a row, "
        f"{stats['tokens_with_their_document_start_in_the_row']:.1%} of tokens with their document's start in "
        f"the row, {stats['tokens_seeing_another_document_without_the_mask']:.1%} that could see another "
        "document without the mask"
        + (
            f"; the split's last {plural(stats['tokens_in_no_row'], 'token')} in no row (too few for one)"
            if stats["tokens_in_no_row"]
            else ""
        )
        + (
            f"; {plural(stats['rows_left_out_each_epoch'], 'row')} left out of each epoch (its last, partial "
            "global batch; each epoch's shuffle leaves out others)"
            if stats.get("rows_left_out_each_epoch")
            else ""
        )
    )


def batches_statistics(batches: PackedBatches) -> dict:
    """What every run logs at its start: its training rows' packing statistics, and how many rows each
    epoch leaves out."""
    statistics = packing_statistics(batches.documents, batches.rows, batches.seq_len)
    return {**statistics, "rows_left_out_each_epoch": batches.rows_left_out_each_epoch()}


# ----------------------------------------------------------------------------------------------
# The evaluation's sums


class DocumentLosses:
    """The losses of the validation documents over some rows of them, each target credited to the document and
    the position in its text that it belongs to (found from the rows' stream indexes, so any packing serves):
    sums by position (position p predicts the token after the p-th) and by document, from each document's first
    text token on (a BOS is never scored), from its second, and its first alone. Scored `alone` (rows under
    the document mask and reset positions: every document as if from position 0) these are val_doc_loss and
    its sums; scored `in_context` (the run's own packed rows and flags, after the documents before it), the
    same targets from the second token as val_doc_loss_in_context. With `token_bytes` (each id's UTF-8 bytes,
    0 for EOT and BOS) also bits per byte: nats / ln 2 / the bytes of the targets' text."""

    def __init__(self, rows: PackedBatches, device: torch.device, token_bytes: torch.Tensor | None = None) -> None:
        self.rows, self.device, self.token_bytes, self.has_bytes = rows, device, token_bytes, token_bytes is not None
        self.n_documents, self.seq_len = len(rows.documents), rows.seq_len
        self.has_marker = rows.documents.has_marker
        self.by_position = torch.zeros(2, self.seq_len, dtype=torch.float64, device=device)  # sums, counts
        # per document: losses and counts from the first text token, losses and counts from the second, the
        # first token's loss, the bytes of the targets from the second
        self.by_document = torch.zeros(6, self.n_documents, dtype=torch.float64, device=device)
        self.every_target = torch.zeros(3, dtype=torch.float64, device=device)  # losses, counts, bytes

    def add(self, first_row: int, losses: torch.Tensor, counted: torch.Tensor, batch: Batch) -> None:
        """The losses of the batch of `rows`' rows from first_row on (the last batch is filled up with empty rows)."""
        n_rows = min(self.rows.batch_size, len(self.rows) - first_row)
        index, _ = self.rows.rows.index(np.arange(first_row, first_row + n_rows), self.seq_len + 1)
        target = np.maximum(index[:, 1:], 0)
        document = torch.from_numpy(self.rows.documents.document_of(target)).to(self.device)
        position = torch.from_numpy(self.rows.documents.doc_positions(target)).to(self.device)
        real = torch.from_numpy(index[:, 1:] >= 0).to(self.device)
        every = [(losses * counted).sum(), counted.sum(), self.bytes_of(batch.targets, counted).sum()]
        self.every_target += torch.stack([x.double() for x in every])
        losses, counted = losses[:n_rows].double(), counted[:n_rows] & real & (position >= 0)
        from_second = counted & (position >= 1)
        n_bytes = self.bytes_of(batch.targets[:n_rows], from_second)
        first = counted & (position == 0)
        sums = [losses * counted, counted, losses * from_second, from_second, losses * first, n_bytes]
        self.by_document.index_add_(1, document[counted], torch.stack([x.double()[counted] for x in sums]))
        # a document's later chunk scored alone starts with nothing before it, at doc position seq_len (less one
        # for a BOS) or beyond: binned by position it would make the last positions' means a row start's
        last_position = self.seq_len - 1 if self.has_marker else self.seq_len
        binned = from_second & (position <= last_position)
        ones = torch.ones_like(losses[binned])
        self.by_position.index_add_(1, position[binned] - 1, torch.stack([losses[binned], ones]))

    def bytes_of(self, targets: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        if not self.has_bytes:
            return torch.zeros_like(targets, dtype=torch.float64)
        return self.token_bytes[targets.clamp(min=0)] * where

    def packed_result(self) -> dict:
        """val_loss: every counted target of these rows, as training counts them."""
        total, count, n_bytes = self.every_target.tolist()
        bpb = {"val_bpb": bits_per_byte(total, n_bytes)} if self.has_bytes else {}
        return {"val_loss": total / max(1.0, count), **bpb}

    def scored_positions(self) -> torch.Tensor:
        return self.by_position[:, : int((self.by_position[1] > 0).sum())]

    def result(self) -> dict:
        """Scored alone: val_doc_loss, val_doc_loss_from_second and the sums metrics.jsonl keeps."""
        sums, counts, second, n_second, first_token, n_bytes = self.by_document.tolist()
        by_position = self.scored_positions().tolist()
        result = {
            "val_doc_loss": sum(sums) / max(1.0, sum(counts)),
            "val_doc_loss_from_second": sum(second) / max(1.0, sum(n_second)),
            "val_doc_loss_sum_by_position": rounded(by_position[0]),
            "val_doc_count_by_position": [int(x) for x in by_position[1]],
            "val_doc_loss_sum_by_document": rounded(sums),
            "val_doc_count_by_document": [int(x) for x in counts],
        }
        if self.has_marker:
            result["val_first_token_loss"] = sum(first_token) / max(1, self.n_documents)
            result["val_doc_first_token_loss_by_document"] = rounded(first_token)
        if self.has_bytes:
            result["val_doc_bpb_from_second"] = bits_per_byte(sum(second), sum(n_bytes))
            result["val_doc_bytes_from_second_by_document"] = [int(x) for x in n_bytes]
        return result

    def in_context_result(self) -> dict:
        """Scored in context: the same targets from the second token, after the documents before them."""
        second, n_second, n_bytes = (self.by_document[i].tolist() for i in (2, 3, 5))
        result = {
            "val_doc_loss_in_context": sum(second) / max(1.0, sum(n_second)),
            "val_doc_loss_in_context_sum_by_position": rounded(self.scored_positions()[0].tolist()),
            "val_doc_loss_in_context_sum_by_document": rounded(second),
        }
        if self.has_bytes:
            result["val_doc_bpb_in_context"] = bits_per_byte(sum(second), sum(n_bytes))
        return result


def rounded(sums: list[float]) -> list[float]:
    return [round(x, 4) for x in sums]


def bits_per_byte(nats: float, n_bytes: int) -> float:
    """nanochat's val_bpb: a tokenizer-free loss, so that runs with different tokenizers compare."""
    return nats / math.log(2) / max(1, n_bytes)


# ----------------------------------------------------------------------------------------------
# The start of a run


def describe_run(
    cfg: Config, session: Session, model: GPT, attention: str, train_rows: PackedBatches, val_alone: PackedBatches,
    val_tokens: int,
) -> None:  # fmt: skip
    """The lines a run starts with (`attention`: the kernel, model.attention_impl's); a new run's packing
    statistics also go to metrics.jsonl."""
    processes = f", {session.world_size} processes" if session.world_size > 1 else ""
    session.print(
        f"model: {model.num_params() / 1e6:.2f}M parameters, pos_emb={cfg.pos_emb}, device={session.device}, "
        f"attention={attention}{processes}"
    )
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * session.world_size
    resuming = f", resuming after step {session.first_step}" if session.resumed else ""
    session.print(
        f"run: {cfg.max_iters} steps of {tokens_per_step:,} tokens, packing={cfg.packing}, bos={cfg.bos}, "
        f"doc_mask={cfg.doc_mask}, reset_position_ids={cfg.reset_position_ids}, "
        f"mask_boundary_loss={cfg.mask_boundary_loss}{resuming}"
    )
    statistics = batches_statistics(train_rows)
    session.print(f"data: {describe_packing(cfg.packing, statistics)}")
    epochs = cfg.max_iters * cfg.batch_size * cfg.grad_accum * session.world_size / statistics["rows"]
    overfitting = "; more than two: a study's effects then include overfitting (more data, or fewer steps)"
    session.print(
        f"epochs: the {cfg.max_iters:,} steps read the training rows {epochs:.2f} times" + overfitting * (epochs > 2)
    )
    if session.resumed is None:
        session.log({"step": 0, "packing_statistics": statistics})
    session.print(
        f"eval: {val_tokens:,} validation tokens ({plural(len(val_alone.documents), 'document')}) per evaluation"
    )


class WandbMirror:
    """metrics.jsonl's records mirrored to Weights & Biases (lists left out) until `close`; a
    run never fails for want of wandb: it warns and goes on without."""

    def __init__(self, cfg: Config) -> None:
        self.run = None
        try:
            import wandb

            name, folder = cfg.wandb_run_name or Path(cfg.out_dir).name, os.environ.get("WANDB_DIR", cfg.out_dir)
            config = dataclasses.asdict(cfg)
            self.run = wandb.init(project=cfg.wandb_project, name=name, config=config, resume="allow", dir=folder)
        except Exception as e:
            print(
                f"warning: wandb logging is off ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                "set WANDB_MODE=offline to log without an account",
                file=sys.stderr,
            )

    def __call__(self, record: dict) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if not isinstance(v, list)}, step=record["step"])

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


# ----------------------------------------------------------------------------------------------
# The end of a run


def train_command(cfg: Config, world_size: int, *settings: str) -> str:
    """The command that resumes the run in cfg.out_dir, as many processes as wrote it, quoted to paste."""
    launcher = ["python"] if world_size == 1 else ["torchrun", f"--nproc_per_node={world_size}"]
    return shlex.join([*launcher, "train.py", f"--out_dir={cfg.out_dir}", "--resume=true", *settings])


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
    if not ckpt.is_file():  # nothing to sample, export or continue from (max_iters=0 trains nothing)
        return "\n".join([*lines, "  checkpoint: none written (no training step ran)"])
    lines.append(f"  checkpoint: {ckpt}")
    if stopped_after is not None:
        return "\n".join([*lines, f"  resume:   {train_command(cfg, world_size)}"])
    out = f"--out_dir={cfg.out_dir}"
    return "\n".join(
        [
            *lines,
            f"  sample:   {shlex.join(['python', 'sample.py', out])}",
            f"  export:   {shlex.join(['python', 'export_hf.py', out, f'--to=hf/{out_dir.resolve().name}'])}",
            f"  continue: {train_command(cfg, world_size, f'--max_iters={2 * cfg.max_iters}')}"
            "  (the learning-rate schedule is re-timed: results/README.md, Runs)",
        ]
    )
