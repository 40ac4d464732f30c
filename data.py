"""The packing spec: how a row of the token stream becomes a batch, read top to bottom. Then reading the
shards that prepare.py writes. This file imports nothing from the repo.

The rules, which are Megatron-LM's flags of the same meaning (README, "The three flags"):

    stream   every document is encoded with `encode_ordinary` and followed by one EOT token;
             the EOT belongs to the document it ends
    rows     inputs x = s[t:t+T], targets y = s[t+1:t+T+1]
    doc id   exclusive cumulative sum of (x == EOT): the EOT keeps the id of its document
    position restarts at 0 on the token after each EOT and at the start of the row (a row that starts
             inside a document gives that token position 0, as Megatron-LM, torchtitan and HF do)
    loss     the target predicted *from* an EOT input is ignored (the next document's first token);
             predicting the EOT itself counts, so the model learns to end documents

Worked example: documents of 3, 2 and 3 tokens in one 8-slot row give document ids 0 0 0 1 1 2 2 2 and
positions 0 1 2 0 1 0 1 2. The document mask itself (three small lower triangles) is built in model.py
from those ids; a batch only says whether to build it.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tiktoken
import torch

EOT_TEXT = "<|endoftext|>"

IGNORE_INDEX = -100  # targets with this value do not count in the loss (torch's cross_entropy default)


class DataError(Exception):
    """A problem with the user's data or prepared shards; train.py prints it as one line."""


# ----------------------------------------------------------------------------------------------
# The three fixes and the batch


@dataclass(frozen=True)
class Flags:
    """The three fixes of packing, on by default; each one off is an ablation (README: "The three flags").
    Each flag's whole effect is one line: reset_position_ids and mask_boundary_loss in `make_batch`,
    doc_mask in model.attention_mask."""

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
    """Ignore the target predicted from an EOT input (the next document's first token); keep EOT as a
    target, so the model learns to end documents. Masked by the input, so no look-ahead is needed."""
    return targets.masked_fill(inputs == eot_id, IGNORE_INDEX)


@dataclass
class Batch:
    inputs: torch.Tensor  # (B, T) token ids
    targets: torch.Tensor  # (B, T) token ids, IGNORE_INDEX where not counted
    doc_ids: torch.Tensor  # (B, T) document index within the row
    position_ids: torch.Tensor  # (B, T) position fed to the model
    doc_positions: torch.Tensor  # (B, T) position within the document, for loss-by-position reports
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
    stream: TokenStream | np.ndarray,
    starts: np.ndarray,
    n_real: np.ndarray,
    seq_len: int,
    eot_id: int,
    *,
    flags: Flags = Flags(),
    doc_offsets: np.ndarray | None = None,
) -> Batch:
    """Gather rows [start, start + n_real) of the stream into a batch (vectorised, no per-token loop).

    Padding inputs are EOT, so each padding token is its own one-token document that nothing real
    attends to; padding targets are always ignored. `doc_offsets` gives how far into its document each
    row starts (pad rows of long documents), only for `doc_positions`.
    """
    window = np.arange(seq_len + 1)
    real = window[None, :] < n_real[:, None]
    index = np.minimum(starts[:, None] + window[None, :], len(stream) - 1)
    tokens = torch.from_numpy(np.where(real, stream[index].astype(np.int64), eot_id))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[~torch.from_numpy(real[:, 1:])] = IGNORE_INDEX
    positions = reset_positions(inputs, eot_id)
    doc_ids = document_ids(inputs, eot_id)
    doc_positions = (
        positions if doc_offsets is None else positions + torch.from_numpy(doc_offsets)[:, None] * (doc_ids == 0)
    )
    # The reset_position_ids flag: its whole effect is this line.
    position_ids = positions if flags.reset_position_ids else torch.arange(seq_len).expand_as(inputs).clone()
    # The mask_boundary_loss flag: its whole effect is this line.
    if flags.mask_boundary_loss:
        targets = boundary_loss_masked(inputs, targets, eot_id)
    return Batch(inputs.contiguous(), targets, doc_ids, position_ids, doc_positions, doc_mask=flags.doc_mask)


