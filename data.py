"""Corpora -> tokenizer -> token shards -> packed training batches.

    python data.py corpus/ [--tokenizer=gpt2] [--key=value ...]   # prepare only (train.py's data keys)

All packing semantics live in this file, in `make_batch` and the three small functions it calls.
They follow Megatron-LM's flags (see README, "The three flags"):

    stream   every document is encoded with `encode_ordinary` and followed by one EOT token;
             the EOT belongs to the document it ends
    rows     inputs x = s[t:t+T], targets y = s[t+1:t+T+1]
    doc id   exclusive cumulative sum of (x == EOT): the EOT keeps the id of its document
    position restarts at 0 on the token after each EOT and at the start of the row
    loss     the target predicted *from* an EOT input is ignored (it is the next document's first token)

The document mask itself is applied in model.py; this file only produces the document ids it needs.

Preparation streams the corpus, so its memory does not grow with the corpus: documents are read file by
file, each is hashed (with data_seed), and the hash decides its split, its place in the shuffled
stream and whether it duplicates another. Encoding runs on every core, into temporary buckets keyed
by the hash; each bucket is then sorted and appended to numbered shards of at most `SHARD_TOKENS`.
"""

from __future__ import annotations

import ast
import base64
import codecs
import fcntl
import glob
import gzip
import hashlib
import heapq
import json
import math
import os
import shutil
import sys
import sysconfig
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import lru_cache
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
BUILTIN_DATASETS = ("stdlib", "stdlib-files", "packages")
SHARD_FORMAT_VERSION = 2
SHARD_TOKENS = 100_000_000  # tokens per shard file at most (200 MB of uint16)
DATASET_HELP = (
    f"give one of {', '.join(BUILTIN_DATASETS)}, a directory of text files, a .jsonl file with a 'text' field, "
    "a text file separated by <|endoftext|>, a .parquet, .jsonl.gz or .jsonl.zst file, or a glob of such files"
)


class DataError(Exception):
    """A problem with the user's data or prepared shards; train.py prints it as one line."""


# ----------------------------------------------------------------------------------------------
# Corpora. A dataset setting names a Source: its files and how each is read. Documents are then
# streamed from it, with counts of what was skipped and why.


@dataclass(frozen=True)
class Source:
    label: str  # a readable name for the shard folder
    identity: str  # the dataset, however its path was spelled: staleness reports compare it
    root: Path  # file paths in the fingerprint are relative to it
    files: tuple[Path, ...]
    builtin: str | None = None  # "stdlib" or "packages" (top-level definitions), "stdlib-files" (whole modules)
    single_file: bool = False  # a lone text file is split on <|endoftext|>; in a folder it is one document


def file_kind(path: Path) -> str:
    """'parquet' and 'jsonl' files hold many documents; any other file is text."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
        return "jsonl"
    return "text"


def _stdlib_modules() -> list[Path]:
    """Non-test modules of the running interpreter's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip_dirs = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    modules = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip_dirs]
        modules += [Path(folder, n) for n in names if n.endswith(".py") and not n.startswith("test_")]
    return sorted(modules)


def _package_modules() -> list[Path]:
    """Python sources of the distributions that requirements.txt pins and of everything they require,
    as installed, in a fixed order: a larger built-in corpus, the same wherever the pins are installed."""
    import importlib.metadata as metadata  # only needed here

    from packaging.requirements import Requirement

    requirements = Path(__file__).with_name("requirements.txt")
    if not requirements.is_file():
        raise DataError(f"dataset 'packages' reads the distributions that {requirements} pins; it is missing")
    pending = [Requirement(line).name for line in requirements.read_text().splitlines() if line.split("#")[0].strip()]
    seen, modules = set(), set()
    while pending:
        name = pending.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise DataError(f"dataset 'packages': {name} is not installed; pip install -r {requirements}") from None
        for requirement in map(Requirement, distribution.requires or []):
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
        modules |= {
            Path(distribution.locate_file(f)).resolve()
            for f in distribution.files or []
            if f.suffix == ".py" and "__pycache__" not in f.parts
        }
    return sorted(p for p in modules if p.is_file())


def _files_below(root: Path, exclude: tuple[Path, ...]) -> list[Path]:
    """Regular files below root in a fixed order, skipping hidden files and folders and `exclude`
    (the run's own data_dir and out_dir, when the corpus folder holds them)."""
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and Path(folder, d).resolve() not in exclude)
        files += [Path(folder, n) for n in sorted(names) if not n.startswith(".") and Path(folder, n).is_file()]
    return files


def _glob_root(pattern: str) -> Path:
    """The folder above a glob's first wildcard: paths of its matches are relative to it."""
    parts = Path(pattern).parts
    fixed = [p for p in parts[: next(i for i, p in enumerate(parts) if glob.has_magic(p))]]
    return Path(*fixed) if fixed else Path(".")


