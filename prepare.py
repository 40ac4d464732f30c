"""Preparation: corpus -> tokenizer -> token shards, the one contract with training being the shard format
that data.py reads.

    python prepare.py DATASET [--key=value ...]     # train.py's data settings; train.py also prepares

Preparation streams the corpus, so its memory does not grow with the corpus: documents are read file by
file (corpora.py), each is hashed (with data_seed), and the hash decides its split, its place in the
shuffled stream and whether it duplicates another. Encoding runs on every core, into temporary buckets
keyed by the hash; each bucket is then sorted and appended to numbered shards of at most `SHARD_TOKENS`.
The shards' folder, <data_dir>/<corpus>-<tokenizer>-<hash>, is named by a hash of the settings and of
the corpus's fingerprint: a changed corpus gets a new folder, the same corpus under any spelling of its
path finds its old one. It is written under a temporary name and renamed when complete, under a lock
that other processes preparing the same data wait for.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import json
import math
import os
import shlex
import shutil
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import BinaryIO

import numpy as np
import tiktoken

from cli import Progress, help_text, parse_config, run_main
from config import DATA_SETTINGS, Config, prepared_settings
from corpora import Source, describe_changes, file_kind, fingerprint, label, read_documents, resolve_dataset
from errors import ConfigError, DataError, interrupted_exit_code
from run.folder import check_writable_folder, exclusive_lock, lock_failure
from shards import (
    EOT_TEXT,
    SHARD_FORMAT_VERSION,
    TIMINGS_FILE,
    content_digests,
    digest_of,
    is_prepared_folder,
    load_shards,
    read_tiktoken,
    read_timings,
    tiktoken_encoding,
)

SHARD_TOKENS = 100_000_000  # tokens per shard file at most (200 MB of uint16)

# The GPT-4 style split pattern, as produced by rustbpe; also used for user-supplied .tiktoken files.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)


# ----------------------------------------------------------------------------------------------
# The tokenizer: trained with rustbpe, or a tiktoken encoding by name or file


def train_bpe(docs: list[str], vocab_size: int) -> tiktoken.Encoding:
    """A byte-level BPE trained with rustbpe; the last id of the vocabulary is EOT."""
    import rustbpe  # only needed here, so machines that get prepared data need not install it

    if not 257 <= vocab_size <= 65536:
        raise DataError(f"tokenizer_vocab_size must be in [257, 65536], got {vocab_size}")
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(docs), vocab_size - 1)  # one id left for EOT
    ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
    return tiktoken_encoding(ranks, trainer.get_pattern(), f"bpe{vocab_size}")


def write_tiktoken_file(enc: tiktoken.Encoding, path: Path) -> None:
    ranks = enc._mergeable_ranks  # tiktoken exposes no public accessor for the ranks
    path.write_bytes(
        b"".join(base64.b64encode(token) + b" " + str(rank).encode() + b"\n" for token, rank in ranks.items())
    )


def load_named_tokenizer(tokenizer: str) -> tiktoken.Encoding:
    """A .tiktoken path or a tiktoken encoding name."""
    if tokenizer.endswith(".tiktoken"):
        try:
            content = Path(tokenizer).read_bytes()
        except FileNotFoundError:
            raise DataError(f"tokenizer file {tokenizer} not found") from None
        except OSError as e:
            raise DataError(f"tokenizer file {tokenizer} cannot be read ({e.strerror})") from None
        return read_tiktoken(content, SPLIT_PATTERN, Path(tokenizer).stem, tokenizer)
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
    if sorted(enc._mergeable_ranks.values()) != list(range(len(enc._mergeable_ranks))):
        raise DataError(f"tiktoken encoding {tokenizer!r} has gaps in its ranks, which its .tiktoken file cannot hold")
    # Keep only EOT as a special token, so every encoding is saved and reloaded the same way.
    return tiktoken_encoding(enc._mergeable_ranks, enc._pat_str, tokenizer, enc.eot_token)


# ----------------------------------------------------------------------------------------------
# Preparation


def preparation_progress(phase: str, total_bytes: int, log: Callable, every: float = 30.0) -> Progress:
    """One status line of a long phase, by the bytes read: share done, GB, documents and tokens per second,
    ETA. Advance it with the bytes read (and documents=, tokens=)."""

    def show(p: Progress) -> str:
        tokens = f" | {p.rate('tokens') / 1e6:.2f}M tok/s" if p.counts["tokens"] else ""
        return (
            f"data: {phase} {min(1.0, p.done / p.total):6.1%} | {p.done / 1e9:.2f} of {p.total / 1e9:.2f} GB | "
            f"{p.rate('documents'):,.0f} docs/s{tokens} | ETA {p.eta()}"
        )

    return Progress(max(1, total_bytes), show, log, every)


def _document_key(text: str, seed: int) -> tuple[int, float]:
    """(order key, split draw). The key orders the shuffled stream and finds duplicates; the draw in [0, 1)
    puts the document in val when below val_fraction. Both depend only on the text and the seed, so
    appending documents never moves an existing one to the other split."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16, key=seed.to_bytes(8, "little")).digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little") / 2**64