def batch_of_rows(rows: list[np.ndarray], seq_len: int, eot_id: int, flags: Flags = Flags()) -> Batch:
    """A batch whose row r holds the tokens rows[r] (at most seq_len + 1: the inputs and the last target),
    padded like any row. For probes that lay documents out in a row by hand."""
    if any(len(row) > seq_len + 1 for row in rows):
        raise ValueError(f"a row holds at most seq_len + 1 = {seq_len + 1} tokens")
    stream = np.full((len(rows), seq_len + 1), eot_id, dtype=np.int64)
    for r, row in enumerate(rows):
        stream[r, : len(row)] = row
    starts = np.arange(len(rows)) * (seq_len + 1)
    return make_batch(stream.reshape(-1), starts, np.array([len(row) for row in rows]), seq_len, eot_id, flags=flags)


# ----------------------------------------------------------------------------------------------
# Rows: concat rows are contiguous windows of the stream, always full; pad rows hold one document (or one chunk
# of a long one) and padding. A row is its `start` and how many of its T+1 tokens are real (`n_real`).


def concat_rows(n_tokens: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Contiguous, non-overlapping windows of T+1 tokens (consecutive rows share one token, as x/y do)."""
    starts = np.arange(0, n_tokens - seq_len, seq_len, dtype=np.int64)
    return starts, np.full_like(starts, seq_len + 1), np.zeros_like(starts)


def pad_rows(stream: TokenStream | np.ndarray, eot_id: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row per document, or per chunk of T inputs of a longer one: (starts, n_real, doc_offsets)."""
    doc_starts, doc_ends = document_bounds(stream, eot_id)
    lengths = doc_ends - doc_starts  # EOT included
    n_chunks = np.maximum(1, -(-(lengths - 1) // seq_len))  # chunks with at least one target
    doc_of_chunk = np.repeat(np.arange(len(lengths)), n_chunks)
    first_chunk = np.cumsum(n_chunks) - n_chunks
    offsets = (np.arange(len(doc_of_chunk)) - first_chunk[doc_of_chunk]) * seq_len
    n_real = np.minimum(seq_len + 1, lengths[doc_of_chunk] - offsets)
    return doc_starts[doc_of_chunk] + offsets, n_real, offsets


class PackedBatches:
    """A deterministic, resumable sequence of batches from one split.

    Rows are shuffled once per epoch with a seed derived from (seed, epoch), so two runs with the
    same seed see the same data in the same order whatever their flags; the position in the sequence
    is two integers, saved in checkpoints.
    """

    def __init__(
        self,
        stream: TokenStream | np.ndarray,
        eot_id: int,
        seq_len: int,
        batch_size: int,
        packing: str = "concat",
        *,
        flags: Flags = Flags(),
        shuffle: bool = True,
        seed: int = 0,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if packing == "concat":
            self.starts, self.n_real, self.offsets = concat_rows(len(stream), seq_len)
        elif packing == "pad":
            self.starts, self.n_real, self.offsets = pad_rows(stream, eot_id, seq_len)
        else:
            raise ValueError(f"packing must be 'concat' or 'pad', got {packing!r}")
        needed = batch_size * world_size if shuffle else 1  # training takes whole global batches
        if len(self.starts) < needed:
            raise DataError(
                f"the {split} split's {len(stream):,} tokens give {len(self.starts)} rows of seq_len {seq_len} with "
                f"packing={packing}, fewer than batch_size {batch_size} x {world_size} process(es): "
                "use more data or smaller settings"
            )
        self.stream, self.eot_id, self.seq_len, self.batch_size = stream, eot_id, seq_len, batch_size
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.flags = flags
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.starts))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.starts))

    def batch(self, rows: np.ndarray, n_empty: int = 0) -> Batch:
        """These rows, then n_empty empty rows (all EOT inputs, no counted target)."""
        empty = np.zeros(n_empty, dtype=np.int64)
        return make_batch(
            self.stream,
            np.concatenate([self.starts[rows], empty]),
            np.concatenate([self.n_real[rows], empty]),
            self.seq_len,
            self.eot_id,
            flags=self.flags,
            doc_offsets=np.concatenate([self.offsets[rows], empty]),
        )

    def next(self) -> Batch:
        """This process's share of the next global batch: every process steps through the same row
        order, and process r takes rows [r * batch_size, (r + 1) * batch_size) of each global batch."""
        global_batch = self.batch_size * self.world_size
        if self.cursor + global_batch > len(self.starts):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._epoch_order()
        first = self.cursor + self.rank * self.batch_size
        self.cursor += global_batch
        return self.batch(self._order[first : first + self.batch_size])

    def all_batches(self):
        """Every row in order (evaluation), in batches of batch_size rows. The last is filled up with empty
        rows, so a compiled model sees one shape and never recompiles."""
        n = len(self.starts)
        for i in range(0, n, self.batch_size):
            rows = self._order[i : min(i + self.batch_size, n)]
            yield self.batch(rows, n_empty=self.batch_size - len(rows))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._epoch_order()


