"""The packing spec: how the documents of a split become rows and a row becomes a batch, top to bottom.

The rules, which are Megatron-LM's flags of the same meaning (README, "Why packing needs care"):

    stream   every document is encoded with `encode_ordinary` and followed by one EOT token;
             the EOT belongs to the document it ends. With the start marker (bos), every document
             also begins with a BOS token that belongs to it: BOS, its text, EOT
    rows     T + 1 tokens laid out by the packing (concat, pad or bestfit); inputs x = row[:T],
             targets y = row[1:T + 1]
    doc id   exclusive cumulative sum of (x == EOT): the EOT keeps the id of its document
    position restarts at 0 on the token after each EOT (the BOS, with the marker) and at the start of
             the row (a row that starts inside a document gives that token position 0, as Megatron-LM,
             torchtitan and HF do; no BOS is added there)
    loss     the target predicted *from* an EOT input is ignored (the next document's first token, its
             BOS with the marker); predicting the EOT itself counts, so the model learns to end documents

Worked example: documents of 3, 2 and 3 tokens in one 8-slot row give document ids 0 0 0 1 1 2 2 2 and
positions 0 1 2 0 1 0 1 2; model.py builds the document mask (three small lower triangles) from the ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from errors import DataError

IGNORE_INDEX = -100  # targets with this value do not count in the loss (torch's cross_entropy default)


# ----------------------------------------------------------------------------------------------
# The three fixes and the batch


@dataclass(frozen=True)
class Flags:
    """The three fixes of packing, on by default; each one off is an ablation. Each flag's whole effect is one
    spot: reset_position_ids and mask_boundary_loss in `make_batch`, doc_mask in model.attention_mask."""

    doc_mask: bool = True  # attend only within the document
    reset_position_ids: bool = True  # positions restart at 0 in each document
    mask_boundary_loss: bool = True  # no loss on predicting a document's first token from the previous one


def document_ids(inputs: torch.Tensor, eot_id: int) -> torch.Tensor:
    """Exclusive cumulative sum of EOT: an EOT keeps the id of the document it ends."""
    is_eot = (inputs == eot_id).long()
    return is_eot.cumsum(-1) - is_eot


def reset_positions(inputs: torch.Tensor, eot_id: int) -> torch.Tensor:
    """Position within the document: 0 at the row start and on the token after each EOT."""
    T = inputs.shape[-1]
    t = torch.arange(T, device=inputs.device).expand_as(inputs)
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = inputs[..., :-1] == eot_id
    last_start = torch.where(starts, t, torch.zeros_like(t)).cummax(-1).values
    return t - last_start


def boundary_loss_masked(inputs: torch.Tensor, targets: torch.Tensor, eot_id: int) -> torch.Tensor:
    """Ignore the target predicted from an EOT input (the next document's first token); EOT as a target
    counts, so the model learns to end documents."""
    return targets.masked_fill(inputs == eot_id, IGNORE_INDEX)


@dataclass
class Batch:
    inputs: torch.Tensor  # (B, T) token ids
    targets: torch.Tensor  # (B, T) token ids, IGNORE_INDEX where not counted
    doc_ids: torch.Tensor  # (B, T) document index within the row
    position_ids: torch.Tensor  # (B, T) position fed to the model
    doc_positions: torch.Tensor  # (B, T) position within the document's text (a BOS is -1), for reports
    doc_mask: bool = True  # the doc_mask flag, carried to model.attention_mask

    TENSORS = ("inputs", "targets", "doc_ids", "position_ids", "doc_positions")

    @property
    def counted(self) -> torch.Tensor:
        """(B, T) bool: the targets that count in the loss."""
        return self.targets != IGNORE_INDEX

    def to(self, device: torch.device | str) -> "Batch":
        """To CUDA from pinned memory without blocking, so the next batch is built while the GPU works."""
        cuda = torch.device(device).type == "cuda"
        tensors = (getattr(self, name) for name in self.TENSORS)
        moved = (t.pin_memory().to(device, non_blocking=True) if cuda else t.to(device) for t in tensors)
        return Batch(*moved, doc_mask=self.doc_mask)


def make_batch(
    tokens: np.ndarray,
    n_real: np.ndarray,
    eot_id: int,
    *,
    flags: Flags = Flags(),
    doc_positions: np.ndarray | None = None,
) -> Batch:
    """A batch from rows of T + 1 ids (B, T + 1), the first n_real of each real. Padding inputs are EOT (each
    its own one-token document), padding targets ignored. `doc_positions` (B, T): each input's position in
    its document's text, for reports (default: the reset positions)."""
    real = np.arange(tokens.shape[1])[None, :] < n_real[:, None]
    tokens = torch.from_numpy(np.where(real, tokens, eot_id).astype(np.int64))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[~torch.from_numpy(real[:, 1:])] = IGNORE_INDEX
    positions = reset_positions(inputs, eot_id)
    doc_ids = document_ids(inputs, eot_id)
    in_document = positions if doc_positions is None else torch.from_numpy(doc_positions)
    # The reset_position_ids flag: its whole effect is this line.
    position_ids = positions if flags.reset_position_ids else torch.arange(inputs.shape[1]).expand_as(inputs).clone()
    # The mask_boundary_loss flag: its whole effect is this line.
    if flags.mask_boundary_loss:
        targets = boundary_loss_masked(inputs, targets, eot_id)
    return Batch(inputs.contiguous(), targets, doc_ids, position_ids, in_document, doc_mask=flags.doc_mask)


# ----------------------------------------------------------------------------------------------
# The document stream: a split's documents as rows take them


class Documents:
    """The documents of one split in stream order, each its tokens and its EOT, after a BOS when `bos_id` is
    given: the marker enters here, so one prepared folder serves both conventions. An index into this
    document stream addresses one token (without the marker, the index into the split)."""

    def __init__(self, stream: np.ndarray, eot_id: int, bos_id: int | None = None) -> None:
        ends = eot_positions(stream, eot_id) + 1
        if len(stream) and (len(ends) == 0 or ends[-1] != len(stream)):
            ends = np.append(ends, len(stream))  # an array cut inside its last document (tests, probes)
        marker = int(bos_id is not None)
        source_starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self.stream, self.eot_id, self.bos_id, self.marker = stream, eot_id, bos_id, marker
        self.starts = source_starts + marker * np.arange(len(ends))  # where each document (its BOS) begins
        self.lengths = ends - source_starts + marker  # BOS, text and EOT
        self.n_tokens = len(stream) + marker * len(ends)

    def __len__(self) -> int:
        return len(self.starts)

    def document_of(self, index: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, index, side="right") - 1

    def tokens(self, index: np.ndarray) -> np.ndarray:
        """The token ids (int64) at these indexes of the document stream."""
        if self.bos_id is None:
            return np.asarray(self.stream[index]).astype(np.int64)
        document = self.document_of(index)
        is_bos = index == self.starts[document]
        out = np.asarray(self.stream[np.where(is_bos, 0, index - document - 1)]).astype(np.int64)
        out[is_bos] = self.bos_id
        return out

    def positions(self, index: np.ndarray) -> np.ndarray:
        """Position within the document's text: 0 at its first text token, -1 at its BOS."""
        return index - self.starts[self.document_of(index)] - self.marker


# ----------------------------------------------------------------------------------------------
# Rows. A packing decides which tokens of the document stream each row holds, as pieces laid end to end:
#   concat   contiguous windows of the stream, always full (documents cut at row edges)
#   pad      one document, or one chunk of a long one, per row, then padding (the wasteful baseline)
#   bestfit  whole documents, best-fit-decreasing into rows, then padding; a document longer than a row
#            is cut into row-sized chunks first (Ding et al. 2024, arXiv 2404.10830, without their
#            truncation of the rest: nothing is dropped)
# Chunks of a long document, like consecutive concat rows, share one token (the last target of one is
# the first input of the next), so every token of a document is predicted exactly once.


@dataclass
class Rows:
    """Row r lays the pieces first[r]:first[r + 1] end to end, piece p being `length[p]` tokens of the
    document stream from `start[p]`; the rest of its T + 1 slots is padding."""

    start: np.ndarray
    length: np.ndarray
    first: np.ndarray

    def __len__(self) -> int:
        return len(self.first) - 1

    def index(self, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(B, width) document-stream index of each slot of these rows (-1 for padding) and each row's
        number of real slots."""
        counts = self.first[rows + 1] - self.first[rows]  # every row holds at least one piece
        first_of_row = np.cumsum(counts) - counts  # where each row's pieces begin in the list below
        piece = np.repeat(self.first[rows] - first_of_row, counts) + np.arange(counts.sum())
        row_of_piece = np.repeat(np.arange(len(rows)), counts)
        length = self.length[piece]
        begin = np.cumsum(length) - length  # of each piece, in all the rows' slots laid end to end
        column = begin - np.repeat(begin[first_of_row], counts)
        within = np.arange(length.sum()) - np.repeat(begin, length)
        out = np.full((len(rows), width), -1, dtype=np.int64)
        out[np.repeat(row_of_piece, length), np.repeat(column, length) + within] = (
            np.repeat(self.start[piece], length) + within
        )
        return out, np.bincount(row_of_piece, weights=length, minlength=len(rows)).astype(np.int64)


def single_pieces(start: np.ndarray, length: np.ndarray) -> Rows:
    return Rows(start.astype(np.int64), length.astype(np.int64), np.arange(len(start) + 1))


def concat_rows(documents: Documents, seq_len: int, keep_tail: bool = False) -> Rows:
    """Contiguous, non-overlapping windows of T + 1 tokens (consecutive rows share one token, as x/y do). The
    split's last (n_tokens - 1) mod T tokens, too few for a row, are in none (Megatron-LM's too; the log says),
    unless `keep_tail` pads them into a last row (evaluation)."""
    end = documents.n_tokens - 1 if keep_tail else documents.n_tokens - seq_len
    starts = np.arange(0, end, seq_len, dtype=np.int64)
    return single_pieces(starts, np.minimum(seq_len + 1, documents.n_tokens - starts))


def document_chunks(documents: Documents, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of every chunk: a document of at most T + 1 tokens whole, a longer one in chunks of
    T + 1 starting every T tokens (sharing one token), the last one shorter."""
    lengths = documents.lengths
    n_chunks = np.maximum(1, -(-(lengths - 1) // seq_len))
    document = np.repeat(np.arange(len(lengths)), n_chunks)
    offset = (np.arange(len(document)) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)) * seq_len
    return documents.starts[document] + offset, np.minimum(seq_len + 1, lengths[document] - offset)


def pad_rows(documents: Documents, seq_len: int) -> Rows:
    """One row per document, or per chunk of a longer one."""
    return single_pieces(*document_chunks(documents, seq_len))


def bestfit_rows(documents: Documents, seq_len: int) -> Rows:
    """Full chunks one to a row; the last chunk of each long document opens a row of its own; every whole
    document, longest first, into the open row it fills most (best fit), or a new row. From the lengths in
    stream order only: the same data gives the same rows.

    A last chunk starts its row, as a concat row that starts inside a document does: its first token, shared
    with the chunk before, is then an input only. Anywhere else in a row it would be a target a second time,
    predicted from another document's EOT."""
    start, length = document_chunks(documents, seq_len)
    capacity = seq_len + 1
    full = np.flatnonzero(length == capacity)
    rest = np.flatnonzero(length < capacity)
    opens_document = np.isin(start[rest], documents.starts)
    rest = rest[np.lexsort((rest, -length[rest], opens_document))]  # last chunks first; then longest first
    row_of = best_fit_decreasing(length[rest].tolist(), capacity, alone=int((~opens_document).sum()))
    opens_document = np.isin(start[rest], documents.starts)
    order = np.lexsort((np.arange(len(rest)), opens_document, row_of))  # in a row: the last chunk first
    pieces = np.concatenate([full, rest[order]])
    per_row = np.concatenate([np.ones(len(full), dtype=np.int64), np.bincount(row_of)])
    return Rows(start[pieces], length[pieces], np.concatenate([[0], np.cumsum(per_row)]))


def best_fit_decreasing(sizes: list[int], capacity: int, alone: int = 0) -> np.ndarray:
    """The row of each item (sizes decreasing): the open row with the least room that fits it, else a new one;
    each of the first `alone` items opens a row of its own. Rows are stacked by room and a bit set (a Python
    int) marks the rooms some row has, so the best fit is a shift and a lowest set bit: about a microsecond an
    item, whatever the number of rows."""
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]
    rooms_open = 0  # bit r set: some open row has exactly r slots left
    row_of = np.empty(len(sizes), dtype=np.int64)
    n_rows = 0
    for item, size in enumerate(sizes):
        fitting = rooms_open >> size if item >= alone else 0
        if fitting:
            room = size + (fitting & -fitting).bit_length() - 1
            row = by_room[room].pop()
            if not by_room[room]:
                rooms_open ^= 1 << room
        else:
            row, room, n_rows = n_rows, capacity, n_rows + 1
        row_of[item] = row
        left = room - size
        if left:
            if not by_room[left]:
                rooms_open |= 1 << left
            by_room[left].append(row)
    return row_of


PACKINGS = {"concat": concat_rows, "pad": pad_rows, "bestfit": bestfit_rows}


class PackedBatches:
    """A deterministic, resumable sequence of batches from one split: rows planned once from the data alone,
    shuffled each epoch by (seed, epoch), so runs of one seed see the same rows whatever their flags; the
    position is two integers, saved in checkpoints. `keep_tail`: concat's last, shorter row too (evaluation)."""

    def __init__(
        self,
        stream: np.ndarray,
        eot_id: int,
        seq_len: int,
        batch_size: int,
        packing: str = "concat",
        *,
        flags: Flags = Flags(),
        bos_id: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        split: str = "train",
        keep_tail: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
        self.documents = Documents(stream, eot_id, bos_id)
        if packing == "concat":
            self.rows = concat_rows(self.documents, seq_len, keep_tail)
        else:
            self.rows = PACKINGS[packing](self.documents, seq_len)
        needed = batch_size * world_size if shuffle else 1  # training takes whole global batches
        if len(self.rows) < needed:
            raise DataError(
                f"the {split} split's {len(stream):,} tokens give {len(self.rows)} rows of seq_len {seq_len} with "
                f"packing={packing}, fewer than batch_size {batch_size} x {world_size} process(es): "
                "use more data or smaller settings"
            )
        self.packing, self.eot_id, self.seq_len, self.batch_size = packing, eot_id, seq_len, batch_size
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.flags = flags
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order()

    def __len__(self) -> int:
        return len(self.rows)

    def _epoch_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))

    def rows_left_out_each_epoch(self) -> int:
        """An epoch is whole global batches: `next` starts the next epoch before a remainder smaller than one."""
        return len(self.rows) % (self.batch_size * self.world_size) if self.shuffle else 0

    def batch(self, rows: np.ndarray, n_empty: int = 0) -> Batch:
        """These rows, then n_empty empty rows (all EOT inputs, no counted target)."""
        index, n_real = self.rows.index(rows, self.seq_len + 1)
        index = np.concatenate([index, np.full((n_empty, self.seq_len + 1), -1)])
        n_real = np.concatenate([n_real, np.zeros(n_empty, dtype=np.int64)])
        tokens = self.documents.tokens(np.maximum(index, 0))
        inputs = index[:, :-1]
        doc_positions = np.where(inputs >= 0, self.documents.positions(np.maximum(inputs, 0)), 0)
        return make_batch(tokens, n_real, self.eot_id, flags=self.flags, doc_positions=doc_positions)

    def document_of_rows(self) -> np.ndarray:
        """The document each row starts in."""
        return self.documents.document_of(self.rows.start[self.rows.first[:-1]])

    def next(self) -> Batch:
        """This process's share of the next global batch: process r takes its r-th batch_size rows."""
        global_batch = self.batch_size * self.world_size
        if self.cursor + global_batch > len(self.rows):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._epoch_order()
        first = self.cursor + self.rank * self.batch_size
        self.cursor += global_batch
        return self.batch(self._order[first : first + self.batch_size])

    def all_batches(self):
        """Every row in order, in batches; the last filled up with empty rows, so a compiled model never
        recompiles."""
        n = len(self.rows)
        for i in range(0, n, self.batch_size):
            rows = self._order[i : min(i + self.batch_size, n)]
            yield self.batch(rows, n_empty=self.batch_size - len(rows))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._epoch_order()


def eot_positions(stream: np.ndarray, eot_id: int, chunk: int = 1 << 24) -> np.ndarray:
    """Positions of every EOT, read in chunks so a large split is never held in memory at once."""
    found = [np.flatnonzero(np.asarray(stream[i : i + chunk]) == eot_id) + i for i in range(0, len(stream), chunk)]
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