def shard_dir_for(data_dir: str, source: Source, settings: Config, inputs: list[list]) -> Path:
    """Readable, and unique to the corpus content and the settings that decide the shards."""
    key = json.dumps([prepared_settings(settings), source.builtin, source.single_file, inputs, SHARD_FORMAT_VERSION])
    tok = f"bpe{settings.tokenizer_vocab_size}" if settings.tokenizer == "bpe" else label(Path(settings.tokenizer).stem)
    return Path(data_dir) / f"{source.label}-{tok}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def prepare(
    dataset: str,
    data_dir: str,
    settings: Config | None = None,
    exclude: tuple[Path, ...] = (),
    log: Callable = print,
) -> Path:
    """Prepare shards unless they exist for this corpus content and these settings; returns their folder.

    Safe to run from several processes at once (they share one preparation) and to interrupt (the
    shards are written to a temporary folder that is renamed when complete). `exclude`: folders not to
    read when the dataset is a folder holding them (the run's own outputs). `settings`: the data settings
    (Config's, DATA_SETTINGS)."""
    settings = settings or Config()
    if is_prepared_folder(dataset):
        return Path(dataset)
    source = resolve_dataset(dataset, exclude)
    inputs = fingerprint(source)
    out = shard_dir_for(data_dir, source, settings, inputs)
    if found := _prepared_already(out, settings):
        return found
    check_writable_folder(Path(data_dir), "data_dir")
    on_busy = lambda holder: log(f"data: waiting for {holder}, which is preparing {out}")  # noqa: E731
    lock = Path(data_dir) / f".{out.name}.lock"
    with ExitStack() as held:
        try:
            held.enter_context(exclusive_lock(lock, on_busy))
        except OSError as e:
            raise DataError(lock_failure(lock, "preparation", e)) from None
        if found := _prepared_already(out, settings):  # prepared by the process we waited for
            return found
        _report_stale(Path(data_dir), source, settings, inputs, log)
        for stale in Path(data_dir).glob(f".{out.name}.tmp-*"):  # left by an interrupted preparation
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(data_dir) / f".{out.name}.tmp-{os.getpid()}"
        try:
            tmp.mkdir()
            meta = _prepare_into(tmp, dataset, source, settings, inputs, log)
            out = _named_by_real_vocabulary(out, settings, meta, log)
            os.replace(tmp, out)  # atomic: the folder appears only when complete
        except OSError as e:  # a full disk, a file-size limit
            raise DataError(f"could not write the shards in {data_dir} ({e.strerror or e}); nothing was kept") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when complete (renamed)
    log(f"data: wrote {out}")
    return out


def _prepared_already(out: Path, settings: Config) -> Path | None:
    """These shards' folder if it is complete: named as `out`, or, for a trained tokenizer that came out
    smaller than asked, by its real size (the hash at the end is the same)."""
    candidates = [out]
    if settings.tokenizer == "bpe":
        label, digest = out.name.rsplit(f"-bpe{settings.tokenizer_vocab_size}-", 1)
        candidates += sorted(out.parent.glob(f"{label}-bpe*-{digest}"))
    return next((folder for folder in candidates if (folder / "meta.json").exists()), None)