def _glob_files(pattern: str) -> list[Path]:
    """The files a glob matches, hidden ones left out as glob.glob does. pathlib's ** does not follow
    symbolic links to folders, so a link that loops back cannot make it walk for ever (glob.glob's does)."""
    root = _glob_root(pattern)
    rest = Path(pattern).relative_to(root) if Path(pattern).is_relative_to(root) else Path(pattern)
    if rest.name == "**":  # "every file below", as glob.glob reads it
        rest = rest / "*"
    found = []
    for path in root.glob(str(rest)):
        hidden = any(part.startswith(".") for part in path.relative_to(root).parts)
        if not hidden and path.is_file():
            found.append(path)
    return found


PREPARED_FILES = ("meta.json", "inputs.json", "tokenizer.tiktoken")


def _refuse_incomplete_preparation(folder: Path) -> None:
    """A folder with some of the files that `prepare` writes is a damaged preparation, not a corpus."""
    present = [name for name in PREPARED_FILES if (folder / name).is_file()]
    if present or any(folder.glob("train_*.bin")):
        missing = [name for name in PREPARED_FILES if name not in present]
        raise DataError(
            f"{folder} looks like a folder prepared by data.py but lacks {', '.join(missing)}: it is an incomplete "
            "preparation; delete it and give the corpus to prepare again"
        )


def _label(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text).strip("._") or "corpus"


def resolve_dataset(dataset: str, exclude: tuple[Path, ...] = ()) -> Source:
    """The files a dataset setting names. Raises DataError for a dataset that is empty, missing, or of a
    kind that cannot be read."""
    if not dataset.strip():
        raise DataError(f"dataset is empty: {DATASET_HELP}")
    if dataset == "packages":
        root = Path(sysconfig.get_paths()["purelib"]).resolve()
        return Source(dataset, dataset, root, tuple(_package_modules()), builtin=dataset)
    if dataset in BUILTIN_DATASETS:
        root = Path(sysconfig.get_paths()["stdlib"])
        return Source(dataset, dataset, root, tuple(_stdlib_modules()), builtin=dataset)
    exclude = tuple(Path(p).resolve() for p in exclude)
    path = Path(dataset).expanduser()
    if path.is_dir():
        root = path.resolve()
        if any(root == e or root.is_relative_to(e) for e in exclude):
            raise DataError(
                f"dataset {dataset} is the data_dir or out_dir of this run (or inside it), which holds prepared "
                "shards and checkpoints, not a corpus: give the corpus's own folder"
            )
        _refuse_incomplete_preparation(root)
        return Source(_label(root.name), str(root), root, tuple(_files_below(root, exclude)))
    if path.is_file():
        name = path.name.lower()
        if name.endswith(".json"):
            raise DataError(f"{path}: a .json file is not a corpus; give JSON Lines (.jsonl), one document per line")
        if file_kind(path) == "text" and name.endswith((".gz", ".zst", ".bz2", ".xz", ".zip")):
            raise DataError(f"{path}: of compressed files only .jsonl.gz and .jsonl.zst are read")
        resolved = path.resolve()
        return Source(_label(resolved.name), str(resolved), resolved.parent, (resolved,), single_file=True)
    if glob.has_magic(dataset):
        matches = sorted(p.resolve() for p in _glob_files(os.path.expanduser(dataset)))
        files = tuple(p for p in matches if not any(p.is_relative_to(e) for e in exclude))
        if not files:
            raise DataError(f"dataset {dataset!r} matches no files")
        root = _glob_root(os.path.expanduser(dataset)).resolve()
        identity = str(root / Path(dataset).relative_to(_glob_root(dataset)))
        return Source(_label(root.name), identity, root, files)
    raise DataError(f"dataset {dataset!r} not found: {DATASET_HELP}")


def _top_level_definitions(source: str) -> list[str]:
    """Top-level functions and classes of a module, decorators included (CodeSearchNet-style)."""
    lines = source.splitlines(keepends=True)
    pieces = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            pieces.append("".join(lines[first - 1 : node.end_lineno]))
    return pieces


def stdlib_documents(split_definitions: bool, skipped: Counter | None = None) -> Iterator[str]:
    """The built-in corpus: modules of the standard library, whole or as their top-level definitions."""
    documents, skips = _stdlib_documents(split_definitions)
    if skipped is not None:
        skipped.update(skips)
    return iter(documents)


@lru_cache(maxsize=2)
def _stdlib_documents(split_definitions: bool) -> tuple[tuple[str, ...], Counter]:
    """Cached: parsing the modules takes seconds and preparation reads the corpus twice."""
    documents, skipped = [], Counter()
    for path in _stdlib_modules():
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        if not split_definitions:
            documents.append(source)
            continue
        try:
            documents += _top_level_definitions(source)
        except SyntaxError:
            skipped["syntax_error"] += 1
    return tuple(documents), skipped


def _module_definitions(path: Path, skipped: Counter, on_bytes: Callable[[int], None]) -> Iterator[str]:
    content = path.read_bytes()
    on_bytes(len(content))
    try:
        yield from _top_level_definitions(content.decode("utf-8"))
    except UnicodeDecodeError:
        skipped["not_utf8"] += 1
    except (SyntaxError, ValueError):  # ValueError: source with null bytes
        skipped["syntax_error"] += 1


