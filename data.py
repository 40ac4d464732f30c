"""Corpora -> tokenizer -> token shards -> packed training batches.

All packing semantics live in this file, in `make_batch` and the three small functions it calls.
They follow Megatron-LM's flags (see README, "The three flags"):

    stream   every document is encoded with `encode_ordinary` and followed by one EOT token;
             the EOT belongs to the document it ends
    rows     inputs x = s[t:t+T], targets y = s[t+1:t+T+1]
    doc id   exclusive cumulative sum of (x == EOT): the EOT keeps the id of its document
    position restarts at 0 on the token after each EOT and at the start of the row
    loss     the target predicted *from* an EOT input is ignored (it is the next document's first token)

The document mask itself is applied in model.py; this file only produces the document ids it needs.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import random
import shutil
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tiktoken
import torch

EOT_TEXT = "<|endoftext|>"
IGNORE_INDEX = -100  # targets with this value do not count in the loss (torch's cross_entropy default)
# The GPT-4 style split pattern, as produced by rustbpe; also used for user-supplied .tiktoken files.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
BUILTIN_DATASETS = ("stdlib", "stdlib-files")
SHARD_FORMAT_VERSION = 1


class DataError(Exception):
    """A problem with the user's data or prepared shards; train.py prints it as one line."""


# ----------------------------------------------------------------------------------------------
# Corpora: each loader returns (documents, skipped) where skipped counts what was left out and why.


def _stdlib_modules() -> list[Path]:
    """Non-test modules of the running interpreter's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    test_dirs = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    modules = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if test_dirs.intersection(parts) or parts[-1].startswith("test_"):
            continue
        modules.append(path)
    return modules


def _top_level_definitions(source: str) -> list[str]:
    """Top-level functions and classes of a module, decorators included (CodeSearchNet-style)."""
    lines = source.splitlines(keepends=True)
    pieces = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            pieces.append("".join(lines[first - 1 : node.end_lineno]))
    return pieces


def load_stdlib(split_definitions: bool) -> tuple[list[str], dict[str, int]]:
    docs, skipped = [], {"not_utf8": 0, "syntax_error": 0}
    for path in _stdlib_modules():
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        if not split_definitions:
            docs.append(source)
            continue
        try:
            docs.extend(_top_level_definitions(source))
        except SyntaxError:
            skipped["syntax_error"] += 1
    return docs, skipped


def load_directory(root: Path) -> tuple[list[str], dict[str, int]]:
    """One document per regular file below `root` (hidden files and folders skipped)."""
    docs, skipped = [], {"not_utf8": 0}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or any(p.startswith(".") for p in path.relative_to(root).parts):
            continue
        try:
            docs.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
    return docs, skipped


def load_jsonl(path: Path) -> tuple[list[str], dict[str, int]]:
    """One document per line, from the line's "text" field."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataError(f'{path}:{line_no}: expected a JSON object with a "text" field') from None
            if not isinstance(text, str):
                raise DataError(f'{path}:{line_no}: "text" must be a string, got {type(text).__name__}')
            docs.append(text)
    return docs, {}


def load_separated_text(path: Path) -> tuple[list[str], dict[str, int]]:
    """A text file whose documents are separated by the literal text <|endoftext|>."""
    return path.read_text(encoding="utf-8").split(EOT_TEXT), {}


def load_documents(dataset: str) -> tuple[list[str], dict[str, int]]:
    """Documents of a built-in corpus or a user path, with counts of what was skipped."""
    if dataset == "stdlib":
        docs, skipped = load_stdlib(split_definitions=True)
    elif dataset == "stdlib-files":
        docs, skipped = load_stdlib(split_definitions=False)
    else:
        path = Path(dataset)
        if not path.exists():
            raise DataError(
                f"dataset {dataset!r} not found: give one of {', '.join(BUILTIN_DATASETS)}, a directory of "
                "text files, a .jsonl file with a 'text' field, or a text file separated by <|endoftext|>"
            )
        try:
            if path.is_dir():
                docs, skipped = load_directory(path)
            elif path.suffix == ".jsonl":
                docs, skipped = load_jsonl(path)
            else:
                docs, skipped = load_separated_text(path)
        except UnicodeDecodeError as e:
            raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    non_empty = [d for d in docs if d.strip()]
    skipped["empty"] = len(docs) - len(non_empty)
    return non_empty, skipped


