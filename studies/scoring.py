"""Scoring rows laid out by hand under a run's settings: the one row scorer of the probes (ablate.py's
offset, contamination and start probes, import_leak.py's log-probabilities)."""

from __future__ import annotations

import numpy as np
import torch

import train
from data import Batch, Flags, make_batch
from model import GPT


def batch_of_rows(rows: list[np.ndarray], seq_len: int, eot_id: int, flags: Flags = Flags()) -> Batch:
    """A batch whose row r holds the tokens rows[r] (at most seq_len + 1), padded: rows laid out by hand."""
    if any(len(row) > seq_len + 1 for row in rows):
        raise ValueError(f"a row holds at most seq_len + 1 = {seq_len + 1} tokens")
    tokens = np.full((len(rows), seq_len + 1), eot_id, dtype=np.int64)
    for r, row in enumerate(rows):
        tokens[r, : len(row)] = row
    return make_batch(tokens, np.array([len(row) for row in rows]), eot_id, flags=flags)


@torch.no_grad()
def target_losses(
    model: GPT,
    flags: Flags,
    eot_id: int,
    rows: list[np.ndarray],
    device: torch.device,
    dtype: str = "auto",
    batch_rows: int = 32,
) -> list[np.ndarray]:
    """For each row (its inputs and last target, laid out by batch_of_rows under `flags`), the loss of
    each of its len(row) - 1 targets, NaN where a target does not count, in the run's compute precision
    `dtype`. A batch's rows are as long as its longest: attention is causal, so what comes after a target
    changes nothing."""
    out = []
    for i in range(0, len(rows), batch_rows):
        chunk = rows[i : i + batch_rows]
        batch = batch_of_rows(chunk, max(len(row) for row in chunk) - 1, eot_id, flags=flags)
        with train.autocast(device, dtype):
            losses, counted = train.token_losses(model, batch.to(device), model.config, flags.doc_mask)
        losses = torch.where(counted, losses.double(), torch.nan).cpu().numpy()
        out += [losses[r, : len(row) - 1] for r, row in enumerate(chunk)]
    return out


def score_rows(
    model: GPT,
    flags: Flags,
    eot_id: int,
    rows: list[np.ndarray],
    scored: list[tuple[int, int]],
    device: torch.device,
    dtype: str = "auto",
) -> tuple[np.ndarray, np.ndarray]:
    """For each row and its scored targets [first, stop): the loss summed over those targets that count,
    and how many of them count."""
    losses = [
        row[first:stop] for row, (first, stop) in zip(target_losses(model, flags, eot_id, rows, device, dtype), scored)
    ]
    return np.array([np.nansum(row) for row in losses]), np.array([np.count_nonzero(~np.isnan(row)) for row in losses])