def _jsonl_documents(path: Path, text_field: str, on_bytes: Callable[[int], None]) -> Iterator[str]:
    """One document per line, from the line's text field; .gz and .zst are decompressed as they stream."""
    name = path.name.lower()
    damaged: tuple[type[Exception], ...] = (OSError, EOFError, zlib.error)  # how gzip reports a bad file
    with open(path, "rb") as raw:
        if name.endswith(".gz"):
            lines = gzip.GzipFile(fileobj=raw)
        elif name.endswith(".zst"):
            import zstandard  # only needed here

            lines = _lines(_zstd_chunks(raw, path))
            damaged += (zstandard.ZstdError,)
        else:
            lines = raw
        position = 0
        try:
            for line_no, line in enumerate(lines, 1):
                if raw.tell() != position:
                    on_bytes(raw.tell() - position)
                    position = raw.tell()
                if line_no == 1 and line.startswith(codecs.BOM_UTF8):
                    line = line[len(codecs.BOM_UTF8) :]
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.decode("utf-8"))
                    text = record[text_field]
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{line_no}: not UTF-8 text ({e.reason} at byte {e.start})") from None
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise DataError(f'{path}:{line_no}: expected a JSON object with a "{text_field}" field') from None
                if not isinstance(text, str):
                    raise DataError(f'{path}:{line_no}: "{text_field}" must be a string, got {type(text).__name__}')
                yield text
        except damaged as e:
            raise DataError(f"{path} cannot be read to the end ({type(e).__name__}: {e})") from None


def _zstd_chunks(raw, path: Path) -> Iterator[bytes]:
    """The decompressed bytes of every frame of a .zst file. zstandard's stream_reader ends quietly where a
    cut file ends, so part of a corpus would be dropped unseen: here a file that ends inside a frame is an
    error. (A file cut exactly between two frames is a valid, shorter file: no format can tell.)"""
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    frame, frame_started = decompressor.decompressobj(), False
    while chunk := raw.read(1 << 20):
        while chunk:
            frame_started = True
            out = frame.decompress(chunk)
            if out:
                yield out
            chunk = b""
            if frame.eof:  # the frame ended; what follows starts the next one
                chunk, frame, frame_started = frame.unused_data, decompressor.decompressobj(), False
    if frame_started:
        raise DataError(f"{path} ends inside a zstd frame: the file is truncated")


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    pending = b""
    for chunk in chunks:
        *complete, pending = (pending + chunk).split(b"\n")
        yield from (line + b"\n" for line in complete)
    if pending:
        yield pending


def _parquet_documents(path: Path, text_field: str, skipped: Counter, on_bytes: Callable[[int], None]) -> Iterator[str]:
    """One document per row of the text column, read in batches so a row group is never held as
    Python strings all at once."""
    import pyarrow as pa  # only needed here
    import pyarrow.parquet as pq

    try:
        # pre-buffering (pyarrow's default) keeps what it read: memory grew with the file (measured)
        parquet = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable parquet file ({e})") from None
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise DataError(f"{path} has no column {text_field!r} (columns: {', '.join(schema.names)}); set --text_field=")
    column_type = schema.field(text_field).type
    values_type = column_type.value_type if pa.types.is_dictionary(column_type) else column_type
    string_kinds = (pa.types.is_string, pa.types.is_large_string, getattr(pa.types, "is_string_view", None))
    if not any(kind is not None and kind(values_type) for kind in string_kinds):  # plain, large, view, dictionary
        raise DataError(f"{path}: column {text_field!r} must hold strings, not {column_type}")
    total_rows, rows, reported = max(1, parquet.metadata.num_rows), 0, 0
    size = path.stat().st_size
    try:
        for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text is None:
                    skipped["null"] += 1
                else:
                    yield text
            rows += batch.num_rows
            now = size * rows // total_rows
            on_bytes(now - reported)
            reported = now
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} cannot be read to the end ({e})") from None