def deduplicate_and_split(docs: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str], int]:
    """Drop exact duplicates, shuffle with a fixed seed, split by document. Returns (train, val, n_dups)."""
    unique = list(dict.fromkeys(docs))
    random.Random(seed).shuffle(unique)
    n_val = max(1, round(len(unique) * val_fraction))
    if len(unique) - n_val < 1:
        raise DataError(f"only {len(unique)} distinct non-empty documents: need at least 2 (train and val)")
    return unique[n_val:], unique[:n_val], len(docs) - len(unique)


# ----------------------------------------------------------------------------------------------
# Tokenizer: always a tiktoken Encoding whose only special token is EOT, saved beside the shards.


def _encoding_from_ranks(ranks: dict[bytes, int], pattern: str, name: str) -> tiktoken.Encoding:
    eot_id = max(ranks.values()) + 1
    return tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={EOT_TEXT: eot_id})


def train_bpe(docs: list[str], vocab_size: int) -> tiktoken.Encoding:
    """A byte-level BPE trained with rustbpe; the last id of the vocabulary is EOT."""
    import rustbpe  # only needed here, so machines that get prepared data need not install it

    if not 257 <= vocab_size <= 65536:
        raise DataError(f"tokenizer_vocab_size must be in [257, 65536], got {vocab_size}")
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(docs), vocab_size - 1)  # one id left for EOT
    ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
    return _encoding_from_ranks(ranks, trainer.get_pattern(), f"bpe{vocab_size}")


def read_tiktoken_file(path: Path, pattern: str = SPLIT_PATTERN) -> tiktoken.Encoding:
    ranks = {}
    for line_no, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError:
            raise DataError(f"{path}:{line_no}: not a .tiktoken file (expected 'base64-token rank')") from None
    if not ranks:
        raise DataError(f"{path} holds no tokens")
    return _encoding_from_ranks(ranks, pattern, path.stem)


def write_tiktoken_file(enc: tiktoken.Encoding, path: Path) -> None:
    ranks = enc._mergeable_ranks  # tiktoken exposes no public accessor for the ranks
    lines = [base64.b64encode(token) + b" " + str(rank).encode() for token, rank in ranks.items()]
    path.write_bytes(b"\n".join(lines) + b"\n")


def make_tokenizer(tokenizer: str, vocab_size: int, train_docs: list[str]) -> tiktoken.Encoding:
    """'bpe' trains one on the training documents; a .tiktoken path or a tiktoken encoding name loads one."""
    if tokenizer == "bpe":
        return train_bpe(train_docs, vocab_size)
    if tokenizer.endswith(".tiktoken"):
        if not Path(tokenizer).is_file():
            raise DataError(f"tokenizer file {tokenizer} not found")
        return read_tiktoken_file(Path(tokenizer))
    try:
        enc = tiktoken.get_encoding(tokenizer)
    except ValueError:
        raise DataError(
            f"unknown tokenizer {tokenizer!r}: use 'bpe', a tiktoken encoding name such as 'gpt2', "
            "or a path to a .tiktoken file"
        ) from None
    except Exception as e:  # tiktoken fetches its files over the network on first use
        raise DataError(
            f"could not load tiktoken encoding {tokenizer!r} ({type(e).__name__}): it downloads its files on "
            "first use. Offline, use tokenizer='bpe' or a local .tiktoken file, or set TIKTOKEN_CACHE_DIR to a "
            "cache filled on a machine with network access"
        ) from None
    if EOT_TEXT not in enc.special_tokens_set:
        raise DataError(f"tiktoken encoding {tokenizer!r} has no {EOT_TEXT} token")
    # Keep only EOT as a special token, so every encoding is saved and reloaded the same way.
    ranks = enc._mergeable_ranks
    return tiktoken.Encoding(
        tokenizer, pat_str=enc._pat_str, mergeable_ranks=ranks, special_tokens={EOT_TEXT: enc.eot_token}
    )


# ----------------------------------------------------------------------------------------------
# Shards: <dir>/{train,val}.bin (flat tokens), tokenizer.tiktoken, meta.json.


def encode_documents(enc: tiktoken.Encoding, docs: list[str]) -> np.ndarray:
    """The token stream: each document encoded as ordinary text (a literal <|endoftext|> stays text),
    followed by one EOT."""
    dtype = np.uint16 if enc.n_vocab <= 2**16 else np.uint32
    encoded = enc.encode_ordinary_batch(docs, num_threads=os.cpu_count() or 1)
    lengths = np.fromiter((len(e) + 1 for e in encoded), dtype=np.int64, count=len(encoded))
    stream = np.full(int(lengths.sum()), enc.eot_token, dtype=dtype)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for offset, ids in zip(offsets, encoded):
        stream[offset : offset + len(ids)] = ids
    return stream


