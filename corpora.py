"""Corpora: what a `dataset` setting names, and its documents, streamed file by file with counts of what
was skipped and why. The built-in corpora (the Python standard library's top-level definitions or whole
modules; the installed packages' definitions, whole modules, or docstrings, which are prose) need no download.
"""

from __future__ import annotations

import ast
import codecs
import glob
import gzip
import hashlib
import json
import os
import sysconfig
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from errors import DataError
from shards import EOT_TEXT, PREPARED_FILES

BUILTIN_DATASETS = ("stdlib", "stdlib-files", "packages", "packages-files", "packages-docs")

DATASET_HELP = (
    f"give one of {', '.join(BUILTIN_DATASETS)}, a directory of text files, a .jsonl file with a 'text' field, "
    "a text file separated by <|endoftext|>, a .parquet, .jsonl.gz or .jsonl.zst file, or a glob of such files"
)


@dataclass(frozen=True)
class Source:
    label: str  # a readable name for the shard folder
    identity: str  # the dataset, however its path was spelled: staleness reports compare it
    root: Path  # file paths in the fingerprint are relative to it
    files: tuple[Path, ...]
    builtin: str | None = None  # "stdlib", "packages": top-level definitions; "...-files": modules; "packages-docs"
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
    """Python sources of exactly the distributions that requirements.txt pins, at the pinned versions, in a
    fixed order. Their own requirements are not followed: those are unpinned, and a corpus read from them
    could not be rebuilt on another machine."""
    import importlib.metadata as metadata  # only needed here

    from packaging.requirements import Requirement

    requirements = Path(__file__).with_name("requirements.txt")
    if not requirements.is_file():
        raise DataError(f"the packages corpora read the distributions that {requirements} pins; it is missing")
    modules = set()
    for line in requirements.read_text().splitlines():
        if not line.split("#")[0].strip():
            continue
        pin = Requirement(line.split("#")[0])
        try:
            distribution = metadata.distribution(pin.name)
        except metadata.PackageNotFoundError:
            raise DataError(
                f"the packages corpora: {pin.name} is not installed; pip install -r {requirements}"
            ) from None
        if not pin.specifier.contains(distribution.version, prereleases=True):
            raise DataError(
                f"the packages corpora: {pin.name} {distribution.version} is installed, {requirements.name} pins "
                f"{pin.specifier}; pip install -r {requirements}"
            )
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


def _refuse_incomplete_preparation(folder: Path) -> None:
    """A folder with some of the files that `prepare` writes is a damaged preparation, not a corpus."""
    present = [name for name in PREPARED_FILES if (folder / name).is_file()]
    if present or any(folder.glob("train_*.bin")):
        missing = [name for name in PREPARED_FILES if name not in present]
        raise DataError(
            f"{folder} looks like a folder prepared by prepare.py but lacks {', '.join(missing)}: it is an incomplete "
            "preparation; delete it and give the corpus to prepare again"
        )


def label(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text).strip("._") or "corpus"


def resolve_dataset(dataset: str, exclude: tuple[Path, ...] = ()) -> Source:
    """The files a dataset setting names. Raises DataError for a dataset that is empty, missing, or of a
    kind that cannot be read."""
    if not dataset.strip():
        raise DataError(f"dataset is empty: {DATASET_HELP}")
    if dataset in ("packages", "packages-files", "packages-docs"):
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
        return Source(label(root.name), str(root), root, tuple(_files_below(root, exclude)))
    if path.is_file():
        name = path.name.lower()
        if name.endswith(".json"):
            raise DataError(f"{path}: a .json file is not a corpus; give JSON Lines (.jsonl), one document per line")
        if file_kind(path) == "text" and name.endswith((".gz", ".zst", ".bz2", ".xz", ".zip")):
            raise DataError(f"{path}: of compressed files only .jsonl.gz and .jsonl.zst are read")
        resolved = path.resolve()
        return Source(label(resolved.name), str(resolved), resolved.parent, (resolved,), single_file=True)
    if glob.has_magic(dataset):
        matches = sorted(p.resolve() for p in _glob_files(os.path.expanduser(dataset)))
        files = tuple(p for p in matches if not any(p.is_relative_to(e) for e in exclude))
        if not files:
            raise DataError(f"dataset {dataset!r} matches no files")
        root = _glob_root(os.path.expanduser(dataset)).resolve()
        identity = str(root / Path(dataset).relative_to(_glob_root(dataset)))
        return Source(label(root.name), identity, root, files)
    raise DataError(f"dataset {dataset!r} not found: {DATASET_HELP}")


# ----------------------------------------------------------------------------------------------
# Reading documents


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