def _separated_documents(path: Path, on_bytes: Callable[[int], None]) -> Iterator[str]:
    """A text file whose documents are separated by the literal text <|endoftext|>, read in chunks."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending, offset = "", 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 23)
            try:
                pending += decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {offset + e.start})") from None
            offset += len(chunk)
            on_bytes(len(chunk))
            *documents, pending = pending.split(EOT_TEXT)
            yield from documents
            if not chunk:
                break
    yield pending


def _file_document(path: Path, skipped: Counter, on_bytes: Callable[[int], None]) -> Iterator[str]:
    """A file in a corpus folder: one document, or nothing (counted) if it is not readable UTF-8 text."""
    try:
        content = path.read_bytes()
    except OSError:
        skipped["unreadable"] += 1
        return
    on_bytes(len(content))
    try:
        yield content.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        skipped["not_utf8"] += 1


def read_documents(
    source: Source,
    text_field: str = "text",
    skipped: Counter | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[str]:
    """Every non-empty document of a source, in file order. `skipped` counts what was left out and why;
    `on_bytes(n)` is told of the bytes read, for progress."""
    skipped = Counter() if skipped is None else skipped
    on_bytes = on_bytes or (lambda n: None)

    def documents() -> Iterator[str]:
        if source.builtin == "packages":  # too large to cache like the standard library: read file by file
            for path in source.files:
                yield from _module_definitions(path, skipped, on_bytes)
            return
        if source.builtin:
            yield from stdlib_documents(source.builtin == "stdlib", skipped)
            on_bytes(sum(p.stat().st_size for p in source.files))
            return
        for path in source.files:
            kind = file_kind(path)
            if kind == "text" and not source.single_file:
                yield from _file_document(path, skipped, on_bytes)  # skipped and counted if unreadable
                continue
            try:
                if kind == "parquet":
                    yield from _parquet_documents(path, text_field, skipped, on_bytes)
                elif kind == "jsonl":
                    yield from _jsonl_documents(path, text_field, on_bytes)
                else:
                    yield from _separated_documents(path, on_bytes)
            except OSError as e:
                raise DataError(f"{path} cannot be read ({e.strerror or e})") from None

    for doc in documents():
        if doc.strip():
            yield doc
        else:
            skipped["empty"] += 1


def fingerprint(source: Source) -> list[list]:
    """Per input file: path (relative to the source root), size, modification time and a hash of its
    first and last MiB (the whole file when smaller). A changed file changes the fingerprint."""
    block = 1 << 20
    prints = []
    for path in source.files:
        relative = path.relative_to(source.root) if path.is_relative_to(source.root) else path
        try:
            stat = path.stat()
            digest = hashlib.blake2b(digest_size=16)
            with open(path, "rb") as f:
                digest.update(f.read(block))
                if stat.st_size > 2 * block:
                    f.seek(-block, os.SEEK_END)
                digest.update(f.read(block))
            prints.append([str(relative), stat.st_size, stat.st_mtime_ns, digest.hexdigest()])
        except OSError as e:  # reading it will skip it (in a folder) or say why (alone)
            prints.append([str(relative), -1, 0, f"unreadable: {e.strerror}"])
    return prints


def _describe_changes(old: list[list], new: list[list]) -> str:
    old_by_path, new_by_path = {p[0]: p for p in old}, {p[0]: p for p in new}
    added = sorted(new_by_path.keys() - old_by_path.keys())
    removed = sorted(old_by_path.keys() - new_by_path.keys())
    changed = sorted(p for p in new_by_path.keys() & old_by_path.keys() if new_by_path[p] != old_by_path[p])
    if not added and not removed and len(changed) == 1:
        (path,) = changed
        before, after = old_by_path[path], new_by_path[path]
        what = f"{before[1]:,} -> {after[1]:,} bytes" if before[1] != after[1] else "modified"
        return f"{path}: {what}"
    counts = [(len(added), "added"), (len(removed), "removed"), (len(changed), "changed")]
    return ", ".join(f"{n} file{'s' * (n != 1)} {what}" for n, what in counts if n)


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
    """A .tiktoken file: one 'base64-token rank' per line, ranks 0..n-1 once each, every byte a token."""
    ranks: dict[bytes, int] = {}
    try:
        content = path.read_bytes()
    except OSError as e:
        raise DataError(f"tokenizer file {path} cannot be read ({e.strerror})") from None
    for line_no, line in enumerate(content.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            token, rank = base64.b64decode(token, validate=True), int(rank)
        except ValueError:
            raise DataError(f"{path}:{line_no}: not a .tiktoken file (expected 'base64-token rank')") from None
        if token in ranks:
            raise DataError(f"{path}:{line_no}: token {token!r} appears twice")
        ranks[token] = rank
    if not ranks:
        raise DataError(f"{path} holds no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once (found duplicates, gaps or negatives)")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise DataError(
            f"{path}: {len(missing)} single bytes are not tokens (e.g. {bytes(missing[:1])!r}); "
            "a byte-level BPE needs all 256"
        )
    return _encoding_from_ranks(ranks, pattern, path.stem)


def write_tiktoken_file(enc: tiktoken.Encoding, path: Path) -> None:
    ranks = enc._mergeable_ranks  # tiktoken exposes no public accessor for the ranks
    path.write_bytes(
        b"".join(base64.b64encode(token) + b" " + str(rank).encode() + b"\n" for token, rank in ranks.items())
    )


def load_named_tokenizer(tokenizer: str) -> tiktoken.Encoding:
    """A .tiktoken path or a tiktoken encoding name."""
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


def encoding_from_file_bytes(content: bytes, pattern: str, name: str) -> tiktoken.Encoding:
    """The tokenizer of a checkpoint, which keeps the .tiktoken file's bytes (see train.py)."""
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in content.splitlines())}
    return _encoding_from_ranks(ranks, pattern, name)


