"""Packed documents, in the order they are built: the document stream, its rows, the batch, the loader. This
docstring is the spec; its rules are Megatron-LM's flags of the same meaning (README, "Why packing needs care").

Stream   a split's documents back to back, each encoded with `encode_ordinary` and ended by one EOT that belongs
         to it. With the start marker (bos) each also opens with a BOS of its own: BOS, text, EOT. The marker
         enters here (`Documents`), not in the shards, so one prepared folder serves both conventions.
Rows     a row is T + 1 slots: inputs x = row[:T], targets y = row[1:]. A packing lays pieces of the stream
         end to end in each row, then padding:
  concat   windows starting every T tokens, always full; documents are cut at row edges. Consecutive rows share
           one token (the last target of one is the first input of the next), so each token is a target once.
           The split's last (n_tokens - 1) mod T tokens, too few for a row, are in none (as in Megatron-LM)
           unless `keep_tail` pads them into a last row (evaluation)
  pad      one document a row (the wasteful baseline)
  bestfit  whole documents, longest first, each into the open row it fills most, else a new row (Ding et al.
           2024, arXiv 2404.10830, without their truncation: nothing is dropped). Planned from the lengths in
           stream order alone, so the same data gives the same rows however it is sharded
Long     a document longer than a row (T + 1) is first cut into chunks of T + 1 starting every T tokens, the
         last one what is left: consecutive chunks share one token, as consecutive concat rows do. Under pad each
         chunk is a row. Under bestfit each full chunk is a row, and a shorter last chunk opens a row of its
         own (whole documents fill the rest), so its shared token is an input only: later in a row it would be
         a target a second time, predicted from another document's EOT
Marker   a row that starts a document starts with its BOS; a row that starts inside one (a concat row, a later
         chunk) gets no BOS
Batch    each input token is given, from the row's tokens alone:
  doc id   the exclusive cumulative sum of (x == EOT): an EOT keeps the id of the document it ends
  position its position id, under the reset (else its slot): 0 at the row start and on the token after each
           EOT, so a BOS is at 0 and its first text token at 1; a row that starts inside a document gives that
           token 0 (as Megatron-LM, torchtitan and HF do)
  loss     under the boundary mask, the target predicted *from* an EOT input is ignored (the next document's
           first token, its BOS with the marker); predicting the EOT itself counts, so the model learns to end
           documents
  padding  inputs are EOT, each its own one-token document; their targets, and the target after a row's last
           real token, are ignored. No token of the stream is a counted target twice, under any packing or flags
Seeing   without the document mask a token attends to every earlier slot of its row: every token after the
         row's first EOT sees another document (under pad, only padding follows it); with the mask, none does
Words    a stream index names one token of the document stream; a position is a position id in a row (what the
         model is given); a doc position is a token's place in its document's text, -1 at a BOS (for reports)

Worked example: documents of 3, 2 and 3 tokens in one 8-slot row give doc ids 0 0 0 1 1 2 2 2 and positions
0 1 2 0 1 0 1 2; with the marker, B a a E B b E B c c E in 11 slots gives doc ids 0 0 0 0 1 1 1 2 2 2 2 and
positions 0 1 2 3 0 1 2 0 1 2 3. model.py builds the document mask (lower triangles) from the doc ids.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np
import torch

from errors import DataError

# ----------------------------------------------------------------------------------------------
# The document stream


def eot_positions(stream: np.ndarray, eot_id: int, chunk: int = 1 << 24) -> np.ndarray:
    """The index in the split of every EOT, read in chunks so a large split is never held in memory at once."""
    found = []
    for begin in range(0, len(stream), chunk):
        window = np.asarray(stream[begin : begin + chunk])
        found.append(np.flatnonzero(window == eot_id) + begin)
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


class Documents:
    """The documents of one split in stream order, each its tokens and its EOT, after a BOS when `bos_id` is
    given. Document d begins at stream index starts[d] and holds lengths[d] tokens, BOS and EOT included."""

    def __init__(self, stream: np.ndarray, eot_id: int, bos_id: int | None = None) -> None:
        self.stream = stream  # the split's tokens: the document stream less its BOS
        self.eot_id = eot_id
        self.bos_id = bos_id
        self.has_marker = bos_id is not None
        ends = eot_positions(stream, eot_id) + 1  # in the split, one past each EOT
        if len(stream) and (len(ends) == 0 or ends[-1] != len(stream)):
            ends = np.append(ends, len(stream))  # an array cut inside its last document (tests, probes)
        begins = np.concatenate([np.zeros(1, dtype=np.int64), ends])[:-1]  # in the split
        if self.has_marker:  # the d BOS before document d move it on by d; its own makes it one longer
            self.starts = begins + np.arange(len(ends))
            self.lengths = ends - begins + 1
            self.n_tokens = len(stream) + len(ends)
        else:
            self.starts = begins
            self.lengths = ends - begins
            self.n_tokens = len(stream)

    def __len__(self) -> int:
        return len(self.starts)

    def document_of(self, index: np.ndarray) -> np.ndarray:
        """The document each stream index falls in."""
        return np.searchsorted(self.starts, index, side="right") - 1

    def tokens(self, index: np.ndarray) -> np.ndarray:
        """The token ids (int64) at these stream indexes."""
        if not self.has_marker:
            return np.asarray(self.stream[index]).astype(np.int64)
        document = self.document_of(index)
        is_bos = index == self.starts[document]
        in_split = np.where(is_bos, 0, index - document - 1)  # behind the BOS of document d and the d before it
        out = np.asarray(self.stream[in_split]).astype(np.int64)
        out[is_bos] = self.bos_id
        return out

    def doc_positions(self, index: np.ndarray) -> np.ndarray:
        """The doc position of each stream index: 0 at its document's first text token, -1 at a BOS."""
        from_start = index - self.starts[self.document_of(index)]
        return from_start - 1 if self.has_marker else from_start


