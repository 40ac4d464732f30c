"""Scoring rows laid out by hand under a run's settings: the one row scorer of the probes (ablate.py's
offset and contamination probes, import_leak.py's log-probabilities)."""

from __future__ import annotations

import numpy as np
import torch

import data
import train
from data import IGNORE_INDEX, Flags
from model import GPT


@torch.no_grad()
def score_rows(
    model: GPT,
    flags: Flags,
    eot_id: int,
    rows: list[np.ndarray],
    scored: list[tuple[int, int]],
    device: torch.device,
    dtype: str = "auto",
    batch_rows: int = 32,
) -> tuple[np.ndarray, np.ndarray]:
    """For each row (its inputs and last target, laid out by data.batch_of_rows under `flags`) and its
    scored targets [first, stop): the loss summed over those targets and how many of them count, in the
    run's compute precision `dtype`. A batch's rows are as long as its longest: attention is causal, so what
    comes after a target changes nothing."""
    sums, counts = [], []
    for i in range(0, len(rows), batch_rows):
        chunk = rows[i : i + batch_rows]
        batch = data.batch_of_rows(chunk, max(len(row) for row in chunk) - 1, eot_id, flags=flags)
        keep = torch.zeros_like(batch.targets, dtype=torch.bool)
        for r, (first, stop) in enumerate(scored[i : i + batch_rows]):
            keep[r, first:stop] = True
        batch.targets = batch.targets.masked_fill(~keep, IGNORE_INDEX)
        with train.autocast(device, dtype):
            losses, counted = train.token_losses(model, batch.to(device), model.config)
        sums.append(losses.sum(1).double().cpu().numpy())
        counts.append(counted.sum(1).cpu().numpy())
    return np.concatenate(sums), np.concatenate(counts)