# ----------------------------------------------------------------------------------------------
# Preparation: <data_dir>/<name>/{train,val}_NNNNNN.bin (flat tokens), tokenizer.tiktoken, meta.json,
# inputs.json (the corpus fingerprint). The folder's name holds a hash of the settings and the
# fingerprint, so a changed corpus gets a new folder and the same corpus under any spelling of its path
# finds its old one.


class Progress:
    """One status line of a long phase: rewritten in place on a terminal, printed every `every` seconds
    otherwise (logs). Rates and ETA from the bytes read of the total."""

    def __init__(self, phase: str, total_bytes: int, log: Callable, every: float = 30.0) -> None:
        self.phase, self.total, self.log = phase, max(1, total_bytes), log
        self.tty = log is print and sys.stdout.isatty()
        self.every = 0.5 if self.tty else every
        self.start = self.last = time.time()
        self.bytes = self.documents = self.tokens = 0

    def update(self, n_bytes: int = 0, documents: int = 0, tokens: int = 0) -> None:
        self.bytes += n_bytes
        self.documents += documents
        self.tokens += tokens
        if time.time() - self.last >= self.every:
            self._show()

    def _show(self) -> None:
        self.last = now = time.time()
        elapsed = max(now - self.start, 1e-9)
        fraction = min(1.0, self.bytes / self.total)
        eta = elapsed / fraction * (1 - fraction) if fraction > 0 else float("nan")
        line = (
            f"data: {self.phase} {fraction:6.1%} | {self.bytes / 1e9:.2f} of {self.total / 1e9:.2f} GB | "
            f"{self.documents / elapsed:,.0f} docs/s"
            + (f" | {self.tokens / elapsed / 1e6:.2f}M tok/s" if self.tokens else "")
            + (f" | ETA {format_duration(eta)}" if math.isfinite(eta) else "")
        )
        if self.tty:
            print(f"\r{line}\033[K", end="", flush=True)
        else:
            self.log(line)

    def close(self) -> None:
        if self.tty and self.last > self.start:
            print("\r\033[K", end="", flush=True)


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


