"""Reading what prepare.py writes: a split's shards ({train,val}_NNNNNN.bin, flat uint16/uint32 tokens) as one
memory-mapped array, meta.json, and the tokenizer, whose special tokens are EOT and, with the marker, BOS."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tiktoken

from config import BPE_SETTINGS_IN_META, SETTINGS_IN_META, setting_problem
from data import eot_positions
from errors import ConfigError, DataError

EOT_TEXT = "<|endoftext|>"
BOS_TEXT = "<|bos|>"  # the start marker's text, for decoding and the export; never read from text

SHARD_FORMAT_VERSION = 3  # 3: folders named by content (no modification times), timings out of meta.json

PREPARED_FILES = ("meta.json", "inputs.json", "tokenizer.tiktoken")
TIMINGS_FILE = "timings.json"  # how long the preparation took: the one file that differs between machines

# what loading a prepared folder, describing it, and training on it read from its meta.json: a folder without
# one is damaged
META_KEYS = (
    *("tokenizer_sha256", "pattern", "vocab_size", "eot_id", "dtype", "splits", "dataset", "tokenizer_name"),
    *("skipped", "bytes_read"),  # the preparation's own account, which `describe` prints
    *("settings", "tokenizer"),  # the data settings a run on the folder adopts (resolve.with_prepared_settings)
)
SETTINGS_KEYS = ("val_fraction", "seed", "text_field", "tokenizer")  # of meta["settings"], read the same way


class TokenStream:
    """One split's tokens as one array over its shard files: len(), slices, and integer-array gathers."""

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