# ----------------------------------------------------------------------------------------------
# Reading prepared shards: <folder>/{train,val}_NNNNNN.bin (flat uint16/uint32 tokens), tokenizer.tiktoken,
# meta.json, inputs.json. Every shard is memory-mapped; each split reads as one array.


SHARD_FORMAT_VERSION = 2

PREPARED_FILES = ("meta.json", "inputs.json", "tokenizer.tiktoken")

# what loading and `describe` read
META_KEYS = ("tokenizer_sha256", "pattern", "vocab_size", "eot_id", "dtype", "splits", "dataset", "tokenizer_name")

META_KEYS += ("skipped", "bytes_read", "seconds")


class TokenStream:
    """The tokens of one split, as one array over its shard files: len(), slices (read into memory) and
    integer-array indexing (a gather across shards, so a row may span two of them)."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(p) for p in parts])
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError("TokenStream slices take no step")
            first, last = (np.searchsorted(self.offsets, [start, max(start, stop - 1)], side="right") - 1).tolist()
            pieces = [
                self.parts[p][max(start - self.offsets[p], 0) : max(stop - self.offsets[p], 0)]
                for p in range(first, min(last, len(self.parts) - 1) + 1)
            ]
            return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)
        index = np.asarray(key)
        if len(self.parts) == 1:
            return self.parts[0][index]
        part = np.searchsorted(self.offsets, index, side="right") - 1
        out = np.empty(index.shape, self.dtype)
        for p in np.unique(part):
            chosen = part == p
            out[chosen] = self.parts[p][index[chosen] - self.offsets[p]]
        return out


@dataclass
class Shards:
    meta: dict
    train: TokenStream
    val: TokenStream

    @property
    def eot_id(self) -> int:
        return self.meta["eot_id"]

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]


def is_prepared_folder(dataset: str) -> bool:
    """A folder written by `prepare` can itself be given as the dataset (e.g. after copying data/)."""
    return (
        bool(dataset.strip()) and (Path(dataset) / "meta.json").is_file() and (Path(dataset) / "inputs.json").is_file()
    )


def load_shards(path: Path) -> Shards:
    """Memory-map prepared shards, checking that every file is complete and consistent (sizes always;
    token ids in the first and last MiB of each shard, so loading stays fast on any corpus)."""
    meta_path = Path(path) / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise DataError(f"{meta_path} not found: prepare the data first") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"{meta_path} is corrupted (not valid JSON)") from None
    if not isinstance(meta, dict) or meta.get("format_version") != SHARD_FORMAT_VERSION:
        raise DataError(f"{path} was prepared by another version of prepare.py; delete it to prepare again")
    missing = [key for key in META_KEYS if key not in meta]
    splits = meta.get("splits")
    whole = isinstance(splits, dict) and all(
        isinstance(splits.get(split), dict)
        and isinstance(splits[split].get("shards"), list)
        and splits[split]["shards"]
        and all(isinstance(shard, dict) and {"file", "tokens"} <= shard.keys() for shard in splits[split]["shards"])
        for split in ("train", "val")
    )
    if missing or not whole:
        what = ", ".join(missing) or "its splits' shards"
        raise DataError(f"{meta_path} lacks {what}: it is damaged; delete {path} to prepare again")
    tok_path = Path(path) / "tokenizer.tiktoken"
    if not tok_path.is_file() or hashlib.sha256(tok_path.read_bytes()).hexdigest() != meta["tokenizer_sha256"]:
        raise DataError(f"{tok_path} is missing or does not match meta.json; delete {path} to prepare again")
    dtype = np.dtype(meta["dtype"])
    streams = {}
    for split, info in meta["splits"].items():
        parts = []
        for shard in info["shards"]:
            bin_path = Path(path) / shard["file"]
            expected = shard["tokens"] * dtype.itemsize
            actual = bin_path.stat().st_size if bin_path.exists() else None
            if actual != expected:
                raise DataError(
                    f"{bin_path} is truncated or corrupted: {actual} bytes, meta.json says {expected}; "
                    f"delete {path} to prepare again"
                )
            tokens = np.memmap(bin_path, dtype=dtype, mode="r")
            edge = (1 << 20) // dtype.itemsize
            if max(tokens[:edge].max(), tokens[-edge:].max()) >= meta["vocab_size"]:
                raise DataError(
                    f"{bin_path} does not match its tokenizer (bad token ids); delete {path} to prepare again"
                )
            parts.append(tokens)
        if parts[-1][-1] != meta["eot_id"]:
            raise DataError(f"{bin_path} does not end a document; delete {path} to prepare again")
        streams[split] = TokenStream(parts)
    return Shards(meta=meta, train=streams["train"], val=streams["val"])


def load_tokenizer(path: Path) -> tiktoken.Encoding:
    """The tokenizer saved beside prepared shards (works offline)."""
    meta, tokenizer = json.loads((Path(path) / "meta.json").read_text()), Path(path) / "tokenizer.tiktoken"
    return read_tiktoken(
        tokenizer.read_bytes(), meta["pattern"], meta["tokenizer_name"], str(tokenizer), meta["eot_id"]
    )


def leading_documents(stream: TokenStream | np.ndarray, eot_id: int, max_tokens: int) -> TokenStream | np.ndarray:
    """The whole documents at the start of a split that fit in max_tokens (at least the first one; all
    for 0): a fixed subset, the same for every run, since the stream's order depends only on data_seed."""
    if max_tokens == 0 or max_tokens >= len(stream):
        return stream
    head = np.asarray(stream[:max_tokens])
    ends = np.flatnonzero(head == eot_id)
    if len(ends):
        return head[: ends[-1] + 1]
    first_end = eot_positions(stream, eot_id)[0]
    return np.asarray(stream[: first_end + 1])