@contextmanager
def exclusive_lock(path: Path, on_busy: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `path` for the with-block; the OS drops it if the process dies. If another
    process holds it: call on_busy(its pid) and wait, or without on_busy raise BlockingIOError(its pid)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            if on_busy is None:
                raise BlockingIOError(holder) from None
            on_busy(holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _document_key(text: str, seed: int) -> tuple[str, int, float]:
    """(text fit for the tokenizer, order key, split draw). The key orders the shuffled stream and finds
    duplicates; the draw in [0, 1) puts the document in val when below val_fraction. Both depend only on
    the text and the seed, so appending documents never moves an existing one to the other split."""
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates (possible in JSON): replaced, as tiktoken's encode does
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        raw = text.encode("utf-8")
    digest = hashlib.blake2b(raw, digest_size=16, key=seed.to_bytes(8, "little")).digest()
    return text, int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little") / 2**64


@dataclass(frozen=True)
class PrepareSettings:
    """Everything besides the corpus that decides the shards' content."""

    tokenizer: str = "bpe"
    vocab_size: int = 8192
    val_fraction: float = 0.05
    seed: int = 1337
    text_field: str = "text"
    tokenizer_train_mb: int = 100

    def key(self) -> dict:
        key = {"val_fraction": self.val_fraction, "seed": self.seed, "text_field": self.text_field}
        if self.tokenizer == "bpe":
            key.update(tokenizer="bpe", vocab_size=self.vocab_size, tokenizer_train_mb=self.tokenizer_train_mb)
        elif self.tokenizer.endswith(".tiktoken") and Path(self.tokenizer).is_file():
            key.update(tokenizer=hashlib.sha256(Path(self.tokenizer).read_bytes()).hexdigest())
        else:
            key.update(tokenizer=self.tokenizer)
        return key


def is_prepared_folder(dataset: str) -> bool:
    """A folder written by `prepare` can itself be given as the dataset (e.g. after copying data/)."""
    return (
        bool(dataset.strip()) and (Path(dataset) / "meta.json").is_file() and (Path(dataset) / "inputs.json").is_file()
    )


def shard_dir_for(data_dir: str, source: Source, settings: PrepareSettings, inputs: list[list]) -> Path:
    """Readable, and unique to the corpus content and the settings that decide the shards."""
    key = json.dumps([settings.key(), source.builtin, source.single_file, inputs, SHARD_FORMAT_VERSION])
    tok = f"bpe{settings.vocab_size}" if settings.tokenizer == "bpe" else _label(Path(settings.tokenizer).stem)
    return Path(data_dir) / f"{source.label}-{tok}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def _check_writable_folder(folder: Path, what: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise DataError(f"{what} {folder} is not a writable folder ({e.strerror})") from None


def prepare(
    dataset: str,
    data_dir: str,
    settings: PrepareSettings = PrepareSettings(),
    exclude: tuple[Path, ...] = (),
    log: Callable = print,
) -> Path:
    """Prepare shards unless they exist for this corpus content and these settings; returns their folder.

    Safe to run from several processes at once (they share one preparation) and to interrupt (the
    shards are written to a temporary folder that is renamed when complete). `exclude`: folders not to
    read when the dataset is a folder holding them (the run's own outputs)."""
    if is_prepared_folder(dataset):
        return Path(dataset)
    source = resolve_dataset(dataset, exclude)
    inputs = fingerprint(source)
    out = shard_dir_for(data_dir, source, settings, inputs)
    if found := _prepared_already(out, settings):
        return found
    _check_writable_folder(Path(data_dir), "data_dir")
    on_busy = lambda pid: log(f"data: waiting for process {pid}, which is preparing {out}")  # noqa: E731
    lock = Path(data_dir) / f".{out.name}.lock"
    with ExitStack() as held:
        try:
            held.enter_context(exclusive_lock(lock, on_busy))
        except OSError as e:
            raise DataError(f"{lock} cannot serve as the preparation's lock ({e.strerror or e}): remove it") from None
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


def _prepared_already(out: Path, settings: PrepareSettings) -> Path | None:
    """These shards' folder if it is complete: named as `out`, or, for a trained tokenizer that came out
    smaller than asked, by its real size (the hash at the end is the same)."""
    candidates = [out]
    if settings.tokenizer == "bpe":
        label, digest = out.name.rsplit(f"-bpe{settings.vocab_size}-", 1)
        candidates += sorted(out.parent.glob(f"{label}-bpe*-{digest}"))
    return next((folder for folder in candidates if (folder / "meta.json").exists()), None)


def _named_by_real_vocabulary(out: Path, settings: PrepareSettings, meta: dict, log) -> Path:
    """A trained tokenizer smaller than asked (a corpus too small for that many merges) says so, and its
    folder is named by its real size."""
    if settings.tokenizer != "bpe" or meta["vocab_size"] == settings.vocab_size:
        return out
    log(
        f"data: the corpus gave a tokenizer of only {meta['vocab_size']:,} tokens, not the "
        f"tokenizer_vocab_size={settings.vocab_size:,} asked (too little text for more merges)"
    )
    return out.with_name(out.name.replace(f"-bpe{settings.vocab_size}-", f"-bpe{meta['vocab_size']}-"))


def _report_stale(data_dir: Path, source: Source, settings: PrepareSettings, inputs: list[list], log) -> None:
    """One line when this dataset was prepared before with other content: what changed."""
    earlier = []
    for meta_path in data_dir.glob("*/meta.json"):
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("source") == source.identity and meta.get("settings") == settings.key():
                earlier.append((meta.get("prepared_at", 0), meta_path.parent))
        except (OSError, ValueError):
            continue
    if earlier:
        folder = max(earlier)[1]
        old_inputs = json.loads((folder / "inputs.json").read_text())
        log(
            f"data: {source.identity} changed since {folder} was prepared ({_describe_changes(old_inputs, inputs)}): "
            f"preparing again (the old shards stay there; delete them to free the space)"
        )


def _prepare_into(out: Path, dataset: str, source: Source, settings: PrepareSettings, inputs: list[list], log) -> dict:
    seconds = {"start": time.time()}
    total_bytes = sum(p[1] for p in inputs)
    if settings.tokenizer == "bpe":
        sample = _tokenizer_sample(source, settings, total_bytes, log)
        if not sample:
            raise DataError(
                f"dataset {dataset!r} holds no non-empty documents"
                if not any(True for _ in read_documents(source, settings.text_field))
                else f"val_fraction={settings.val_fraction} leaves no training documents to train the tokenizer on"
            )
        enc = train_bpe(sample, settings.vocab_size)
        trained_on = {"documents": len(sample), "characters": sum(map(len, sample))}
        log(
            f"data: trained tokenizer {enc.name} on {trained_on['documents']:,} documents "
            f"({trained_on['characters'] / 1e6:.1f}M characters) in {time.time() - seconds['start']:.1f}s"
        )
        del sample
    else:
        enc, trained_on = load_named_tokenizer(settings.tokenizer), None
    write_tiktoken_file(enc, out / "tokenizer.tiktoken")
    dtype = np.dtype(np.uint16 if enc.n_vocab <= 2**16 else np.uint32)
    skipped: Counter = Counter()
    seconds["tokenizer"] = time.time() - seconds["start"]
    n_buckets = _encode_into_buckets(out / "buckets", source, settings, enc, dtype, total_bytes, skipped, log)
    seconds["encoding"] = time.time() - seconds["start"] - seconds["tokenizer"]
    splits = _write_shards(out, n_buckets, dtype, skipped, log)
    shutil.rmtree(out / "buckets")
    seconds["total"] = time.time() - seconds.pop("start")
    seconds["shards"] = seconds["total"] - seconds["tokenizer"] - seconds["encoding"]
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
    meta = {
        "format_version": SHARD_FORMAT_VERSION,
        "dataset": dataset,
        "source": source.identity,
        "settings": settings.key(),
        "tokenizer": settings.tokenizer,
        "tokenizer_name": enc.name,
        "tokenizer_trained_on": trained_on,
        "pattern": enc._pat_str,
        "tokenizer_sha256": hashlib.sha256((out / "tokenizer.tiktoken").read_bytes()).hexdigest(),
        "vocab_size": enc.n_vocab,
        "eot_id": enc.eot_token,
        "val_fraction": settings.val_fraction,
        "seed": settings.seed,
        "dtype": dtype.name,
        "skipped": {why: n for why, n in sorted(skipped.items()) if n},
        "splits": splits,
        "bytes_read": total_bytes,
        "seconds": {phase: round(s, 2) for phase, s in seconds.items()},
        "prepared_at": time.time(),
    }
    (out / "inputs.json").write_text(json.dumps(inputs))
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    for line in describe(meta):
        log(line)
    return meta


def _tokenizer_sample(source: Source, settings: PrepareSettings, total_bytes: int, log) -> list[str]:
    """A deterministic sample of the training documents for the BPE: those with the smallest order keys
    (a uniform draw over the whole corpus) up to tokenizer_train_mb million characters, in key order."""
    budget = settings.tokenizer_train_mb * 1_000_000
    heap: list[tuple[int, str]] = []  # (-key, text): the largest key sits on top, ready to be dropped
    in_sample: set[int] = set()
    chars = 0
    progress = Progress("tokenizer sample", total_bytes, log)
    for text in read_documents(source, settings.text_field, Counter(), lambda n: progress.update(n_bytes=n)):
        progress.update(documents=1)
        text, key, draw = _document_key(text, settings.seed)
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
    folder: Path, source: Source, settings: PrepareSettings, enc, dtype, total_bytes: int, skipped: Counter, log
) -> int:
    """Encode every document on all cores into buckets chosen by its order key: files
    <split>_<bucket>.tokens and .index (key, length per document). Returns the number of buckets."""
    compressed = sum(1 for p in source.files if file_kind(p) == "parquet" or p.name.endswith((".gz", ".zst")))
    estimate = total_bytes * (4 if compressed else 1)  # compressed corpora hold more text than their size
    n_buckets = min(4096, max(1, math.ceil(estimate / BUCKET_TEXT_BYTES)))
    folder.mkdir()
    buffers: dict[tuple[str, int], tuple[list, list, list]] = {}  # (split, bucket): tokens, keys, lengths
    buffered = 0

    def flush() -> None:
        nonlocal buffered
        for (split, bucket), (tokens, keys, lengths) in buffers.items():
            with open(folder / f"{split}_{bucket:05d}.tokens", "ab") as f:
                np.concatenate(tokens).tofile(f)
            index = np.empty(len(keys), dtype=INDEX_DTYPE)
            index["key"], index["length"] = keys, lengths
            with open(folder / f"{split}_{bucket:05d}.index", "ab") as f:
                index.tofile(f)
        buffers.clear()
        buffered = 0

    def store(batch_keys: list[tuple[int, bool]], encoded: tuple[np.ndarray, np.ndarray]) -> None:
        nonlocal buffered
        tokens, lengths = encoded
        for (key, is_val), end, length in zip(batch_keys, np.cumsum(lengths).tolist(), lengths.tolist()):
            bucket = buffers.setdefault(("val" if is_val else "train", key * n_buckets >> 64), ([], [], []))
            bucket[0].append(tokens[end - length : end])
            bucket[1].append(key)
            bucket[2].append(length)
        buffered += tokens.nbytes
        progress.update(tokens=int(lengths.sum()))
        if buffered >= FLUSH_BYTES:
            flush()

    threads = os.cpu_count() or 1
    progress = Progress("encoding", total_bytes, log)
    in_flight: deque = deque()
    batch: list[str] = []
    batch_keys: list[tuple[int, bool]] = []
    batch_chars = 0
    with ThreadPoolExecutor(threads) as pool:
        try:
            for text in read_documents(source, settings.text_field, skipped, lambda n: progress.update(n_bytes=n)):
                text, key, draw = _document_key(text, settings.seed)
                batch.append(text)
                batch_keys.append((key, draw < settings.val_fraction))
                batch_chars += len(text)
                progress.update(documents=1)
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
    flush()
    progress.close()
    return n_buckets


def _write_shards(out: Path, n_buckets: int, dtype, skipped: Counter, log) -> dict:
    """Sort each bucket by order key, drop repeated keys (exact duplicates) and append the documents to
    numbered shards. Keys were drawn uniformly, so the stream is a seeded shuffle of the documents."""
    splits = {}
    folder = out / "buckets"
    progress = Progress("shuffling into shards", sum(p.stat().st_size for p in folder.iterdir()), log)
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
                progress.update(n_bytes=index.nbytes + tokens.nbytes, documents=len(index))
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
                    stream[:take].tofile(current)
                    shards[-1]["tokens"] += take
                    current_tokens += take
                    stream = stream[take:]
        finally:
            if current is not None:
                current.close()
        splits[split] = {"documents": documents, "tokens": sum(s["tokens"] for s in shards), "shards": shards}
    progress.close()
    return splits


def describe(meta: dict) -> list[str]:
    """What a preparation made, for the log and `python data.py`."""
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
    tokens, seconds = train["tokens"] + val["tokens"], meta["seconds"]
    lines.append(
        f"data: {meta['bytes_read'] / 1e6:,.1f} MB read, {tokens:,} tokens in {seconds['total']:.1f}s "
        f"({tokens / max(seconds['total'], 1e-9):,.0f} tokens/s; tokenizer {seconds['tokenizer']:.1f}s, "
        f"encoding {seconds['encoding']:.1f}s, shuffling into shards {seconds['shards']:.1f}s)"
    )
    return lines


# ----------------------------------------------------------------------------------------------
# Loading: every shard memory-mapped, each split read as one array.


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


# what loading and `describe` read
META_KEYS = ("tokenizer_sha256", "pattern", "vocab_size", "eot_id", "dtype", "splits", "dataset", "tokenizer_name")
META_KEYS += ("skipped", "bytes_read", "seconds")


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
        raise DataError(f"{path} was prepared by another version of data.py; delete it to prepare again")
    missing = [key for key in META_KEYS if key not in meta]
    if missing or not all(split in meta["splits"] for split in ("train", "val")):
        what = ", ".join(missing) or "a split"
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
    meta = json.loads((Path(path) / "meta.json").read_text())
    return read_tiktoken_file(Path(path) / "tokenizer.tiktoken", meta["pattern"])


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


# ----------------------------------------------------------------------------------------------
# Packing. A row is a window of the token stream: `start` and how many of its T+1 tokens are real
# (`n_real`); the rest is padding. Concat rows are always full; pad rows hold one document (or one
# chunk of a long one) and padding.


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

    @property
    def counted(self) -> torch.Tensor:
        """(B, T) bool: the targets that count in the loss."""
        return self.targets != IGNORE_INDEX

    def to(self, device: torch.device | str) -> "Batch":
        """To CUDA from pinned memory without blocking, so the next batch is built while the GPU works."""
        cuda = torch.device(device).type == "cuda"
        fields = (getattr(self, f) for f in self.__dataclass_fields__)
        return Batch(*(t.pin_memory().to(device, non_blocking=True) if cuda else t.to(device) for t in fields))


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
    return Batch(inputs.contiguous(), targets, doc_ids, position_ids, doc_positions)


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


def concat_rows(n_tokens: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Contiguous, non-overlapping windows of T+1 tokens (consecutive rows share one token, as x/y do)."""
    starts = np.arange(0, n_tokens - seq_len, seq_len, dtype=np.int64)
    return starts, np.full_like(starts, seq_len + 1), np.zeros_like(starts)


def pad_rows(stream: TokenStream | np.ndarray, eot_id: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row per document, or per chunk of T inputs of a longer one: (starts, n_real, doc_offsets)."""
    doc_ends = eot_positions(stream, eot_id) + 1
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
# python data.py DATASET [--key=value ...]: prepare without training


DATA_KEYS = (
    "dataset",
    "data_dir",
    "tokenizer",
    "tokenizer_vocab_size",
    "val_fraction",
    "data_seed",
    "text_field",
    "tokenizer_train_mb",
)


def main(argv: list[str]) -> int:
    import config  # the settings, their defaults and their checks are train.py's, in config.py
    import data  # run as a script this file is __main__: prepare_data raises the module `data`'s DataError
    import train

    if any(a in ("-h", "--help") for a in argv):
        print(config.help_text("\n\n".join(__doc__.split("\n\n")[:2]), keys=DATA_KEYS))
        return 0
    args = list(argv)
    config_file = [args.pop(0)] if args and args[0].endswith(".toml") else []
    if args and not args[0].startswith("--"):
        args[0] = f"--dataset={args[0]}"
    try:
        for arg in args:
            key = arg[2:].split("=", 1)[0]
            if arg.startswith("--") and key in config.Config.__dataclass_fields__ and key not in DATA_KEYS:
                raise config.ConfigError(f"{key} is not a data setting; data.py takes {', '.join(DATA_KEYS)}")
        cfg = config.parse_config(config_file + args)
        path = train.prepare_data(cfg, log=print)
        meta = data.load_shards(path).meta
    except (config.ConfigError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "\ninterrupted: the unfinished preparation was removed; run the same command to start again",
            file=sys.stderr,
        )
        return 130
    print(f"ready: {path}")
    for line in describe(meta):
        print("  " + line.removeprefix("data: "))
    defaults = config.Config()
    deciding = "".join(
        f" --{key}={getattr(cfg, key)}" for key in DATA_KEYS[1:] if getattr(cfg, key) != getattr(defaults, key)
    )
    print(
        f"train on it with --dataset={cfg.dataset}{deciding} "
        f"(or --dataset={path}, e.g. after copying {cfg.data_dir}/ elsewhere)"
    )
    return 0


if __name__ == "__main__":
    from config import run_main

    run_main(main)