def _named_by_real_vocabulary(out: Path, settings: Config, meta: dict, log) -> Path:
    """A trained tokenizer smaller than asked (a corpus too small for that many merges) says so, and its
    folder is named by its real size."""
    if settings.tokenizer != "bpe" or meta["vocab_size"] == settings.tokenizer_vocab_size:
        return out
    log(
        f"data: the corpus gave a tokenizer of only {meta['vocab_size']:,} tokens, not the "
        f"tokenizer_vocab_size={settings.tokenizer_vocab_size:,} asked (too little text for more merges)"
    )
    label, digest = out.name.rsplit(f"-bpe{settings.tokenizer_vocab_size}-", 1)
    return out.with_name(f"{label}-bpe{meta['vocab_size']}-{digest}")


def _report_stale(data_dir: Path, source: Source, settings: Config, inputs: list[list], log) -> None:
    """One line when this dataset was prepared before with other content: what changed."""
    earlier = []
    for meta_path in data_dir.glob("*/meta.json"):
        try:  # a damaged earlier folder only means there is nothing to compare with
            meta = json.loads(meta_path.read_text())
            if meta.get("source") == source.identity and meta.get("settings") == prepared_settings(settings):
                old_inputs = json.loads((meta_path.parent / "inputs.json").read_text())
                prepared_at = read_timings(meta_path.parent).get("prepared_at", 0)
                earlier.append((prepared_at, str(meta_path.parent), old_inputs))
        except (OSError, ValueError, AttributeError):
            continue
    if earlier:
        _, folder, old_inputs = max(earlier, key=lambda e: (e[0], e[1]))
        log(
            f"data: {source.identity} changed since {folder} was prepared ({describe_changes(old_inputs, inputs)}): "
            f"preparing again (the old shards stay there; delete them to free the space)"
        )


def _prepare_into(out: Path, dataset: str, source: Source, settings: Config, inputs: list[list], log) -> dict:
    seconds = {"start": time.time()}
    total_bytes = sum(p[1] for p in inputs)
    enc, trained_on = _tokenizer_for(dataset, source, settings, total_bytes, seconds["start"], log)
    write_tiktoken_file(enc, out / "tokenizer.tiktoken")
    dtype = np.dtype(np.uint16 if enc.n_vocab <= 2**16 else np.uint32)
    skipped: Counter = Counter()
    skipped_files: dict[str, list[str]] = {}  # by reason: the files skipped whole, by name
    repaired: Counter = Counter()  # by file: documents kept with U+FFFD in place of lone surrogates
    reported = (skipped, skipped_files, repaired)
    seconds["tokenizer"] = time.time() - seconds["start"]
    n_buckets = _encode_into_buckets(out / "buckets", source, settings, enc, dtype, total_bytes, reported, log)
    seconds["encoding"] = time.time() - seconds["start"] - seconds["tokenizer"]
    splits = _write_shards(out, n_buckets, dtype, skipped, log)
    shutil.rmtree(out / "buckets")
    seconds["total"] = time.time() - seconds.pop("start")
    seconds["shards"] = seconds["total"] - seconds["tokenizer"] - seconds["encoding"]
    _check_splits(dataset, settings, splits)
    meta = _meta(out, dataset, source, settings, enc, trained_on, dtype, reported, splits, total_bytes)
    # timings vary from run to run: kept apart, so that the folder's content digest is the same on every machine
    timings = {"seconds": {phase: round(s, 2) for phase, s in seconds.items()}, "prepared_at": time.time()}
    (out / "inputs.json").write_text(json.dumps(inputs))
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    (out / TIMINGS_FILE).write_text(json.dumps(timings, indent=1))
    for line in describe(meta, timings):
        log(line)
    return meta


def _tokenizer_for(
    dataset: str, source: Source, settings: Config, total_bytes: int, started: float, log
) -> tuple[tiktoken.Encoding, dict | None]:
    """(the tokenizer, what it was trained on): a BPE trained on a sample of the training documents, or a
    named tokenizer (trained on nothing here: None). `started`: when preparation began, for the log line."""
    if settings.tokenizer != "bpe":
        return load_named_tokenizer(settings.tokenizer), None
    sample = _tokenizer_sample(source, settings, total_bytes, log)
    if not sample:
        raise DataError(
            f"dataset {dataset!r} holds no non-empty documents"
            if not any(True for _ in read_documents(source, settings.text_field))
            else f"val_fraction={settings.val_fraction} leaves no training documents to train the tokenizer on"
        )
    enc = train_bpe(sample, settings.tokenizer_vocab_size)
    trained_on = {"documents": len(sample), "characters": sum(map(len, sample))}
    log(
        f"data: trained tokenizer {enc.name} on {trained_on['documents']:,} documents "
        f"({trained_on['characters'] / 1e6:.1f}M characters) in {time.time() - started:.1f}s"
    )
    return enc, trained_on