def eot_positions(stream: TokenStream | np.ndarray, eot_id: int, chunk: int = 1 << 24) -> np.ndarray:
    """Positions of every EOT, read in chunks so a large split is never compared all at once."""
    found = [np.flatnonzero(np.asarray(stream[i : i + chunk]) == eot_id) + i for i in range(0, len(stream), chunk)]
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


def document_bounds(stream: TokenStream | np.ndarray, eot_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the documents of a stream: each ends just after its EOT."""
    ends = eot_positions(stream, eot_id) + 1
    return np.concatenate([[0], ends[:-1]]).astype(np.int64), ends


# ----------------------------------------------------------------------------------------------
# The tokenizer: a tiktoken Encoding whose only special token is EOT


def tiktoken_encoding(ranks: dict[bytes, int], pattern: str, name: str, eot_id: int | None = None) -> tiktoken.Encoding:
    """An Encoding of these merge ranks whose one special token is EOT: at `eot_id` (a named tiktoken
    encoding keeps its own), or the id after the last rank (a BPE trained here)."""
    eot_id = max(ranks.values()) + 1 if eot_id is None else eot_id
    return tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={EOT_TEXT: eot_id})


def read_tiktoken(content: bytes, pattern: str, name: str, where: str, eot_id: int | None = None) -> tiktoken.Encoding:
    """A .tiktoken file's content (one 'base64-token rank' per line, ranks 0..n-1 once each, every byte a
    token), checked; `where` names it in errors; EOT at `eot_id` (see tiktoken_encoding). The one reader:
    of shards, checkpoints and user files."""
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(content.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            token, rank = base64.b64decode(token, validate=True), int(rank)
        except ValueError:
            raise DataError(f"{where}:{line_no}: not a .tiktoken file (expected 'base64-token rank')") from None
        if token in ranks:
            raise DataError(f"{where}:{line_no}: token {token!r} appears twice")
        ranks[token] = rank
    if not ranks:
        raise DataError(f"{where} holds no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{where}: ranks must be 0..{len(ranks) - 1}, each once (found duplicates, gaps or negatives)")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise DataError(
            f"{where}: {len(missing)} single bytes are not tokens (e.g. {bytes(missing[:1])!r}); "
            "a byte-level BPE needs all 256"
        )
    return tiktoken_encoding(ranks, pattern, name, eot_id)


def decoded(enc: tiktoken.Encoding, ids: list[int]) -> str:
    """A generated document's text: its ids up to its EOT, without the ids past the tokenizer's (the model's
    vocabulary is padded to a multiple of 64, so an untrained model can sample them)."""
    ids = ids[: ids.index(enc.eot_token)] if enc.eot_token in ids else ids
    return enc.decode([t for t in ids if t < enc.n_vocab])
