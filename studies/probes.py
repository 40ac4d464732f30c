"""Probes: the same validation documents, placed in a row in different ways, scored under a run's own
settings. The baseline is each document right after an EOT, as it sits in a packed row after another
document ended: against it, "k tokens of other documents first" and "one foreign document first" add only
what precedes, not the EOT that any packed document follows. Under the start marker each document begins
with its BOS, as in training, and its own targets begin with its first text token, predicted from the BOS."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

import data
import sample
from config import Config, resolve_device
from errors import DataError
from model import GPT
from shards import Shards, TokenStream, document_bounds, leading_documents, load_shards
from studies.scoring import score_rows, target_losses


def leading_stream(val: TokenStream, eot_id: int, n_docs: int, seq_len: int) -> np.ndarray:
    """The start of the validation split, long enough for the probes: twice n_docs whole documents and
    more (the documents, then filler and unrelated ones), read without scanning the whole split."""
    n = (n_docs + 2) * seq_len
    while True:
        head = val[:n]
        if n >= len(val) or (np.count_nonzero(head == eot_id) > 2 * n_docs + 2 and n >= 4 * (n_docs + 2) * seq_len):
            return head
        n *= 2


def probe_documents(val: np.ndarray, eot_id: int, n_docs: int, window: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The first n_docs validation documents (their first `window` tokens plus one), and a stream of
    later ones to fill rows with."""
    starts, ends = document_bounds(val, eot_id)
    docs = [val[s : min(e, s + window + 1)].astype(np.int64) for s, e in zip(starts, ends) if e - s >= 2]
    if len(docs) < n_docs + 2:
        raise DataError(
            f"the validation split has {len(docs)} documents where the probes look; they need {n_docs + 2}: "
            "lower probe_docs or raise val_fraction"
        )
    filler = val[starts[n_docs] :].astype(np.int64)
    return docs[:n_docs], filler


def doc_loss_in_rows(
    model: GPT, cfg: Config, eot_id: int, prefixes: list[np.ndarray], docs: list[np.ndarray], device: torch.device
) -> float:
    """Mean loss over the documents' own targets, each document after its prefix in one row, under the
    run's flags."""
    rows = [np.concatenate([p, d]) for p, d in zip(prefixes, docs)]
    own = [(len(p), len(p) + len(d) - 1) for p, d in zip(prefixes, docs)]  # targets inside the document
    sums, counts = score_rows(model, cfg.flags, eot_id, rows, own, device, cfg.dtype)
    return float(sums.sum() / counts.sum())


def probe_inputs(
    shards: Shards, n_docs: int, seq_len: int, offsets: list[int], bos_id: int | None = None
) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]:
    """The probe documents, the filler stream, and one unrelated document for each probe document (cut to
    the space the offsets leave, keeping its EOT); a DataError when the validation split is too small.
    With the start marker every document begins with its BOS, as in the rows the run trained on."""
    head = leading_stream(shards.val, shards.eot_id, n_docs, seq_len)
    if bos_id is not None:
        documents = data.Documents(head, shards.eot_id, bos_id)
        head = documents.tokens(np.arange(documents.n_tokens))
    docs, filler = probe_documents(head, shards.eot_id, n_docs, seq_len - max(offsets))
    if len(filler) < len(docs) * max(offsets):  # each document's own k tokens of other documents
        raise DataError(
            f"the validation split has {len(filler):,} tokens after the probe documents; the offset probe needs "
            f"{len(docs) * max(offsets):,}: lower probe_docs or probe_offsets, or raise val_fraction"
        )
    other_docs, _ = probe_documents(filler, shards.eot_id, len(docs), max(offsets) - 1)
    unrelated = [d if d[-1] == shards.eot_id else np.append(d[:-1], shards.eot_id) for d in other_docs]
    return docs, filler, unrelated


def marker_id(shards: Shards, cfg: Config) -> int | None:
    """The run's BOS id (the first past the vocabulary), or None without the marker."""
    return shards.vocab_size if cfg.bos else None


def run_probes(out_dir: Path, cfg: Config, n_docs: int, offsets: list[int]) -> dict:
    """The probe documents' loss after k tokens of other documents (the last of them an EOT; k = 1 is the
    EOT alone), and after one unrelated document and its EOT."""
    device = resolve_device(cfg.device)
    model, _, checkpoint = sample.load_run(out_dir, device)
    shards = load_shards(Path(checkpoint["shards"]))
    docs, filler, unrelated = probe_inputs(shards, n_docs, cfg.seq_len, offsets, marker_id(shards, cfg))
    offset_loss = {}
    for k in offsets:
        prefixes = [np.append(filler[i * k : i * k + k - 1], shards.eot_id) for i in range(len(docs))]
        offset_loss[str(k)] = doc_loss_in_rows(model, cfg, shards.eot_id, prefixes, docs, device)
    after_other = doc_loss_in_rows(model, cfg, shards.eot_id, unrelated, docs, device)
    result = {"offset_loss": offset_loss, "after_other": after_other}
    if not cfg.bos:
        result["start_after_eot"] = start_after_eot(model, cfg, shards, device)
    return result


def start_after_eot(model: GPT, cfg: Config, shards: Shards, device: torch.device) -> dict:
    """Every validation document of the evaluation (its first seq_len tokens) after one EOT, under the run's
    attention and positions: the start a packed run without the marker trains on (with the document mask,
    the same as alone). By position as the evaluation's `val_doc_*_by_position`, and the first text token,
    predicted from the EOT and scored here although the boundary loss mask ignores it in training."""
    val = np.asarray(leading_documents(shards.val, shards.eot_id, cfg.eval_tokens))
    starts, ends = document_bounds(val, shards.eot_id)
    rows = [np.append(shards.eot_id, val[s : min(e, s + cfg.seq_len)]) for s, e in zip(starts, ends)]
    flags = dataclasses.replace(cfg.flags, mask_boundary_loss=False)  # score the first text token too
    sums, counts = np.zeros(cfg.seq_len), np.zeros(cfg.seq_len, dtype=np.int64)
    first = []
    for losses in target_losses(model, flags, shards.eot_id, rows, device, cfg.dtype):
        first.append(losses[0])  # target j is text token j: j = 0 from the EOT, j = p + 1 from position p
        sums[: len(losses) - 1] += losses[1:]
        counts[: len(losses) - 1] += 1
    n = int((counts > 0).sum())
    return {
        "sum_by_position": [round(x, 4) for x in sums[:n].tolist()],
        "count_by_position": counts[:n].tolist(),
        "first_token_sum": float(np.sum(first)),
        "first_token_count": len(first),
    }


# ----------------------------------------------------------------------------------------------
# Running the grid