def _module_docstrings(path: Path, skipped: Counter, on_bytes: Callable[[int], None]) -> Iterator[str]:
    """The docstrings of a module, its classes and functions (nested ones too), indentation removed: English
    prose with some markup and examples, mostly a few sentences long. Copies (one docstring inherited by many
    classes) are left to preparation, which keeps each document once."""
    content = path.read_bytes()
    on_bytes(len(content))
    try:
        tree = ast.parse(content.decode("utf-8"))
    except UnicodeDecodeError:
        skipped["not_utf8"] += 1
        return
    except (SyntaxError, ValueError):  # ValueError: source with null bytes
        skipped["syntax_error"] += 1
        return
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, documented) and (docstring := ast.get_docstring(node, clean=True)):
            yield docstring


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


def _file_document(path: Path, skip: Callable[[str, Path], None], on_bytes: Callable[[int], None]) -> Iterator[str]:
    """A file in a corpus folder: one document, or nothing (skipped, by name) if it is not readable UTF-8 text."""
    try:
        content = path.read_bytes()
    except OSError:
        skip("unreadable", path)
        return
    on_bytes(len(content))
    try:
        yield content.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        skip("not_utf8", path)


def without_lone_surrogates(text: str) -> str:
    """`text` with each lone surrogate (JSON can escape one, as in "\\ud800"; UTF-8 cannot hold it) replaced
    by U+FFFD, as tiktoken's encode does; the same object when it holds none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _repairing(documents: Iterator[str], name: str, repaired: Counter | None) -> Iterator[str]:
    """JSON documents with their lone surrogates replaced, counted in `repaired` under the file's name."""
    for document in documents:
        fit = without_lone_surrogates(document)
        if fit is not document and repaired is not None:
            repaired[name] += 1
        yield fit


def _builtin_documents(
    source: Source, skip: Callable[[str, Path], None], skipped: Counter, on_bytes: Callable[[int], None]
) -> Iterator[str]:
    by_module = {"packages": _module_definitions, "packages-docs": _module_docstrings}
    if source.builtin in by_module:  # too large to cache like the standard library: read file by file
        for path in source.files:
            yield from by_module[source.builtin](path, skipped, on_bytes)
    elif source.builtin == "packages-files":
        for path in source.files:
            yield from _file_document(path, skip, on_bytes)
    else:
        yield from stdlib_documents(source.builtin == "stdlib", skipped)
        on_bytes(sum(p.stat().st_size for p in source.files))


def read_documents(
    source: Source,
    text_field: str = "text",
    skipped: Counter | None = None,
    on_bytes: Callable[[int], None] | None = None,
    skipped_files: dict[str, list[str]] | None = None,
    repaired: Counter | None = None,
) -> Iterator[str]:
    """Every non-empty document of a source, in file order. `skipped` counts what was left out and why,
    `skipped_files` names the files skipped whole (in a folder or glob: unreadable, not UTF-8, or with no
    document); a file damaged after some of its documents were read is refused (DataError). `repaired`
    counts by file the JSON documents kept with U+FFFD for lone surrogates; `on_bytes(n)`: bytes read."""
    skipped = Counter() if skipped is None else skipped
    on_bytes = on_bytes or (lambda n: None)

    def skip(reason: str, path: Path) -> None:
        skipped[reason] += 1
        if skipped_files is not None:
            skipped_files.setdefault(reason, []).append(str(path.relative_to(source.root)))

    def documents() -> Iterator[str]:
        if source.builtin:
            yield from _builtin_documents(source, skip, skipped, on_bytes)
            return
        for path in source.files:
            kind = file_kind(path)
            if kind == "text" and not source.single_file:
                yield from _file_document(path, skip, on_bytes)  # skipped and counted if unreadable
                continue
            found = 0
            try:
                if kind == "parquet":
                    reader = _parquet_documents(path, text_field, skipped, on_bytes)
                elif kind == "jsonl":
                    name = str(path.relative_to(source.root))
                    reader = _repairing(_jsonl_documents(path, text_field, on_bytes), name, repaired)
                else:
                    reader = _separated_documents(path, on_bytes)
                for document in reader:
                    found += 1
                    yield document
            except OSError as e:
                raise DataError(f"{path} cannot be read ({e.strerror or e})") from None
            if not found and not source.single_file:
                skip("empty_file", path)

    for doc in documents():
        if doc.strip():
            yield doc
        else:
            skipped["empty"] += 1


# ----------------------------------------------------------------------------------------------
# The fingerprint: what says that a corpus changed


def fingerprint(source: Source) -> list[list]:
    """Per input file: path (relative to the source root), size and SHA-256 of its content. Modification times
    are left out, so the same content prepared on any machine gets the same fingerprint and folder name."""
    prints = []
    for path in source.files:
        relative = path.relative_to(source.root) if path.is_relative_to(source.root) else path
        try:
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            prints.append([str(relative), path.stat().st_size, digest])
        except OSError as e:  # reading it will skip it (in a folder) or say why (alone)
            prints.append([str(relative), -1, f"unreadable: {e.strerror}"])
    return prints


def describe_changes(old: list[list], new: list[list]) -> str:
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
