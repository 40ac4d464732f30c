"""Corpora, tokenizer and shards (corpora.py, prepare.py, and data.py's reading): round trips in every input
format, determinism, staleness, shards that split the stream anywhere, and errors that name the problem."""

import gzip
import hashlib
import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import ROOT, make_documents

import corpora
import prepare
import shards
from config import Config
from data import PackedBatches
from errors import DataError
from shards import BOS_TEXT, EOT_TEXT, TokenStream, load_shards, load_tokenizer, start_marker_id, tiktoken_encoding

SMALL = Config(tokenizer_vocab_size=300, val_fraction=0.25)
QUIET = dict(log=lambda *_: None)


def write_jsonl(path, docs: list[str], field: str = "text") -> str:
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs))
    return str(path)


def prepare_docs(tmp_path, docs: list[str], name: str = "c.jsonl", settings: Config = SMALL):
    return prepare.prepare(write_jsonl(tmp_path / name, docs), str(tmp_path / "data"), settings, **QUIET)


def documents(dataset: str, **kw) -> tuple[list[str], Counter]:
    skipped = Counter()
    return list(corpora.read_documents(corpora.resolve_dataset(dataset), skipped=skipped, **kw)), skipped


def decoded_documents(path, split: str) -> list[str]:
    shards, enc = load_shards(path), load_tokenizer(path)
    stream = getattr(shards, split)[:]
    ends = np.flatnonzero(stream == shards.eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [enc.decode(stream[s:e].tolist()) for s, e in zip(starts, ends)]


def spec_key(text: str, seed: int) -> tuple[int, float]:
    """The rule, restated: a 16-byte BLAKE2b of the UTF-8 text keyed by the seed; its first 8 bytes order
    the documents, its last 8 (as a fraction of 2**64) put a document in val when below val_fraction."""
    digest = hashlib.blake2b(text.encode(), digest_size=16, key=seed.to_bytes(8, "little")).digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little") / 2**64


def shard_bytes(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.bin"))}


def test_prepare_round_trips_every_document_and_splits_by_the_hash_rule(tmp_path):
    docs = [f"document {i}: " + "word " * (i % 17) for i in range(40)]
    path = prepare_docs(tmp_path, docs)
    train, val = decoded_documents(path, "train"), decoded_documents(path, "val")
    assert sorted(train + val) == sorted(docs)
    # the rule: a document is in val when its seeded hash draw is below val_fraction
    assert sorted(val) == sorted(d for d in docs if spec_key(d, SMALL.data_seed)[1] < 0.25)
    assert 0 < len(val) < 40
    meta = json.loads((path / "meta.json").read_text())
    assert meta["splits"]["train"]["documents"] == len(train) and meta["eot_id"] == meta["vocab_size"] - 1 <= 299
    assert meta["dtype"] == "uint16"


def test_stream_order_is_a_seeded_shuffle_by_hash(tmp_path):
    docs = [f"doc {i:03d} " + "x " * (i % 7) for i in range(60)]
    path = prepare_docs(tmp_path, docs)
    train = decoded_documents(path, "train")
    keys = [spec_key(d, SMALL.data_seed)[0] for d in train]
    assert keys == sorted(keys) and train != sorted(train)  # ordered by key, which is not file order


def test_literal_endoftext_in_a_document_stays_text(tmp_path):
    docs = [f"a {EOT_TEXT} b"] * 1 + [f"doc {i}" for i in range(15)]
    path = prepare_docs(tmp_path, docs)
    shards = load_shards(path)
    n_eot = int((shards.train[:] == shards.eot_id).sum() + (shards.val[:] == shards.eot_id).sum())
    assert n_eot == 16  # one per document, none from the literal text
    assert f"a {EOT_TEXT} b" in decoded_documents(path, "train") + decoded_documents(path, "val")


def test_a_literal_bos_text_stays_text_and_the_marker_enters_when_rows_are_built(tmp_path):
    docs = [f"x {BOS_TEXT} y"] + [f"doc {i}" for i in range(15)]
    path = prepare_docs(tmp_path, docs)
    shards = load_shards(path)
    bos = start_marker_id(load_tokenizer(path))
    assert bos == shards.vocab_size  # one past the EOT of a BPE trained here
    assert f"x {BOS_TEXT} y" in decoded_documents(path, "train") + decoded_documents(path, "val")
    stream = np.concatenate([shards.train[:], shards.val[:]])
    assert not (stream == bos).any()  # the shards hold no marker: the same folder serves both conventions
    batch = PackedBatches(stream, shards.eot_id, 512, 1, "pad", bos_id=bos, shuffle=False).batch(np.arange(16))
    assert (batch.inputs[:, 0] == bos).all() and int((batch.inputs == bos).sum()) == 16  # one per document


def test_a_tokenizer_that_holds_the_marker_text_as_a_token_cannot_take_the_marker():
    ranks = {bytes([b]): b for b in range(256)} | {BOS_TEXT.encode(): 256}
    enc = tiktoken_encoding(ranks, prepare.SPLIT_PATTERN, "odd")
    with pytest.raises(DataError, match=r"holds '<\|bos\|>' as an ordinary token \(id 256\).*use bos=false"):
        start_marker_id(enc)


def test_preparation_is_deterministic(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [f"doc {i} " + "x y z " * (i % 5) for i in range(30)])
    a, b = (prepare.prepare(corpus, str(tmp_path / d), SMALL, **QUIET) for d in "ab")
    assert a.name == b.name
    for name in ("train_000000.bin", "val_000000.bin", "tokenizer.tiktoken", "inputs.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_duplicates_and_empty_documents_are_dropped_and_counted(tmp_path):
    docs = ["same"] * 3 + ["", "   \n"] + [f"d{i}" for i in range(12)]
    path = prepare_docs(tmp_path, docs)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["skipped"]["duplicate"] == 2 and meta["skipped"]["empty"] == 2
    assert sum(s["documents"] for s in meta["splits"].values()) == 13


def test_directory_corpus_skips_and_counts_files_that_are_not_utf8_or_not_readable(tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(5):
        (root / f"{i}.txt").write_text(f"file {i}")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "locked.txt").write_text("secret")
    (root / ".hidden").write_text("not a document")
    real_read_bytes = type(root).read_bytes

    def read_bytes(path):  # tests may run as root, for whom permissions do not apply
        if path.name == "locked.txt":
            raise PermissionError(13, "Permission denied")
        return real_read_bytes(path)

    monkeypatch.setattr(type(root), "read_bytes", read_bytes)
    docs, skipped = documents(str(root))
    assert docs == [f"file {i}" for i in range(5)] and skipped == {"not_utf8": 1, "unreadable": 1}


def test_separated_text_corpus_is_read_in_chunks(tmp_path, monkeypatch):
    path = tmp_path / "docs.txt"
    path.write_text(f"one{EOT_TEXT}two\n{EOT_TEXT}{EOT_TEXT}thrée{EOT_TEXT}" + "four " * 10)
    docs, skipped = documents(str(path))
    assert docs == ["one", "two\n", "thrée", "four " * 10] and skipped["empty"] == 1
    # read 3 bytes at a time: separators and multi-byte characters cut across chunks come out the same
    real_open = open
    monkeypatch.setattr(corpora, "open", lambda *a, **k: _SmallReads(real_open(*a, **k)), raising=False)
    assert documents(str(path))[0] == docs


class _SmallReads:
    def __init__(self, f):
        self.f = f

    def read(self, n=-1):
        return self.f.read(3)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_bad_jsonl_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(DataError, match=r'bad.jsonl:2: expected a JSON object with a "text" field'):
        documents(str(path))


def test_jsonl_with_a_byte_order_mark_and_an_upper_case_suffix(tmp_path):
    path = tmp_path / "DOCS.JSONL"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "first"}\n{"text": "second"}\n')
    assert documents(str(path))[0] == ["first", "second"]


def test_a_json_file_is_refused_with_a_hint(tmp_path):
    path = tmp_path / "docs.json"
    path.write_text('[{"text": "a"}]')
    with pytest.raises(DataError, match=r"a .json file is not a corpus; give JSON Lines \(.jsonl\)"):
        corpora.resolve_dataset(str(path))


def test_missing_and_empty_datasets_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        corpora.resolve_dataset(str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match="dataset is empty"):
        corpora.resolve_dataset("")
    with pytest.raises(DataError, match="matches no files"):
        corpora.resolve_dataset(str(tmp_path / "*.parquet"))


def test_stdlib_corpus_is_split_into_top_level_definitions():
    docs = list(corpora.stdlib_documents(split_definitions=True))
    assert len(docs) > 3000
    assert all(d.lstrip().startswith(("def ", "async def ", "class ", "@")) for d in docs)


def test_packages_corpus_is_exactly_the_pinned_distributions(tmp_path):
    import itertools

    source = corpora.resolve_dataset("packages")
    assert source.files == tuple(sorted(source.files)) and len(source.files) > 3000
    relative = {p.relative_to(source.root).as_posix() for p in source.files if p.is_relative_to(source.root)}
    for pinned in ("torch/__init__.py", "numpy/__init__.py", "tiktoken/core.py"):  # from requirements.txt
        assert pinned in relative
    # torch requires sympy, but it is unpinned: a corpus read from it could not be rebuilt
    assert "sympy/__init__.py" not in relative
    assert "pip/__init__.py" not in relative  # installed, but not pinned
    docs = list(itertools.islice(corpora.read_documents(source), 2000))
    assert len(docs) == 2000 and all(d.lstrip().startswith(("def ", "async def ", "class ", "@")) for d in docs)


def test_packages_files_corpus_is_the_same_modules_each_one_whole_document():
    import itertools

    definitions, files = corpora.resolve_dataset("packages"), corpora.resolve_dataset("packages-files")
    assert files.files == definitions.files and files.builtin == "packages-files"
    docs = list(itertools.islice(corpora.read_documents(files), 200))

    def whole(path):
        try:
            return path.read_bytes().decode("utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError:
            return ""  # skipped and counted

    texts = (whole(p) for p in files.files)
    assert docs == list(itertools.islice((t for t in texts if t.strip()), 200))  # whole files, in file order
    assert any(d.lstrip().startswith(("import ", "from ")) for d in docs)  # imports kept, unlike definitions


# ---- input formats: the same documents give the same shards, whatever holds them


def _write_formats(folder, docs: list[str]) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    folder.mkdir()
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    (folder / "c.jsonl").write_bytes(lines)
    (folder / "c.jsonl.gz").write_bytes(gzip.compress(lines))
    (folder / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    table = pa.table({"id": list(range(len(docs) + 1)), "text": docs[:5] + [None] + docs[5:]})
    pq.write_table(table, folder / "c.parquet", row_group_size=7)  # several row groups, and a null
    split = folder / "parts"
    split.mkdir()
    pq.write_table(pa.table({"text": docs[:20]}), split / "a.parquet")
    (split / "b.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs[20:]).encode())
    )
    return {
        "jsonl": str(folder / "c.jsonl"),
        "gz": str(folder / "c.jsonl.gz"),
        "zst": str(folder / "c.jsonl.zst"),
        "parquet": str(folder / "c.parquet"),
        "directory": str(split),
        "glob": str(split / "*.*"),
    }


def test_parquet_gz_zst_directory_and_glob_give_the_same_shards(tmp_path):
    docs = make_documents(60, seed=3)
    inputs = _write_formats(tmp_path / "corpus", docs)
    prepared = {kind: prepare.prepare(path, str(tmp_path / "data"), SMALL, **QUIET) for kind, path in inputs.items()}
    expected = shard_bytes(prepared["jsonl"])
    assert len(expected) == 2
    for kind, path in prepared.items():
        assert shard_bytes(path) == expected, kind
    assert sorted(decoded_documents(prepared["glob"], "train") + decoded_documents(prepared["glob"], "val")) == sorted(
        docs
    )
    assert json.loads((prepared["parquet"] / "meta.json").read_text())["skipped"] == {"null": 1}


def test_text_field_names_the_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "c.jsonl", ["a b", "c d"], field="content")
    assert documents(jsonl, text_field="content")[0] == ["a b", "c d"]
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "c.parquet")
    assert documents(str(tmp_path / "c.parquet"), text_field="content")[0] == ["x"]
    with pytest.raises(DataError, match=r"has no column 'text' \(columns: content\); set --text_field="):
        documents(str(tmp_path / "c.parquet"))


def test_damaged_compressed_files_are_named(tmp_path):
    good = gzip.compress(b'{"text": "a"}\n' * 1000)
    (tmp_path / "cut.jsonl.gz").write_bytes(good[: len(good) // 2])
    with pytest.raises(DataError, match=r"cut.jsonl.gz cannot be read to the end"):
        documents(str(tmp_path / "cut.jsonl.gz"))
    (tmp_path / "bad.jsonl.zst").write_bytes(b"not zstd at all")
    with pytest.raises(DataError, match=r"bad.jsonl.zst cannot be read to the end"):
        documents(str(tmp_path / "bad.jsonl.zst"))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"bad.parquet is not a readable parquet file"):
        documents(str(tmp_path / "bad.parquet"))


# ---- shards: rows that span shard files are the rows of one stream


def test_token_stream_reads_across_parts_like_one_array():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 1000, n).astype(np.uint16) for n in (5, 1, 17, 3)]
    whole, stream = np.concatenate(parts), TokenStream(parts)
    assert len(stream) == len(whole)
    for start in range(len(whole)):
        for stop in range(start, len(whole) + 2, 3):
            assert np.array_equal(stream[start:stop], whole[start:stop])
    index = rng.integers(0, len(whole), (4, 9))
    assert np.array_equal(stream[index], whole[index])


def test_many_buckets_and_flushes_give_the_same_shards_as_one(tmp_path, monkeypatch):
    """A large corpus is encoded into many buckets, each flushed many times: with both made tiny here, the
    shards are byte for byte those of one bucket and one flush, and the stream is ordered by the key."""
    docs = make_documents(300, seed=4)
    one = prepare_docs(tmp_path, docs)
    monkeypatch.setattr(prepare, "BUCKET_TEXT_BYTES", 2000)
    monkeypatch.setattr(prepare, "FLUSH_BYTES", 500)
    many = prepare.prepare(str(tmp_path / "c.jsonl"), str(tmp_path / "data_buckets"), SMALL, **QUIET)
    for name in ("train_000000.bin", "val_000000.bin"):
        assert (one / name).read_bytes() == (many / name).read_bytes(), name
    train_docs = decoded_documents(many, "train")
    keys = [spec_key(d, SMALL.data_seed)[0] for d in train_docs]
    assert keys == sorted(keys) and len(train_docs) > 150


def test_small_shards_give_the_same_stream_and_batches_as_one_shard(tmp_path, monkeypatch):
    docs = make_documents(200, seed=1)
    one = prepare_docs(tmp_path, docs)
    monkeypatch.setattr(prepare, "SHARD_TOKENS", 997)  # a prime: rows and documents cross shard ends anywhere
    many = prepare.prepare(str(tmp_path / "c.jsonl"), str(tmp_path / "data_small"), SMALL, **QUIET)
    a, b = load_shards(one), load_shards(many)
    assert len(b.train.parts) > 3 and np.array_equal(a.train[:], b.train[:])
    for packing, bos_id in [("concat", None), ("pad", None), ("bestfit", None), ("bestfit", a.vocab_size)]:
        x = PackedBatches(a.train, a.eot_id, 64, 8, packing, bos_id=bos_id, seed=5)
        y = PackedBatches(b.train, b.eot_id, 64, 8, packing, bos_id=bos_id, seed=5)
        for _ in range(3 * len(x) // 8):  # several epochs
            bx, by = x.next(), y.next()
            assert all(torch.equal(getattr(bx, f), getattr(by, f)) for f in bx.TENSORS)


def test_truncated_shard_is_detected_and_named(tmp_path):
    path = prepare_docs(tmp_path, [f"doc {i} text" for i in range(20)])
    with open(path / "train_000000.bin", "r+b") as f:
        f.truncate(os.path.getsize(path / "train_000000.bin") - 2)
    with pytest.raises(DataError, match="train_000000.bin is truncated"):
        load_shards(path)


def test_tokenizer_mismatch_is_detected(tmp_path):
    path = prepare_docs(tmp_path, [f"doc {i} text" for i in range(20)])
    (path / "tokenizer.tiktoken").write_text((path / "tokenizer.tiktoken").read_text().replace(" 0\n", " 1\n", 1))
    with pytest.raises(DataError, match="does not match"):
        load_shards(path)


# ---- staleness: a changed corpus is prepared again, the same corpus never


def test_a_changed_file_is_prepared_again_and_says_why(tmp_path):
    corpus = tmp_path / "c.jsonl"
    first = prepare_docs(tmp_path, make_documents(300, seed=1))
    write_jsonl(corpus, make_documents(900, seed=2))
    said = []
    second = prepare.prepare(str(corpus), str(tmp_path / "data"), SMALL, log=said.append)
    assert (
        second != first
        and sum(
            json.loads((second / "meta.json").read_text())["splits"][s]["documents"]
            for s in (
                "train",
                "val",
            )
        )
        > 600
    )
    why = [line for line in said if "changed since" in line]
    assert len(why) == 1 and f"{first}" in why[0] and "c.jsonl:" in why[0] and "bytes" in why[0]


def test_an_unchanged_corpus_is_reused_under_any_spelling_of_its_path(tmp_path, monkeypatch):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "c.jsonl", make_documents(50))
    first = prepare.prepare(str(folder / "c.jsonl"), str(tmp_path / "data"), SMALL, **QUIET)
    (tmp_path / "link.jsonl").symlink_to(folder / "c.jsonl")
    monkeypatch.chdir(folder)
    said = []
    for spelling in ("c.jsonl", "./c.jsonl", "../corpus/c.jsonl", str(tmp_path / "link.jsonl")):
        assert prepare.prepare(spelling, str(tmp_path / "data"), SMALL, log=said.append) == first, spelling
    assert said == []  # nothing prepared, nothing to say
    # a folder and a glob that hold the same files are the same corpus too
    glob_path = prepare.prepare(str(folder / "*.jsonl"), str(tmp_path / "data"), SMALL, **QUIET)
    assert glob_path == prepare.prepare(str(folder), str(tmp_path / "data"), SMALL, **QUIET)
    assert len(list((tmp_path / "data").glob("*/meta.json"))) == 2  # the single file, and the folder (or glob)


def test_appended_documents_leave_every_split_assignment_alone(tmp_path):
    old_docs = make_documents(200, seed=1)
    first = prepare_docs(tmp_path, old_docs)
    second = prepare_docs(tmp_path, old_docs + make_documents(300, seed=2))
    assert second != first
    for split in ("train", "val"):
        assert set(decoded_documents(first, split)) <= set(decoded_documents(second, split)), split


def test_a_prepared_folder_is_a_dataset(tmp_path):
    path = prepare_docs(tmp_path, make_documents(30))
    assert prepare.prepare(str(path), str(tmp_path / "elsewhere"), Config(), **QUIET) == path


def test_a_corpus_folder_holding_the_runs_own_outputs_skips_them(tmp_path):
    root = tmp_path / "project"
    root.mkdir()
    (root / "a.txt").write_text("the only document")
    (root / "data").mkdir()
    (root / "data" / "stray.txt").write_text("not corpus")
    (root / "out").mkdir()
    (root / "out" / "metrics.jsonl").write_text('{"text": "not corpus"}\n')
    source = corpora.resolve_dataset(str(root), exclude=(root / "data", root / "out"))
    assert [p.name for p in source.files] == ["a.txt"]


# ---- the tokenizer sample, interruption, concurrency, the command


def test_bpe_trains_on_a_bounded_deterministic_sample_of_training_documents(tmp_path):
    docs = make_documents(8000, seed=4)  # about 1.4M characters
    settings = Config(tokenizer_vocab_size=300, val_fraction=0.25, tokenizer_train_mb=1)
    path = prepare_docs(tmp_path, docs, settings=settings)
    trained_on = json.loads((path / "meta.json").read_text())["tokenizer_trained_on"]
    train_chars = sum(map(len, decoded_documents(path, "train")))
    assert 900_000 < trained_on["characters"] <= 1_000_000 < train_chars
    sample = prepare._tokenizer_sample(corpora.resolve_dataset(str(tmp_path / "c.jsonl")), settings, 0, lambda *_: None)
    assert sum(map(len, sample)) == trained_on["characters"]
    keys = [spec_key(d, settings.data_seed) for d in sample]
    assert all(draw >= 0.25 for _, draw in keys)  # training documents only
    assert [k for k, _ in keys] == sorted(k for k, _ in keys)  # in key order
    train_keys = sorted(spec_key(d, settings.data_seed)[0] for d in decoded_documents(path, "train"))
    assert [k for k, _ in keys] == train_keys[: len(keys)]  # the smallest keys of the training documents


def test_interrupted_preparation_leaves_no_valid_looking_shards(tmp_path, monkeypatch):
    real_encode, calls = prepare._encode_batch, []

    def encode_then_die(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_encode(*args)

    monkeypatch.setattr(prepare, "_encode_batch", encode_then_die)
    monkeypatch.setattr(prepare, "SHARD_TOKENS", 500)
    docs = make_documents(5000)  # two encoding batches (4096 documents each at most)
    with pytest.raises(KeyboardInterrupt):
        prepare_docs(tmp_path, docs)
    assert [p.name for p in (tmp_path / "data").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setattr(prepare, "_encode_batch", real_encode)
    path = prepare_docs(tmp_path, docs)
    assert load_shards(path).meta["splits"]["val"]["documents"] > 0


def test_leftovers_of_a_killed_preparation_are_removed(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_documents(40))
    name = prepare.shard_dir_for(
        str(tmp_path / "data"),
        corpora.resolve_dataset(corpus),
        SMALL,
        corpora.fingerprint(corpora.resolve_dataset(corpus)),
    ).name
    leftover = tmp_path / "data" / f".{name}.tmp-999999"
    leftover.mkdir(parents=True)
    (leftover / "train_000000.bin").write_bytes(b"half")
    assert prepare.prepare(corpus, str(tmp_path / "data"), SMALL, **QUIET).name == name
    assert not leftover.exists()


@pytest.mark.slow
def test_two_processes_preparing_the_same_data_share_one_copy(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_documents(40000, seed=7))  # seconds to prepare: they overlap
    command = [sys.executable, "prepare.py", corpus, f"--data_dir={tmp_path / 'data'}", "--tokenizer_vocab_size=300"]
    procs = [
        subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    folders = [p for p in (tmp_path / "data").iterdir() if not p.name.endswith(".lock")]
    assert len(folders) == 1 and (folders[0] / "meta.json").exists()
    assert all(f"ready: {folders[0]}" in out for out, _ in outputs)


@pytest.mark.slow
def test_data_command_prepares_and_reports(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_documents(100))
    command = [sys.executable, "prepare.py", corpus, f"--data_dir={tmp_path / 'data'}", "--tokenizer_vocab_size=300"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for expected in ("ready:", "train and", "val documents", "train tokens", "tokenizer bpe300", "tokens/s", "MB read"):
        assert expected in result.stdout, expected
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "trained tokenizer" not in again.stdout and "ready:" in again.stdout
    wrong = subprocess.run([*command, "--n_layer=3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 1 and wrong.stderr.startswith("error: n_layer is not a data setting")


def test_progress_prints_rates_and_eta_as_plain_lines_off_a_terminal():
    lines = []
    progress = prepare.preparation_progress("encoding", 1000, lines.append, every=0)
    progress.advance(250, documents=10, tokens=400)
    assert len(lines) == 1
    assert all(part in lines[0] for part in ("encoding", "25.0%", "docs/s", "M tok/s", "ETA"))


@pytest.mark.slow
def test_data_benchmark_runs_at_a_tiny_size(tmp_path):
    out = tmp_path / "bench_data.json"
    command = [
        sys.executable,
        "-m",
        "bench.preparation",
        "--gb=0.002",
        f"--work_dir={tmp_path / 'work'}",
        f"--out={out}",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    for run in ("bpe", "jsonl", "parquet", "half_jsonl", "half_parquet"):
        assert report[f"prepare_{run}"]["tokens"] > 0 and report[f"prepare_{run}"]["peak_rss_gb"] > 0, run
    # every full-size preparation writes the same tokens, whatever the format
    assert len({report[f"prepare_{run}"]["tokens"] for run in ("bpe", "jsonl", "parquet")}) == 1
    assert "| prepare parquet |" in result.stdout and report["raw_tiktoken"]["tokens"] > 0
    bad = subprocess.run(
        [sys.executable, "-m", "bench.preparation", "--gb=0"], cwd=ROOT, capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1


# ---- rebuilding the same data on another machine


def test_the_folder_name_and_content_digest_depend_on_content_not_modification_times(tmp_path):
    docs = make_documents(60)
    corpus = tmp_path / "c.jsonl"
    first = prepare_docs(tmp_path, docs)
    write_jsonl(corpus, docs)
    os.utime(corpus, (1, 1))  # the same bytes, written at another time, prepared into another data_dir
    second = prepare.prepare(str(corpus), str(tmp_path / "elsewhere"), SMALL, **QUIET)
    assert first.name == second.name
    assert shards.content_digests(first) == shards.content_digests(second)
    assert (first / shards.TIMINGS_FILE).is_file()  # kept, but outside the digest
    assert shards.TIMINGS_FILE not in shards.content_digests(first)
    assert "seconds" not in json.loads((first / "meta.json").read_text())
    size = corpus.stat().st_size
    i = next(i for i, c in enumerate(docs[0]) if c.isascii() and c.isalpha())
    write_jsonl(corpus, [docs[0][:i] + docs[0][i].swapcase() + docs[0][i + 1 :], *docs[1:]])  # one letter changed
    os.utime(corpus, (1, 1))
    assert corpus.stat().st_size == size
    third = prepare.prepare(str(corpus), str(tmp_path / "elsewhere"), SMALL, **QUIET)
    assert third.name != first.name


def test_the_content_digest_is_sha256_of_each_file(tmp_path):
    folder = prepare_docs(tmp_path, make_documents(40))
    expected = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.name != "timings.json"
    }
    assert shards.content_digests(folder) == expected
    assert {"meta.json", "inputs.json", "tokenizer.tiktoken", "train_000000.bin"} <= expected.keys()


def test_packages_refuses_a_distribution_installed_at_another_version_than_its_pin(monkeypatch):
    import importlib.metadata as metadata

    real = metadata.distribution

    class Elsewhere:  # numpy installed at a version other than its pin
        def __getattr__(self, name):
            return getattr(real("numpy"), name)

        version = "0.0.1"

    monkeypatch.setattr(metadata, "distribution", lambda name: Elsewhere() if name == "numpy" else real(name))
    with pytest.raises(DataError, match=r"numpy 0\.0\.1 is installed, requirements.txt pins ==\d"):
        corpora._package_modules()


def test_documents_with_lone_surrogates_are_kept_counted_and_their_files_named(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = make_documents(40)
    (corpus / "clean.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (corpus / "odd.jsonl").write_text('{"text": "half \\ud800 a pair"}\n{"text": "\\udfff alone, twice"}\n')
    lines = []
    folder = prepare.prepare(str(corpus), str(tmp_path / "data"), SMALL, log=lines.append)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["lone_surrogates_replaced"] == 2 and meta["lone_surrogate_files"] == {"odd.jsonl": 2}
    assert any(
        line.startswith("data: 2 document(s) held lone surrogates") and line.endswith("in 1 file(s): odd.jsonl")
        for line in lines
    )
    assert "half \ufffd a pair" in decoded_documents(folder, "train") + decoded_documents(folder, "val")


def test_packages_docs_corpus_is_every_docstring_of_the_same_modules_and_no_code(tmp_path):
    """The prose corpus: the docstrings of the modules `packages` reads, module, class, function and nested
    ones, indentation removed; code, comments and other strings are not documents."""
    import itertools
    from collections import Counter

    module = tmp_path / "m.py"
    module.write_text(
        '"""The module.\n\n    Indented."""\nimport os  # a comment\n\nX = "not a docstring"\n\n\n'
        'class A:\n    """A class.\n\n    Two lines."""\n\n    def f(self):\n        """A method."""\n'
        "        def inner():\n            '''Nested.'''\n        return 1\n\n\ndef g():\n    return 2\n"
    )
    skipped = Counter()
    found = list(corpora._module_docstrings(module, skipped, lambda n: None))
    assert found == ["The module.\n\nIndented.", "A class.\n\nTwo lines.", "A method.", "Nested."] and not skipped
    broken = tmp_path / "broken.py"
    broken.write_text('"""Fine."""\ndef (:\n')
    assert list(corpora._module_docstrings(broken, skipped, lambda n: None)) == [] and skipped["syntax_error"] == 1
    source = corpora.resolve_dataset("packages-docs")
    assert source.files == corpora.resolve_dataset("packages").files and source.builtin == "packages-docs"
    docs = list(itertools.islice(corpora.read_documents(source), 500))
    assert len(docs) == 500 and not any(d.lstrip().startswith(("def ", "class ", "import ")) for d in docs)


def test_a_texts_token_bytes_add_up_to_its_utf8_bytes_and_the_special_tokens_have_none(tmp_path):
    """What bits per byte divide by: each id's UTF-8 length, from the run's own tokenizer (the marker too)."""
    from shards import start_marker_id, token_bytes, with_start_marker

    texts = ["héllo wörld: naïve café", "def f(x):\n    return x ** 2  # ½ ∑", "日本語のテキスト and ASCII"]
    path = prepare_docs(tmp_path, texts * 20)
    plain = load_tokenizer(path)
    bos = start_marker_id(plain)
    enc = with_start_marker(plain, bos)
    lengths = token_bytes(enc)
    assert len(lengths) == enc.n_vocab == bos + 1 and lengths[enc.eot_token] == 0 and lengths[bos] == 0
    for text in texts:
        assert lengths[enc.encode_ordinary(text)].sum() == len(text.encode("utf-8"))