def _check_splits(dataset: str, settings: Config, splits: dict) -> None:
    """A DataError unless the shards hold at least 2 distinct documents and both splits some of them."""
    n_docs = sum(s["documents"] for s in splits.values())
    if n_docs == 0:
        raise DataError(f"dataset {dataset!r} holds no non-empty documents")
    if n_docs < 2:
        raise DataError(f"only {n_docs} distinct non-empty documents: need at least 2 (train and val)")
    for split, other in (("train", "val"), ("val", "train")):
        if splits[split]["documents"] == 0:
            raise DataError(
                f"val_fraction={settings.val_fraction} puts all {n_docs} distinct documents in {other} and none in "
                f"{split}; {'lower' if split == 'train' else 'raise'} it (or use more documents)"
            )


def _meta(
    out: Path,
    dataset: str,
    source: Source,
    settings: Config,
    enc: tiktoken.Encoding,
    trained_on: dict | None,
    dtype: np.dtype,
    reported: tuple[Counter, dict[str, list[str]], Counter],
    splits: dict,
    total_bytes: int,
) -> dict:
    """meta.json: what the shards hold and how they were made. `reported`: what was left out, counted by
    reason, the files skipped whole, by name, and the documents repaired, counted by file."""
    skipped, skipped_files, repaired = reported
    return {
        "format_version": SHARD_FORMAT_VERSION,
        "dataset": dataset,
        "source": source.identity,
        "settings": prepared_settings(settings),
        "tokenizer": settings.tokenizer,
        "tokenizer_name": enc.name,
        "tokenizer_trained_on": trained_on,
        "pattern": enc._pat_str,
        "tokenizer_sha256": hashlib.sha256((out / "tokenizer.tiktoken").read_bytes()).hexdigest(),
        "vocab_size": enc.n_vocab,
        "eot_id": enc.eot_token,
        "val_fraction": settings.val_fraction,
        "seed": settings.data_seed,
        "dtype": dtype.name,
        "skipped": {why: n for why, n in sorted(skipped.items()) if n},
        "skipped_files": skipped_files,
        "lone_surrogates_replaced": sum(repaired.values()),  # documents kept with U+FFFD in their place
        **({"lone_surrogate_files": dict(sorted(repaired.items()))} if repaired else {}),
        "splits": splits,
        "bytes_read": total_bytes,
    }


def _tokenizer_sample(source: Source, settings: Config, total_bytes: int, log) -> list[str]:
    """A deterministic sample of the training documents for the BPE: those with the smallest order keys
    (a uniform draw over the whole corpus) up to tokenizer_train_mb million characters, in key order."""
    budget = settings.tokenizer_train_mb * 1_000_000
    heap: list[tuple[int, str]] = []  # (-key, text): the largest key sits on top, ready to be dropped
    in_sample: set[int] = set()
    chars = 0
    progress = preparation_progress("tokenizer sample", total_bytes, log)
    for text in read_documents(source, settings.text_field, Counter(), lambda n: progress.advance(n)):
        progress.advance(documents=1)
        key, draw = _document_key(text, settings.data_seed)
        if draw < settings.val_fraction or key in in_sample or (chars >= budget and key > -heap[0][0]):
            continue
        heapq.heappush(heap, (-key, text))
        in_sample.add(key)
        chars += len(text)
        while chars > budget and len(heap) > 1:
            dropped_key, dropped = heapq.heappop(heap)
            in_sample.discard(-dropped_key)
            chars -= len(dropped)
    progress.close()
    return [text for _, text in sorted(heap, reverse=True)]