def read_timings(path: Path) -> dict:
    """The preparation's timings; {} when they were not kept, or are not the numbers prepare.py writes (a folder
    copied without them, or with others, is still whole)."""
    try:
        timings = json.loads((Path(path) / TIMINGS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(timings, dict) or not isinstance(timings.get("seconds"), dict):
        return {}
    phases = ("tokenizer", "encoding", "shards", "total")
    numbers = [timings.get("prepared_at"), *(timings["seconds"].get(phase) for phase in phases)]
    return timings if all(type(x) in (int, float) for x in numbers) else {}


def content_digests(path: Path) -> dict[str, str]:
    """SHA-256 of every file of a prepared folder but its timings, by name: equal on two machines exactly when
    they prepared the same data."""
    digests = {}
    for file in sorted(Path(path).iterdir()):
        if file.is_file() and file.name != TIMINGS_FILE:
            with open(file, "rb") as f:
                digests[file.name] = hashlib.file_digest(f, "sha256").hexdigest()
    return digests


def digest_of(digests: dict[str, str]) -> str:
    """One digest for a folder's per-file digests (what a study records of its data)."""
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


def load_shards(path: Path) -> Shards:
    """Memory-map prepared shards, checking every file is complete (sizes; token ids in each shard's first and
    last MiB, so loading stays fast on any corpus)."""
    meta_path = Path(path) / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise DataError(f"{meta_path} not found: prepare the data first") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"{meta_path} is corrupted (not valid JSON)") from None
    if not isinstance(meta, dict) or meta.get("format_version") != SHARD_FORMAT_VERSION:
        raise DataError(f"{path} was prepared by another version of prepare.py; delete it to prepare again")
    check_meta(meta, meta_path)
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


def check_meta(meta: dict, meta_path: Path) -> None:
    """Every field of meta.json that is read, there and of its type and range (a folder copied from elsewhere
    can hold anything), or one line naming the first that is not."""
    missing = [key for key in META_KEYS if key not in meta]
    settings = meta.get("settings")
    missing += [f"settings.{key}" for key in SETTINGS_KEYS if not isinstance(settings, dict) or key not in settings]
    splits = meta.get("splits")
    whole = isinstance(splits, dict) and all(
        isinstance(splits.get(split), dict)
        and isinstance(splits[split].get("shards"), list)
        and splits[split]["shards"]
        and all(isinstance(shard, dict) and {"file", "tokens"} <= shard.keys() for shard in splits[split]["shards"])
        for split in ("train", "val")
    )
    damaged = f"it is damaged; delete {meta_path.parent} to prepare again"
    if missing or not whole:
        raise DataError(f"{meta_path} lacks {', '.join(missing) or 'its splits’ shards'}: {damaged}")
    for name, value, (expected, fits) in meta_fields(meta):
        if not fits(value):
            raise DataError(f"{meta_path}: {name} is {json.dumps(value)[:80]}, not {expected}: {damaged}")
    if meta["eot_id"] >= meta["vocab_size"]:
        raise DataError(f"{meta_path}: eot_id {meta['eot_id']} is not below vocab_size {meta['vocab_size']}: {damaged}")


def _whole(least: int = 0) -> tuple[str, Callable[[object], bool]]:
    return f"a whole number of at least {least}", lambda v: type(v) is int and v >= least


def _counts(value: object) -> bool:
    return isinstance(value, dict) and all(type(n) is int and n >= 0 for n in value.values())


def _file_lists(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(v, list) and all(isinstance(f, str) for f in v) for v in value.values()
    )


TEXT = ("text", lambda v: isinstance(v, str))
# what each field that loading, describing and training on a prepared folder read must be (the optional ones
# where they are written)
META_FIELDS = {
    **dict.fromkeys(("tokenizer_sha256", "pattern", "dataset", "tokenizer_name", "tokenizer"), TEXT),
    **dict.fromkeys(("eot_id", "bytes_read", "lone_surrogates_replaced"), _whole()),
    "vocab_size": _whole(1),
    "dtype": ("uint16 or uint32", lambda v: v in ("uint16", "uint32")),
    **dict.fromkeys(("skipped", "lone_surrogate_files"), ("a table of counts", _counts)),
    "tokenizer_trained_on": ("a table of counts, or null", lambda v: v is None or _counts(v)),  # null: not trained
    "skipped_files": ("a table of file lists", _file_lists),
}
SPLIT_FIELDS = {"documents": _whole(), "tokens": _whole()}
SHARD_FIELDS = {  # a shard's file is in the folder: a name, not a path
    "file": ("a file name", lambda v: isinstance(v, str) and v not in ("", ".", "..") and "/" not in v),
    "tokens": _whole(1),
}


def meta_fields(meta: dict) -> list[tuple[str, object, tuple[str, Callable[[object], bool]]]]:
    """(name, value, (what it must be, the check)) of every field of meta.json that is read. Its data settings
    are checked as the run's settings they become."""
    fields = [(name, meta[name], kind) for name, kind in META_FIELDS.items() if name in meta]
    for split in ("train", "val"):
        info = meta["splits"][split]
        fields += [(f"splits.{split}.{key}", info.get(key), kind) for key, kind in SPLIT_FIELDS.items()]
        for i, shard in enumerate(info["shards"]):
            fields += [(f"splits.{split}.shards[{i}].{key}", shard[key], kind) for key, kind in SHARD_FIELDS.items()]
    settings, keys = meta["settings"], {**SETTINGS_IN_META, "tokenizer": "tokenizer"}
    if settings["tokenizer"] == "bpe":  # a BPE trained here: the run adopts its size and sample too
        keys |= {key: name for key, name in BPE_SETTINGS_IN_META.items() if name in settings}
    for key, name in keys.items():
        fits = functools.partial(lambda key, v: setting_problem(key, v) is None, key)
        fields.append((f"settings.{name}", settings[name], (f"a value of the setting {key}", fits)))
    return fields


def load_trained_on(path: Path, state: dict) -> tuple[Path, Shards]:
    """The shard folder the checkpoint at `path` (its `state`) trained on, loaded: a resumed run trains on it
    or not at all."""
    folder = Path(state["shards"])
    try:
        prepared = load_shards(folder)
    except DataError as e:
        raise ConfigError(
            f"{path} trained on the shards in {folder}, which cannot be read now ({e}); a resumed run trains on "
            "the data it started on: restore that folder, or start a new run"
        ) from None
    if state["tokenizer_sha256"] != prepared.meta["tokenizer_sha256"]:
        raise ConfigError(f"{path} was trained with another tokenizer than the shards in {folder}")
    return folder, prepared


def load_tokenizer(path: Path) -> tiktoken.Encoding:
    """The tokenizer saved beside prepared shards (works offline)."""
    meta, tokenizer = json.loads((Path(path) / "meta.json").read_text()), Path(path) / "tokenizer.tiktoken"
    return read_tiktoken(
        tokenizer.read_bytes(), meta["pattern"], meta["tokenizer_name"], str(tokenizer), meta["eot_id"]
    )


def leading_documents(stream: TokenStream | np.ndarray, eot_id: int, max_tokens: int) -> TokenStream | np.ndarray:
    """The whole documents at a split's start that fit in max_tokens (at least one; 0: all): the same for
    every run, since the order depends only on data_seed."""
    if max_tokens == 0 or max_tokens >= len(stream):
        return stream
    head = np.asarray(stream[:max_tokens])
    ends = np.flatnonzero(head == eot_id)
    if len(ends):
        return head[: ends[-1] + 1]
    first_end = eot_positions(stream, eot_id)[0]
    return np.asarray(stream[: first_end + 1])


# ----------------------------------------------------------------------------------------------
# The tokenizer: a tiktoken Encoding whose only special token is EOT


def tiktoken_encoding(ranks: dict[bytes, int], pattern: str, name: str, eot_id: int | None = None) -> tiktoken.Encoding:
    """An Encoding whose one special token is EOT: at `eot_id`, or after the last rank (a BPE trained here)."""
    eot_id = max(ranks.values()) + 1 if eot_id is None else eot_id
    return tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={EOT_TEXT: eot_id})