# ----------------------------------------------------------------------------------------------
# Rows: which tokens of the stream each row holds, as pieces laid end to end


@dataclass
class Rows:
    """Row r lays the pieces offsets[r]:offsets[r + 1] end to end, piece p being `length[p]` tokens of the
    document stream from stream index `start[p]`; the rest of its T + 1 slots is padding. Every row holds at
    least one piece."""

    start: np.ndarray
    length: np.ndarray
    offsets: np.ndarray  # where each row's pieces begin in `start` and `length`, then their number

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def index(self, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(B, width) stream index of each slot of these rows (-1 for padding), and each row's real slots."""
        pieces_per_row = self.offsets[rows + 1] - self.offsets[rows]
        piece = concatenated_ranges(self.offsets[rows], pieces_per_row)
        length = self.length[piece]
        stream_index = concatenated_ranges(self.start[piece], length)  # of every real slot, row after row
        row_of_slot = np.repeat(np.repeat(np.arange(len(rows)), pieces_per_row), length)
        n_real = np.bincount(row_of_slot, minlength=len(rows))
        column = concatenated_ranges(np.zeros_like(n_real), n_real)
        out = np.full((len(rows), width), -1, dtype=np.int64)
        out[row_of_slot, column] = stream_index
        return out, n_real


def concatenated_ranges(begin: np.ndarray, count: np.ndarray) -> np.ndarray:
    """begin[i], begin[i] + 1, ... (count[i] of them) for each i in turn, without a Python loop."""
    where_each_begins = np.cumsum(count) - count
    return np.repeat(begin - where_each_begins, count) + np.arange(count.sum())


def one_piece_a_row(start: np.ndarray, length: np.ndarray) -> Rows:
    return Rows(start.astype(np.int64), length.astype(np.int64), np.arange(len(start) + 1))


def concat_rows(documents: Documents, seq_len: int, keep_tail: bool = False) -> Rows:
    """Windows of T + 1 tokens starting every T; the split's last (n_tokens - 1) mod T tokens in none, unless
    `keep_tail` pads them into a last row."""
    end = documents.n_tokens - 1 if keep_tail else documents.n_tokens - seq_len
    starts = np.arange(0, end, seq_len, dtype=np.int64)
    return one_piece_a_row(starts, np.minimum(seq_len + 1, documents.n_tokens - starts))


def document_chunks(documents: Documents, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of every chunk: a document of at most T + 1 tokens whole, a longer one in chunks of
    T + 1 starting every T tokens, the last one what is left."""
    lengths = documents.lengths
    n_chunks = np.maximum(1, -(-(lengths - 1) // seq_len))  # ceil((length - 1) / T), as they share one token
    document = np.repeat(np.arange(len(lengths)), n_chunks)
    into_document = concatenated_ranges(np.zeros_like(n_chunks), n_chunks) * seq_len
    chunk_start = documents.starts[document] + into_document
    chunk_length = np.minimum(seq_len + 1, lengths[document] - into_document)
    return chunk_start, chunk_length


def pad_rows(documents: Documents, seq_len: int) -> Rows:
    """One row per document, or per chunk of a longer one."""
    return one_piece_a_row(*document_chunks(documents, seq_len))


def bestfit_rows(documents: Documents, seq_len: int) -> Rows:
    """First the full chunks, a row each; then the long documents' shorter last chunks, each opening a row; then
    the whole documents, best fit into the open rows (`best_fit_decreasing`). In a row its pieces come in the
    order they were placed, so a last chunk comes first: the row starts inside its document, as a concat row
    may, and the token it shares with the chunk before is an input only."""
    start, length = document_chunks(documents, seq_len)
    capacity = seq_len + 1
    is_full = length == capacity
    opens_document = np.isin(start, documents.starts)
    last_chunks = longest_first(np.flatnonzero(~is_full & ~opens_document), length)
    whole = longest_first(np.flatnonzero(~is_full & opens_document), length)
    placed = np.concatenate([last_chunks, whole])
    row_of = best_fit_decreasing(length[placed].tolist(), capacity, alone=len(last_chunks))
    by_row = placed[np.argsort(row_of, kind="stable")]  # in a row, in the order placed
    pieces = np.concatenate([np.flatnonzero(is_full), by_row])
    pieces_per_row = np.concatenate([np.ones(is_full.sum(), dtype=np.int64), np.bincount(row_of)])
    return Rows(start[pieces], length[pieces], np.concatenate([[0], np.cumsum(pieces_per_row)]))


def longest_first(chunks: np.ndarray, length: np.ndarray) -> np.ndarray:
    """These chunks, longest first, ties in stream order."""
    return chunks[np.argsort(-length[chunks], kind="stable")]


def best_fit_decreasing(sizes: list[int], capacity: int, alone: int = 0) -> np.ndarray:
    """The row of each item, taken in the order given (longest first): the open row with the least room that fits
    it (of those, the one last put in that room), else a new row; each of the first `alone` items opens a row of
    its own. The rooms that open rows have are kept sorted, so `bisect` finds the least that fits."""
    rows_by_room: dict[int, list[int]] = {}  # room: its open rows; pop() takes the last put there
    rooms: list[int] = []  # the keys of rows_by_room, ascending
    row_of = np.empty(len(sizes), dtype=np.int64)
    n_rows = 0
    for item, size in enumerate(sizes):
        at = bisect_left(rooms, size)
        if item >= alone and at < len(rooms):
            room = rooms[at]
            row = rows_by_room[room].pop()
            if not rows_by_room[room]:
                del rows_by_room[room]
                del rooms[at]
        else:
            row = n_rows
            room = capacity
            n_rows += 1
        row_of[item] = row
        left = room - size
        if left > 0:  # a full row takes nothing more
            if left not in rows_by_room:
                rows_by_room[left] = []
                insort(rooms, left)
            rows_by_room[left].append(row)
    return row_of


PACKINGS = {"concat": concat_rows, "pad": pad_rows, "bestfit": bestfit_rows}


# ----------------------------------------------------------------------------------------------
# The batch: what each input token is given, from the row's tokens alone

IGNORE_INDEX = -100  # targets with this value do not count in the loss (torch's cross_entropy default)


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
    """Position ids that restart at 0 at the row start and on the token after each EOT."""
    slot = torch.arange(inputs.shape[-1], device=inputs.device).expand_as(inputs)
    restarts = torch.zeros_like(inputs, dtype=torch.bool)
    restarts[..., 0] = True
    restarts[..., 1:] = inputs[..., :-1] == eot_id
    last_restart = torch.where(restarts, slot, torch.zeros_like(slot)).cummax(-1).values
    return slot - last_restart


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
        return Batch(*moved)


def make_batch(
    tokens: np.ndarray,
    n_real: np.ndarray,
    eot_id: int,
    *,
    flags: Flags = Flags(),
    doc_positions: np.ndarray | None = None,
) -> Batch:
    """A batch from rows of T + 1 ids (B, T + 1), the first n_real of each real. Padding inputs are EOT (each
    its own one-token document), padding targets ignored. `doc_positions` (B, T): each input's doc position,
    for reports (default: the reset positions)."""
    real = np.arange(tokens.shape[1])[None, :] < n_real[:, None]
    tokens = torch.from_numpy(np.where(real, tokens, eot_id).astype(np.int64))
    inputs = tokens[:, :-1]
    targets = tokens[:, 1:].clone()
    targets[~torch.from_numpy(real[:, 1:])] = IGNORE_INDEX
    reset = reset_positions(inputs, eot_id)
    doc_ids = document_ids(inputs, eot_id)
    in_document = reset if doc_positions is None else torch.from_numpy(doc_positions)
    # The reset_position_ids flag: its whole effect is this choice.
    if flags.reset_position_ids:
        position_ids = reset
    else:
        position_ids = torch.arange(inputs.shape[1]).expand_as(inputs).clone()
    # The mask_boundary_loss flag: its whole effect is this line.
    if flags.mask_boundary_loss:
        targets = boundary_loss_masked(inputs, targets, eot_id)
    return Batch(inputs.contiguous(), targets, doc_ids, position_ids, in_document)


# ----------------------------------------------------------------------------------------------
# The loader


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
        self.packing = packing
        self.eot_id = eot_id
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.flags = flags
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.cursor = 0  # the rows of this epoch's order served so far, by all processes
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
        stream_index, n_real = self.rows.index(rows, self.seq_len + 1)
        stream_index = np.concatenate([stream_index, np.full((n_empty, self.seq_len + 1), -1)])
        n_real = np.concatenate([n_real, np.zeros(n_empty, dtype=np.int64)])
        tokens = self.documents.tokens(np.maximum(stream_index, 0))  # padding's tokens become EOT in make_batch
        inputs = stream_index[:, :-1]
        doc_positions = np.where(inputs >= 0, self.documents.doc_positions(np.maximum(inputs, 0)), 0)
        return make_batch(tokens, n_real, self.eot_id, flags=self.flags, doc_positions=doc_positions)

    def next(self) -> Batch:
        """This process's share of the next global batch: process r takes its r-th batch_size rows."""
        global_batch = self.batch_size * self.world_size
        if self.cursor + global_batch > len(self.rows):
            self.epoch += 1
            self.cursor = 0
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
        self.epoch = state["epoch"]
        self.cursor = state["cursor"]
        self._order = self._epoch_order()