def _encode_batch(enc: tiktoken.Encoding, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(tokens of every text, each followed by EOT; their lengths). Runs in worker threads: tiktoken
    releases the GIL while it encodes, so these run in parallel on every core."""
    encoded = [enc.encode_to_numpy(t, disallowed_special=()) for t in texts]  # = encode_ordinary
    lengths = np.fromiter((len(e) + 1 for e in encoded), dtype=np.int64, count=len(encoded))
    tokens = np.full(int(lengths.sum()), enc.eot_token, dtype=dtype)
    ends = np.cumsum(lengths)
    for end, ids in zip(ends, encoded):
        tokens[end - 1 - len(ids) : end - 1] = ids
    return tokens, lengths


BUCKET_TEXT_BYTES = 256 << 20  # corpus text per bucket (its tokens are sorted in memory)

FLUSH_BYTES = 64 << 20  # encoded tokens held before they are appended to the bucket files

INDEX_DTYPE = np.dtype([("key", "<u8"), ("length", "<u8")])


def _encode_into_buckets(
    folder: Path,
    source: Source,
    settings: Config,
    enc,
    dtype,
    total_bytes: int,
    reported: tuple[Counter, dict[str, list[str]], Counter],
    log,
) -> int:
    """Encode every document on all cores into buckets chosen by its order key: files
    <split>_<bucket>.tokens and .index (key, length per document). `reported`: what was left out, counted
    by reason, the files skipped whole, by name, and the documents whose lone surrogates were replaced,
    counted by file (read_documents fills them). Returns the number of buckets."""
    n_buckets = _bucket_count(source, total_bytes)
    folder.mkdir()
    progress = preparation_progress("encoding", total_bytes, log)
    buckets = _BucketFiles(folder, n_buckets, progress)
    _encode_on_all_cores(source, settings, enc, dtype, reported, progress, buckets.store)
    buckets.flush()
    progress.close()
    return n_buckets


def _bucket_count(source: Source, total_bytes: int) -> int:
    """Enough buckets for about BUCKET_TEXT_BYTES of text each, from an estimate of the corpus's text."""
    compressed = sum(1 for p in source.files if file_kind(p) == "parquet" or p.name.endswith((".gz", ".zst")))
    estimate = total_bytes * (4 if compressed else 1)  # compressed corpora hold more text than their size
    return min(4096, max(1, math.ceil(estimate / BUCKET_TEXT_BYTES)))


def append_array(file: BinaryIO, array: np.ndarray) -> None:
    """The array's bytes written through Python's file, which raises on a full disk: numpy's tofile loses that
    error in a buffer of its own and leaves a short file behind."""
    file.write(np.ascontiguousarray(array).data)


class _BucketFiles:
    """The encoded documents of each (split, bucket), held in memory and appended to the bucket files
    once FLUSH_BYTES of tokens are held."""

    def __init__(self, folder: Path, n_buckets: int, progress: Progress) -> None:
        self.folder, self.n_buckets, self.progress = folder, n_buckets, progress
        self.buffers: dict[tuple[str, int], tuple[list, list, list]] = {}  # (split, bucket): tokens, keys, lengths
        self.buffered = 0

    def store(self, batch_keys: list[tuple[int, bool]], encoded: tuple[np.ndarray, np.ndarray]) -> None:
        """One encoded batch: (order key, in val) of each document, and _encode_batch's tokens and lengths."""
        tokens, lengths = encoded
        for (key, is_val), end, length in zip(batch_keys, np.cumsum(lengths).tolist(), lengths.tolist()):
            bucket = self.buffers.setdefault(("val" if is_val else "train", key * self.n_buckets >> 64), ([], [], []))
            bucket[0].append(tokens[end - length : end])
            bucket[1].append(key)
            bucket[2].append(length)
        self.buffered += tokens.nbytes
        self.progress.advance(tokens=int(lengths.sum()))
        if self.buffered >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        for (split, bucket), (tokens, keys, lengths) in self.buffers.items():
            with open(self.folder / f"{split}_{bucket:05d}.tokens", "ab") as f:
                append_array(f, np.concatenate(tokens))
            index = np.empty(len(keys), dtype=INDEX_DTYPE)
            index["key"], index["length"] = keys, lengths
            with open(self.folder / f"{split}_{bucket:05d}.index", "ab") as f:
                append_array(f, index)
        self.buffers.clear()
        self.buffered = 0


def _encode_on_all_cores(
    source: Source,
    settings: Config,
    enc,
    dtype,
    reported: tuple[Counter, dict[str, list[str]], Counter],
    progress: Progress,
    store: Callable[[list[tuple[int, bool]], tuple[np.ndarray, np.ndarray]], None],
) -> None:
    """Read the documents and encode them in batches on a thread per core, handing each batch to `store`
    in reading order. At most two batches a thread are in flight, so memory does not grow with the corpus."""
    threads = os.cpu_count() or 1
    in_flight: deque = deque()
    batch: list[str] = []
    batch_keys: list[tuple[int, bool]] = []
    batch_chars = 0
    with ThreadPoolExecutor(threads) as pool:
        try:
            on_bytes = lambda n: progress.advance(n)  # noqa: E731
            for text in read_documents(source, settings.text_field, reported[0], on_bytes, *reported[1:]):
                key, draw = _document_key(text, settings.data_seed)
                batch.append(text)
                batch_keys.append((key, draw < settings.val_fraction))
                batch_chars += len(text)
                progress.advance(documents=1)
                if batch_chars >= 1 << 20 or len(batch) >= 4096:
                    in_flight.append((batch_keys, pool.submit(_encode_batch, enc, batch, dtype)))
                    batch, batch_keys, batch_chars = [], [], 0
                    while len(in_flight) > 2 * threads:  # bounded memory: wait for the oldest batch
                        keys, future = in_flight.popleft()
                        store(keys, future.result())
            if batch:
                in_flight.append((batch_keys, pool.submit(_encode_batch, enc, batch, dtype)))
            while in_flight:
                keys, future = in_flight.popleft()
                store(keys, future.result())
        finally:
            for _, future in in_flight:
                future.cancel()


def _write_shards(out: Path, n_buckets: int, dtype, skipped: Counter, log) -> dict:
    """Sort each bucket by order key, drop repeated keys (exact duplicates) and append the documents to
    numbered shards. Keys were drawn uniformly, so the stream is a seeded shuffle of the documents."""
    splits = {}
    folder = out / "buckets"
    progress = preparation_progress("shuffling into shards", sum(p.stat().st_size for p in folder.iterdir()), log)
    for split in ("train", "val"):
        shards: list[dict] = []
        current, current_tokens, documents = None, 0, 0
        try:
            for bucket in range(n_buckets):
                index_path = folder / f"{split}_{bucket:05d}.index"
                if not index_path.exists():
                    continue
                index = np.fromfile(index_path, dtype=INDEX_DTYPE)
                tokens = np.fromfile(folder / f"{split}_{bucket:05d}.tokens", dtype=dtype)
                progress.advance(index.nbytes + tokens.nbytes, documents=len(index))
                order = np.argsort(index["key"], kind="stable")
                keys = index["key"][order]
                keep = order[np.r_[True, keys[1:] != keys[:-1]]]
                skipped["duplicate"] += len(index) - len(keep)
                documents += len(keep)
                starts = (np.cumsum(index["length"]) - index["length"])[keep].tolist()
                lengths = index["length"][keep].tolist()
                stream = np.empty(sum(lengths), dtype=dtype)
                at = 0
                for start, length in zip(starts, lengths):
                    stream[at : at + length] = tokens[start : start + length]
                    at += length
                del tokens
                (folder / f"{split}_{bucket:05d}.tokens").unlink()
                index_path.unlink()
                while len(stream):
                    if current is None or current_tokens == SHARD_TOKENS:
                        name = f"{split}_{len(shards):06d}.bin"
                        shards.append({"file": name, "tokens": 0})
                        if current is not None:
                            current.close()
                        current, current_tokens = open(out / name, "wb"), 0
                    take = min(len(stream), SHARD_TOKENS - current_tokens)
                    append_array(current, stream[:take])
                    shards[-1]["tokens"] += take
                    current_tokens += take
                    stream = stream[take:]
        finally:
            if current is not None:
                current.close()
        splits[split] = {"documents": documents, "tokens": sum(s["tokens"] for s in shards), "shards": shards}
    progress.close()
    return splits


def describe(meta: dict, timings: dict) -> list[str]:
    """What a preparation made, for the log and `python prepare.py`; `timings` may be empty (not kept)."""
    skipped = ", ".join(f"{n:,} {why}" for why, n in meta["skipped"].items() if n) or "none"
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    lines = [
        f"data: {train['documents']:,} train and {val['documents']:,} val documents from {meta['dataset']} "
        f"(skipped: {skipped})",
        f"data: {train['tokens']:,} train tokens in {len(train['shards'])} shard(s), {val['tokens']:,} val tokens in "
        f"{len(val['shards'])}",
    ]
    tok = f"data: tokenizer {meta['tokenizer_name']}, vocabulary {meta['vocab_size']:,} with EOT = {meta['eot_id']}"
    if meta.get("tokenizer_trained_on"):
        t = meta["tokenizer_trained_on"]
        tok += f", trained on {t['documents']:,} documents ({t['characters'] / 1e6:.1f}M characters)"
    lines.append(tok)
    if meta.get("lone_surrogates_replaced"):
        names = list(meta.get("lone_surrogate_files", {}))
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5:,} more" if len(names) > 5 else "")
        lines.append(
            f"data: {meta['lone_surrogates_replaced']:,} document(s) held lone surrogates (invalid UTF-16 in JSON): "
            f"kept, with U+FFFD in their place; in {len(names):,} file(s): {shown}"
        )
    for why, names in meta.get("skipped_files", {}).items():
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5:,} more" if len(names) > 5 else "")
        lines.append(f"data: skipped {len(names):,} file(s) whole ({why.replace('_', ' ')}): {shown}")
    tokens, seconds = train["tokens"] + val["tokens"], timings.get("seconds")
    read = f"data: {meta['bytes_read'] / 1e6:,.1f} MB read, {tokens:,} tokens"
    if seconds:
        read += (
            f" in {seconds['total']:.1f}s ({tokens / max(seconds['total'], 1e-9):,.0f} tokens/s; tokenizer "
            f"{seconds['tokenizer']:.1f}s, encoding {seconds['encoding']:.1f}s, shuffling into shards "
            f"{seconds['shards']:.1f}s)"
        )
    lines.append(read)
    return lines