def shard_dir_for(data_dir: str, dataset: str, tokenizer: str, vocab_size: int, val_fraction: float, seed: int) -> Path:
    """Readable, and unique to the settings that decide the shards' content."""
    settings = json.dumps([dataset, tokenizer, vocab_size, val_fraction, seed, SHARD_FORMAT_VERSION])
    stem = Path(dataset).name if dataset not in BUILTIN_DATASETS else dataset
    tok = f"bpe{vocab_size}" if tokenizer == "bpe" else Path(tokenizer).stem
    return Path(data_dir) / f"{stem}-{tok}-{hashlib.sha256(settings.encode()).hexdigest()[:8]}"


def prepare(
    dataset: str,
    data_dir: str,
    tokenizer: str = "bpe",
    vocab_size: int = 8192,
    val_fraction: float = 0.05,
    seed: int = 1337,
    log=print,
) -> Path:
    """Prepare shards unless already there. Writes to a temporary folder and renames it when complete,
    so an interrupted preparation never leaves shards that look valid."""
    out = shard_dir_for(data_dir, dataset, tokenizer, vocab_size, val_fraction, seed)
    if (out / "meta.json").exists():
        return out
    t0 = time.time()
    docs, skipped = load_documents(dataset)
    if not docs:
        raise DataError(f"dataset {dataset!r} holds no non-empty documents")
    train_docs, val_docs, n_dups = deduplicate_and_split(docs, val_fraction, seed)
    skipped["duplicate"] = n_dups
    skipped_text = ", ".join(f"{n} {why}" for why, n in skipped.items() if n) or "none"
    log(f"data: {len(train_docs):,} train and {len(val_docs):,} val documents from {dataset} (skipped: {skipped_text})")
    enc = make_tokenizer(tokenizer, vocab_size, train_docs)
    log(f"data: tokenizer {enc.name}, vocabulary {enc.n_vocab:,} with EOT = {enc.eot_token} ({time.time() - t0:.1f}s)")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_tiktoken_file(enc, tmp / "tokenizer.tiktoken")
        meta = {
            "format_version": SHARD_FORMAT_VERSION,
            "dataset": dataset,
            "tokenizer": tokenizer,
            "tokenizer_name": enc.name,
            "pattern": enc._pat_str,
            "tokenizer_sha256": hashlib.sha256((tmp / "tokenizer.tiktoken").read_bytes()).hexdigest(),
            "vocab_size": enc.n_vocab,
            "eot_id": enc.eot_token,
            "val_fraction": val_fraction,
            "seed": seed,
            "skipped": skipped,
            "splits": {},
        }
        for split, split_docs in (("train", train_docs), ("val", val_docs)):
            stream = encode_documents(enc, split_docs)
            stream.tofile(tmp / f"{split}.bin")
            meta["dtype"] = stream.dtype.name
            meta["splits"][split] = {"documents": len(split_docs), "tokens": int(stream.size)}
            log(f"data: {split}: {len(split_docs):,} documents, {stream.size:,} tokens")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        os.replace(tmp, out)  # atomic: the folder appears only when complete
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"data: wrote {out} in {time.time() - t0:.1f}s")
    return out


@dataclass
class Shards:
    meta: dict
    train: np.ndarray
    val: np.ndarray

    @property
    def eot_id(self) -> int:
        return self.meta["eot_id"]

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]