def read_tiktoken(content: bytes, pattern: str, name: str, where: str, eot_id: int | None = None) -> tiktoken.Encoding:
    """A .tiktoken file's content ('base64-token rank' lines, ranks 0..n-1 once, every byte a token), checked;
    `where` names it in errors. The one reader, of shards, checkpoints and user files."""
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


def start_marker_id(enc: tiktoken.Encoding) -> int:
    """The BOS id: the first past the vocabulary (50257 for gpt2). A vocabulary holding the marker's text as a
    token is refused: the two would decode alike."""
    if BOS_TEXT.encode() in enc._mergeable_ranks:  # tiktoken exposes no public accessor for the ranks
        raise DataError(
            f"tokenizer {enc.name} holds {BOS_TEXT!r} as an ordinary token (id "
            f"{enc._mergeable_ranks[BOS_TEXT.encode()]}), so it cannot take the start marker; use bos=false"
        )
    return enc.n_vocab


def with_start_marker(enc: tiktoken.Encoding, bos_id: int | None) -> tiktoken.Encoding:
    """`enc` with the BOS as a second special token (text is encoded with encode_ordinary: "<|bos|>" stays text)."""
    if bos_id is None:
        return enc
    specials = {EOT_TEXT: enc.eot_token, BOS_TEXT: bos_id}
    return tiktoken.Encoding(
        enc.name, pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks, special_tokens=specials
    )


def token_bytes(enc: tiktoken.Encoding) -> np.ndarray:
    """Each id's length in UTF-8 bytes, 0 for the special tokens (EOT, BOS): what bits per byte divide by.
    A byte-level BPE's tokens are byte strings, so a text's token bytes add up to its own."""
    lengths = np.zeros(enc.n_vocab, dtype=np.int64)
    for token, rank in enc._mergeable_ranks.items():
        lengths[rank] = len(token)
    return lengths


def document_opening(enc: tiktoken.Encoding, text: str) -> list[int]:
    """The ids a document beginning with `text` starts with: the BOS first when the tokenizer has one."""
    bos = [enc.encode_single_token(BOS_TEXT)] if BOS_TEXT in enc.special_tokens_set else []
    return bos + enc.encode_ordinary(text)


def decoded(enc: tiktoken.Encoding, ids: list[int]) -> str:
    """A generated document's text: up to its EOT, without the BOS and ids past the tokenizer's (the model's
    vocabulary is padded to a multiple of 64)."""
    ids = ids[: ids.index(enc.eot_token)] if enc.eot_token in ids else ids
    return enc.decode([t for t in ids if t < enc.n_vocab and t not in enc._special_tokens.values()])


def document_bounds(stream: np.ndarray, eot_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the documents of a stream: each ends just after its EOT."""
    ends = eot_positions(stream, eot_id) + 1
    return np.concatenate([[0], ends[:-1]]).astype(np.int64), ends