# ----------------------------------------------------------------------------------------------
# python prepare.py DATASET [--key=value ...]: prepare without training


DATA_KEYS = ("dataset", "data_dir", *(key for key in DATA_SETTINGS if key != "dataset"))  # what prepare.py takes


def prepare_for(cfg: Config, log=print) -> Path:
    """A run's shards, prepared first if needed (the run's own folders are never read as corpus)."""
    return prepare(cfg.dataset, cfg.data_dir, cfg, exclude=(Path(cfg.data_dir), Path(cfg.out_dir)), log=log)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(help_text("\n\n".join(__doc__.split("\n\n")[:2]), keys=DATA_KEYS))
        return 0
    args = list(argv)
    config_file = [args.pop(0)] if args and args[0].endswith(".toml") else []
    if args and not args[0].startswith("--"):
        args[0] = f"--dataset={args[0]}"
    try:
        for arg in args:
            key = arg[2:].split("=", 1)[0]
            if arg.startswith("--") and key in Config.__dataclass_fields__ and key not in DATA_KEYS:
                raise ConfigError(f"{key} is not a data setting; prepare.py takes {', '.join(DATA_KEYS)}")
        cfg = parse_config(config_file + args)
        path = prepare_for(cfg)
        meta = load_shards(path).meta
        digests = content_digests(path)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(
            "\ninterrupted: the unfinished preparation was removed; run the same command to start again",
            file=sys.stderr,
        )
        return interrupted_exit_code(e)
    print(f"ready: {path}")
    for line in describe(meta, read_timings(path)):
        print("  " + line.removeprefix("data: "))
    print(f"  content digest {digest_of(digests)} (sha256 of its {len(digests)} files, timings.json aside)")
    defaults = Config()
    # quoted to paste: a dataset given as a glob ('fineweb/*.parquet') would otherwise be expanded by the shell
    deciding = [f"--{key}={getattr(cfg, key)}" for key in DATA_KEYS[1:] if getattr(cfg, key) != getattr(defaults, key)]
    print(
        f"train on it with {shlex.join([f'--dataset={cfg.dataset}', *deciding])} "
        f"(or {shlex.join([f'--dataset={path}'])}, e.g. after copying {cfg.data_dir}/ elsewhere)"
    )
    return 0


if __name__ == "__main__":
    run_main(main)