def load_shards(path: Path) -> Shards:
    """Memory-map prepared shards, checking that every file is complete and consistent."""
    meta_path = Path(path) / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise DataError(f"{meta_path} not found: prepare the data first") from None
    except json.JSONDecodeError:
        raise DataError(f"{meta_path} is corrupted (not valid JSON)") from None
    if meta.get("format_version") != SHARD_FORMAT_VERSION:
        raise DataError(f"{path} was prepared by another version of data.py; delete it to prepare again")
    tok_path = Path(path) / "tokenizer.tiktoken"
    if not tok_path.is_file() or hashlib.sha256(tok_path.read_bytes()).hexdigest() != meta["tokenizer_sha256"]:
        raise DataError(f"{tok_path} is missing or does not match meta.json; delete {path} to prepare again")
    dtype = np.dtype(meta["dtype"])
    arrays = {}
    for split, info in meta["splits"].items():
        bin_path = Path(path) / f"{split}.bin"
        expected = info["tokens"] * dtype.itemsize
        actual = bin_path.stat().st_size if bin_path.exists() else None
        if actual != expected:
            raise DataError(
                f"{bin_path} is truncated or corrupted: {actual} bytes, meta.json says {expected}; "
                f"delete {path} to prepare again"
            )
        tokens = np.memmap(bin_path, dtype=dtype, mode="r")
        if tokens[-1] != meta["eot_id"] or tokens.max(initial=0) >= meta["vocab_size"]:
            raise DataError(f"{bin_path} does not match its tokenizer (bad token ids); delete {path} to prepare again")
        arrays[split] = tokens
    return Shards(meta=meta, train=arrays["train"], val=arrays["val"])


def load_tokenizer(path: Path) -> tiktoken.Encoding:
    """The tokenizer saved beside prepared shards (works offline)."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    return read_tiktoken_file(Path(path) / "tokenizer.tiktoken", meta["pattern"])


# ----------------------------------------------------------------------------------------------
# Packing. A row is a window of the token stream: `start` and how many of its T+1 tokens are real
# (`n_real`); the rest is padding. Concat rows are always full; pad rows hold one document (or one
# chunk of a long one) and padding.


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

    def to(self, device: torch.device | str) -> "Batch":
        """To CUDA from pinned memory without blocking, so the next batch is built while the GPU works."""
        cuda = torch.device(device).type == "cuda"
        fields = (getattr(self, f) for f in self.__dataclass_fields__)
        return Batch(*(t.pin_memory().to(device, non_blocking=True) if cuda else t.to(device) for t in fields))


def make_batch(
    stream: np.ndarray,
    starts: np.ndarray,
    n_real: np.ndarray,
    seq_len: int,
    eot_id: int,
    reset_position_ids: bool = True,
    mask_boundary_loss: bool = True,
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
    position_ids = positions if reset_position_ids else torch.arange(seq_len).expand_as(inputs).clone()
    # The mask_boundary_loss flag: its whole effect is this line.
    if mask_boundary_loss:
        targets = boundary_loss_masked(inputs, targets, eot_id)
    return Batch(inputs.contiguous(), targets, doc_ids, position_ids, doc_positions)


def concat_rows(n_tokens: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Contiguous, non-overlapping windows of T+1 tokens (consecutive rows share one token, as x/y do)."""
    starts = np.arange(0, n_tokens - seq_len, seq_len, dtype=np.int64)
    return starts, np.full_like(starts, seq_len + 1), np.zeros_like(starts)


def pad_rows(stream: np.ndarray, eot_id: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row per document, or per chunk of T inputs of a longer one: (starts, n_real, doc_offsets)."""
    doc_ends = np.flatnonzero(np.asarray(stream) == eot_id) + 1
    doc_starts = np.concatenate([[0], doc_ends[:-1]])
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
        stream: np.ndarray,
        eot_id: int,
        seq_len: int,
        batch_size: int,
        packing: str = "concat",
        shuffle: bool = True,
        seed: int = 0,
        reset_position_ids: bool = True,
        mask_boundary_loss: bool = True,
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
        if len(self.starts) < batch_size * world_size:
            raise DataError(
                f"the {split} split's {len(stream):,} tokens give {len(self.starts)} rows of seq_len {seq_len} with "
                f"packing={packing}, fewer than batch_size {batch_size} x {world_size} process(es): "
                "use more data or smaller settings"
            )
        self.stream, self.eot_id, self.seq_len, self.batch_size = stream, eot_id, seq_len, batch_size
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.reset_position_ids, self.mask_boundary_loss = reset_position_ids, mask_boundary_loss
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.starts))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.starts))

    def batch(self, rows: np.ndarray) -> Batch:
        return make_batch(
            self.stream,
            self.starts[rows],
            self.n_real[rows],
            self.seq_len,
            self.eot_id,
            self.reset_position_ids,
            self.mask_boundary_loss,
            self.offsets[rows],
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

    def all_batches(self, max_rows: int | None = None):
        """Every row in order (evaluation), in batches; the last batch may be smaller."""
        n = len(self.starts) if max_rows is None else min(max_rows, len(self.starts))
        for i in range(0, n, self.batch_size):
            yield self.batch(self._order[i : min(i + self.batch_size, n)])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._epoch_order()
