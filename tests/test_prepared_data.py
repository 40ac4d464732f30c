"""Faults in the data (corpora.py, prepare.py, shards.py): a truncated or damaged input in any format is
never read as complete; a prepared folder that lacks a file, or whose meta.json or shards are damaged, is
refused and named; the data_dir is never read as the dataset; a prepared folder decides the data
settings, and a rerun with contradicting ones is refused; a preparation that cannot write is one line and
leaves nothing that looks complete; and corpora too small, empty or offline are one clear error."""

import gzip
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken
from conftest import (
    FAULT_CASES,
    ROOT,
    complete_folders,
    jsonl_bytes,
    make_documents,
    one_line,
    python,
    tiny_args,
    tried,
)

import corpora
import prepare
import sample
import shards
import train
from cli import parse_config
from config import Config
from errors import ConfigError, DataError
from resolve import resolve
from run.checkpoint import read_checkpoint
from run.folder import RUN_FILES, exclusive_lock

SMALL = Config(tokenizer_vocab_size=300)


QUIET = dict(log=lambda *_: None)


# ---- truncated or unreadable inputs, in every format


def compressed(kind: str, docs: list[str]) -> tuple[bytes, set[int]]:
    """The corpus in `kind`'s format, and the cut points that leave a valid, shorter file (between frames
    or members: no format can tell those from a complete file)."""
    raw = jsonl_bytes(docs)
    if kind in ("gz", "zst"):
        if kind == "gz":
            return gzip.compress(raw), set()
        import zstandard

        return zstandard.ZstdCompressor().compress(raw), set()
    pieces = [raw[i : i + 4000] for i in range(0, len(raw), 4000)]
    if kind == "gz_members":
        frames = [gzip.compress(p) for p in pieces]
    else:
        import zstandard

        frames = [zstandard.ZstdCompressor().compress(p) for p in pieces]
    return b"".join(frames), set(np.cumsum([len(f) for f in frames]).tolist())


@pytest.mark.parametrize("kind", ["gz", "zst", "gz_members", "zst_frames"])
def test_a_truncated_compressed_jsonl_is_never_read_as_complete(tmp_path, kind):
    docs = make_documents(200)
    content, valid_cuts = compressed(kind, docs)
    suffix = ".jsonl.gz" if kind.startswith("gz") else ".jsonl.zst"
    rng = random.Random(0)
    cuts = {rng.randrange(1, len(content)) for _ in range(40)} | {len(content) - 1, len(content) - 4}
    cuts |= {c + d for c in valid_cuts for d in (-1, 1) if 0 < c + d < len(content)}
    for cut in sorted(cuts):
        path = tmp_path / f"cut{cut}{suffix}"
        path.write_bytes(content[:cut])
        try:
            got = list(corpora.read_documents(corpora.resolve_dataset(str(path))))
        except DataError as e:
            assert str(path) in str(e) and "\n" not in str(e)
        else:
            assert cut in valid_cuts, f"a cut at byte {cut} of {len(content)} read as complete ({len(got)} docs)"
        tried("truncated compressed file")


def test_a_truncated_parquet_file_is_refused(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "full.parquet"
    pq.write_table(pa.table({"text": make_documents(300)}), path, row_group_size=50)
    content = path.read_bytes()
    for cut in sorted({*random.Random(1).sample(range(1, len(content)), 15), len(content) - 1}):
        cut_path = tmp_path / f"cut{cut}.parquet"
        cut_path.write_bytes(content[:cut])
        with pytest.raises(DataError, match="parquet"):
            list(corpora.read_documents(corpora.resolve_dataset(str(cut_path))))
        tried("truncated compressed file")


@pytest.mark.parametrize("layout", ["dictionary", "large_string", "string_view"])
def test_parquet_text_in_every_arrow_string_layout_is_read(tmp_path, layout):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    docs = make_documents(20)
    column = {
        "dictionary": lambda: pa.array(docs).dictionary_encode(),
        "large_string": lambda: pa.array(docs, type=pa.large_string()),
        "string_view": lambda: pa.array(docs, type=pa.string_view()),
    }[layout]()
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": column}), path, store_schema=True)
    assert list(corpora.read_documents(corpora.resolve_dataset(str(path)))) == docs
    tried("parquet string layout")


@pytest.mark.slow
def test_empty_files_in_a_folder_are_skipped_and_named_and_a_damaged_one_is_refused(tmp_path):
    import gzip

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = make_documents(200)
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    (corpus / "good.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    for name in ("empty.jsonl.gz", "empty.jsonl.zst", "empty.jsonl"):
        (corpus / name).write_bytes(b"")
    (corpus / "blank.jsonl").write_text("\n\n")
    folder = prepare.prepare(str(corpus), str(tmp_path / "data"), Config(tokenizer_vocab_size=300), log=print)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["skipped"]["empty_file"] == 4
    assert meta["skipped_files"] == {"empty_file": ["blank.jsonl", "empty.jsonl", "empty.jsonl.gz", "empty.jsonl.zst"]}
    assert any("skipped 4 file(s) whole (empty file): blank.jsonl" in line for line in prepare.describe(meta, {}))
    good = gzip.compress(b'{"text": "a b c"}\n' * 500)
    (corpus / "cut.jsonl.gz").write_bytes(good[: len(good) // 2])  # damage found after some of it was read
    with pytest.raises(DataError, match="cut.jsonl.gz cannot be read to the end"):
        prepare.prepare(str(corpus), str(tmp_path / "data"), Config(tokenizer_vocab_size=300), log=print)


def test_empty_corpus(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no non-empty documents"):
        prepare.prepare(str(tmp_path / "empty"), str(tmp_path / "data"), log=lambda *_: None)
    assert [p.name for p in (tmp_path / "data").iterdir() if not p.name.endswith(".lock")] == []


def test_single_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(DataError, match=r"docs.txt is not UTF-8"):
        list(corpora.read_documents(corpora.resolve_dataset(str(path))))


def test_a_symbolic_link_loop_under_a_recursive_glob_ends(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    for i, doc in enumerate(make_documents(5)):
        (corpus / "sub" / f"{i}.txt").write_text(doc)
    (corpus / "sub" / "loop").symlink_to(corpus)
    result = python(
        "-c", f"import corpora; print(len(corpora.resolve_dataset({str(corpus / '**' / '*.txt')!r}).files))", timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == "5", result.stderr
    tried("symbolic-link loop")


# ---- damaged prepared folders


@pytest.fixture
def prepared(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(make_documents(60)))
    return prepare.prepare(str(corpus), str(tmp_path / "data"), SMALL, **QUIET)


@pytest.mark.parametrize("missing", shards.PREPARED_FILES)
def test_a_prepared_folder_that_lacks_a_file_is_refused_not_read_as_text(prepared, missing):
    (prepared / missing).unlink()
    with pytest.raises(DataError, match=f"incomplete preparation|{missing} is missing"):
        shards.load_shards(prepare.prepare(str(prepared), str(prepared.parent.parent / "other"), SMALL, **QUIET))
    tried("damaged data folder")


@pytest.mark.parametrize("key", shards.META_KEYS)
def test_a_meta_json_without_a_key_is_named(prepared, key):
    meta = json.loads((prepared / "meta.json").read_text())
    del meta[key]
    (prepared / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=f"meta.json lacks {key}"):
        shards.load_shards(prepared)
    tried("damaged data folder")


@pytest.mark.parametrize("key", shards.SETTINGS_KEYS)
def test_a_meta_json_without_a_data_setting_is_named(prepared, key):
    """Training on a prepared folder adopts these: without one it would stop with a KeyError."""
    meta = json.loads((prepared / "meta.json").read_text())
    del meta["settings"][key]
    (prepared / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=f"meta.json lacks settings.{key}"):
        shards.load_shards(prepared)
    tried("damaged data folder")


@pytest.fixture(scope="module")
def prepared_once(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(make_documents(60)))
    return prepare.prepare(str(corpus), str(tmp_path_factory.mktemp("data")), SMALL, **QUIET)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("vocab_size", "300", 'vocab_size is "300", not a whole number of at least 1'),
        ("vocab_size", True, "vocab_size is true, not a whole number"),
        ("eot_id", 300, "eot_id 300 is not below vocab_size 300"),
        ("dtype", "float64", 'dtype is "float64", not uint16 or uint32'),
        ("pattern", 5, "pattern is 5, not text"),
        ("skipped", {"empty_file": "2"}, 'skipped is {"empty_file": "2"}, not a table of counts'),
        ("skipped_files", {"empty_file": "a.jsonl"}, "not a table of file lists"),
        ("tokenizer_trained_on", {"documents": 5.5}, "not a table of counts"),
        ("splits.val.documents", -1, "splits.val.documents is -1, not a whole number of at least 0"),
        ("splits.train.shards.0.file", "../../outside.bin", 'splits.train.shards[0].file is "../../outside.bin"'),
        ("splits.train.shards.0.tokens", "9", 'splits.train.shards[0].tokens is "9", not a whole number of at least 1'),
        ("settings.seed", "1337", 'settings.seed is "1337", not a value of the setting data_seed'),
        ("settings.vocab_size", 100, "settings.vocab_size is 100, not a value of the setting tokenizer_vocab_size"),
        ("settings.val_fraction", None, "settings.val_fraction is null"),
    ],
)
def test_a_meta_json_field_of_the_wrong_type_or_range_is_named(prepared_once, tmp_path, capsys, field, value, words):
    """A prepared folder copied from elsewhere can hold anything: each field that is read is checked, and named,
    before any is used (they were a TypeError, or a file outside the folder read as a shard)."""
    folder = tmp_path / prepared_once.name
    shutil.copytree(prepared_once, folder)
    meta = json.loads((folder / "meta.json").read_text())
    *parents, last = field.split(".")
    inner = meta
    for key in parents:
        inner = inner[int(key) if key.isdigit() else key]
    inner[int(last) if last.isdigit() else last] = value
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=re.escape(words)):
        shards.load_shards(folder)
    assert prepare.main([str(folder)]) == 1  # `python prepare.py FOLDER` describes it: one line
    err = capsys.readouterr().err
    assert err.startswith(f"error: {folder / 'meta.json'}") and err.count("\n") == 1 and "it is damaged" in err
    tried("damaged data folder")


def test_timings_that_are_not_the_numbers_prepare_writes_are_left_out(prepared_once, tmp_path, capsys):
    folder = tmp_path / prepared_once.name
    shutil.copytree(prepared_once, folder)
    for timings in ({"seconds": {"total": "1.0"}, "prepared_at": 1.0}, {"seconds": [1.0]}, [1]):
        (folder / "timings.json").write_text(json.dumps(timings))
        assert shards.read_timings(folder) == {}
        assert prepare.main([str(folder)]) == 0 and "MB read" in capsys.readouterr().out  # described without them


def test_corrupted_meta_json(tiny_corpus, tmp_path):
    path = prepare.prepare(str(tiny_corpus), str(tmp_path / "data"), SMALL, log=lambda *_: None)
    (path / "meta.json").write_text("{ not json")
    with pytest.raises(DataError, match="meta.json is corrupted"):
        shards.load_shards(path)


def test_shard_with_token_ids_outside_the_vocabulary(tiny_corpus, tmp_path):
    path = prepare.prepare(str(tiny_corpus), str(tmp_path / "data"), SMALL, log=lambda *_: None)
    tokens = np.fromfile(path / "val_000000.bin", dtype=np.uint16)
    tokens[0] = 60000
    tokens.tofile(path / "val_000000.bin")
    with pytest.raises(DataError, match="val_000000.bin does not match its tokenizer"):
        shards.load_shards(path)


def test_a_preparation_lock_that_is_a_folder_is_one_line(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(make_documents(60)))
    source = corpora.resolve_dataset(str(corpus))
    name = prepare.shard_dir_for(str(tmp_path / "data"), source, SMALL, corpora.fingerprint(source)).name
    (tmp_path / "data" / f".{name}.lock").mkdir(parents=True)
    with pytest.raises(DataError, match="cannot serve as the preparation's lock"):
        prepare.prepare(str(corpus), str(tmp_path / "data"), SMALL, **QUIET)
    tried("damaged data folder")


@pytest.mark.slow
def test_a_preparation_in_progress_is_waited_for(tiny_corpus, tmp_path):
    data_dir = tmp_path / "data"
    source = corpora.resolve_dataset(str(tiny_corpus))
    name = prepare.shard_dir_for(str(data_dir), source, SMALL, corpora.fingerprint(source)).name
    data_dir.mkdir()
    with exclusive_lock(data_dir / f".{name}.lock"):
        waiting = subprocess.Popen(
            [sys.executable, "prepare.py", str(tiny_corpus), f"--data_dir={data_dir}", "--tokenizer_vocab_size=300"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        first_line = waiting.stdout.readline()
        assert first_line.startswith(f"data: waiting for process {os.getpid()}, which is preparing")
        assert waiting.poll() is None
    stdout, stderr = waiting.communicate(timeout=300)
    assert waiting.returncode == 0 and f"ready: {data_dir / name}" in stdout, stderr


@pytest.mark.slow
def test_a_full_disk_or_a_file_size_limit_while_preparing_or_benchmarking_is_one_line(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(make_documents(4000, seed=5)))

    def limit_files_to(n_bytes):
        return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))

    prepared = python(
        "prepare.py",
        str(corpus),
        f"--data_dir={tmp_path / 'data'}",
        "--tokenizer_vocab_size=300",
        preexec_fn=limit_files_to(50_000),
    )
    assert prepared.returncode == 1 and "could not write the shards" in one_line(prepared)
    assert complete_folders(tmp_path / "data") == [] and not list((tmp_path / "data").glob(".*.tmp-*"))
    bench = python(
        "-m",
        "bench.attention",
        f"--out={tmp_path / 'bench.json'}",
        "--steps=1",
        "--warmup=0",
        preexec_fn=limit_files_to(1),
    )
    assert bench.returncode == 1 and "could not write" in one_line(bench)
    tried("full disk or file-size limit", 2)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_under_a_small_write_is_an_error_not_a_short_file(tmp_path):
    index = np.zeros(3, dtype=prepare.INDEX_DTYPE)  # a bucket's index: a few bytes, left in a buffer until closed
    index["key"], index["length"] = [7, 2**63, 5], [1, 2, 3]
    with pytest.raises(OSError, match="No space left on device"):
        with open("/dev/full", "ab") as full:  # every write there fails as on a full disk
            prepare.append_array(full, index)
    with open(tmp_path / "index", "ab") as f:
        prepare.append_array(f, index[1:])
    assert np.array_equal(np.fromfile(tmp_path / "index", dtype=prepare.INDEX_DTYPE), index[1:])


# ---- the dataset, the data_dir and the data settings


def test_a_dataset_that_is_the_data_dir_is_refused_under_any_spelling(prepared, tmp_path, monkeypatch):
    data_dir = prepared.parent
    (tmp_path / "link").symlink_to(data_dir)
    monkeypatch.chdir(tmp_path)
    for spelling in (str(data_dir), "data", "./data/../data", "link", str(prepared.parent / prepared.name / "..")):
        with pytest.raises(DataError, match="is the data_dir or out_dir of this run"):
            prepare.prepare(spelling, str(data_dir), SMALL, exclude=(data_dir, tmp_path / "out"), **QUIET)
        tried("dataset that is the data_dir")


@pytest.mark.slow
def test_a_dataset_folder_that_holds_the_runs_outputs_skips_them(tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    project.mkdir()
    for i, doc in enumerate(make_documents(400)):
        (project / f"{i}.py").write_text(doc)
    monkeypatch.chdir(project)
    train.train(resolve(parse_config(tiny_args(".", "data", "out", max_iters=1, eval_interval=1))))
    # out/ now holds ckpt.pt, config.json and metrics.jsonl: were they corpus, the data would change and
    # the resumed run would stop on a tokenizer mismatch
    train.train(resolve(parse_config(tiny_args(".", "data", "out", max_iters=2, eval_interval=1) + ["--resume=true"])))
    assert "changed since" not in capsys.readouterr().out
    (meta,) = (project / "data").glob("*/meta.json")
    assert sum(s["documents"] for s in json.loads(meta.read_text())["splits"].values()) == 400
    with pytest.raises(ConfigError, match="dataset is empty"):
        parse_config(["--dataset="])


@pytest.mark.slow
def test_data_dir_that_is_a_file_is_refused_before_reading_the_corpus(tiny_corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="data_dir .* is not a writable folder"):
        train.train(resolve(parse_config(tiny_args(tiny_corpus, blocker, tmp_path / "o"))))


@pytest.mark.slow
def test_a_prepared_folder_decides_the_data_settings_and_a_contradicting_one_is_refused(trained, tmp_path):
    shards = Path(read_checkpoint(trained[0] / "ckpt.pt")["shards"])
    base = tiny_args(shards, tmp_path / "data", tmp_path / "a", max_iters=1, eval_interval=1)
    base = [a for a in base if not a.startswith("--tokenizer_vocab_size")]
    for setting in ("--tokenizer_vocab_size=500", "--val_fraction=0.2", "--data_seed=7", "--text_field=body"):
        with pytest.raises(ConfigError, match=rf"{setting[2:].split('=')[0]}=.*but {shards} was prepared with"):
            train.train(resolve(parse_config(base + [setting])))
    assert not any((tmp_path / "a" / name).exists() for name in RUN_FILES)
    train.train(resolve(parse_config(base)))  # the defaults: the folder's own settings are used, and recorded
    recorded = json.loads((tmp_path / "a" / "config.json").read_text())
    assert recorded["tokenizer_vocab_size"] == 320 and recorded["dataset"] == str(shards)


@pytest.mark.slow
def test_dataset_too_small_for_a_batch(tiny_corpus, tmp_path):
    with pytest.raises(DataError, match=r"fewer than batch_size 4096"):
        train.train(resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "o", batch_size=4096))))


@pytest.mark.slow
def test_a_validation_split_shorter_than_a_row_is_scored_whole_in_one_short_row(tmp_path):
    """Evaluation keeps concat's last, short row: a validation split of fewer tokens than a row still scores
    every target (it once gave no row and stopped the run)."""
    import numpy as np

    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 30}) + "\n" for i in range(20)))
    cfg = parse_config(tiny_args(corpus, tmp_path / "data", tmp_path / "o", seq_len=512, batch_size=1))
    result = train.train(resolve(cfg))
    prepared = shards.load_shards(next(p for p in (tmp_path / "data").iterdir() if p.is_dir()))
    lengths = np.diff(np.flatnonzero(np.asarray(prepared.val) == prepared.eot_id), prepend=-1)
    assert 0 < len(prepared.val) < 512 and result["val_doc_count_by_document"] == (lengths - 1).tolist()
    assert np.isfinite(result["val_loss"]) and result["val_doc_loss_in_context"] == pytest.approx(
        result["val_doc_loss_from_second"], abs=1e-5
    )


# ---- tokenizers


def test_a_tokenizer_smaller_than_asked_says_so_and_its_folder_says_its_size(tmp_path):
    corpus = tmp_path / "tiny.jsonl"
    corpus.write_bytes(jsonl_bytes(["abc abd", "bcd bce", "cde"] * 3 + [f"x{i}" for i in range(5)]))
    said = []
    settings = Config(tokenizer_vocab_size=5000, val_fraction=0.3)
    path = prepare.prepare(str(corpus), str(tmp_path / "data"), settings, log=said.append)
    real = shards.load_shards(path).meta["vocab_size"]
    assert real < 5000 and path.name.split("-")[1] == f"bpe{real}"
    assert any(f"only {real:,} tokens" in line and "5,000" in line for line in said)
    assert prepare.prepare(str(corpus), str(tmp_path / "data"), settings, log=said.append) == path  # found again
    tried("small tokenizer")


def test_a_named_encoding_keeps_its_end_of_text_id_through_shards_and_checkpoints(tmp_path, monkeypatch):
    """tiktoken's named encodings put EOT after a gap (cl100k_base: 100257 for 100256 ranks); reloading
    must not guess max rank + 1. A stand-in encoding, since the real ones download their files."""
    import tiktoken

    ranks = {bytes([b]): b for b in range(256)}
    fake = tiktoken.Encoding(
        "fake", pat_str=prepare.SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 300}
    )
    monkeypatch.setattr(prepare.tiktoken, "get_encoding", lambda name: fake)
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(make_documents(40)))
    path = prepare.prepare(str(corpus), str(tmp_path / "data"), Config(tokenizer="fake"), **QUIET)
    assert shards.load_shards(path).eot_id == 300 == shards.load_tokenizer(path).eot_token
    state = {
        "tokenizer": {
            "name": "fake",
            "pattern": prepare.SPLIT_PATTERN,
            "file": (path / "tokenizer.tiktoken").read_bytes(),
            "eot_id": 300,
        }
    }
    assert sample.checkpoint_tokenizer(state).eot_token == 300
    gapped = {k: v + (v >= 100) for k, v in ranks.items()}  # no rank 100
    fake = tiktoken.Encoding(
        "gapped", pat_str=prepare.SPLIT_PATTERN, mergeable_ranks=gapped, special_tokens={"<|endoftext|>": 300}
    )
    with pytest.raises(DataError, match="has gaps in its ranks"):
        prepare.load_named_tokenizer("gapped")
    tried("named encoding", 2)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"YQ== 0\nYQ== 1\n", "appears twice"),
        (b"YQ== -1\n", "ranks must be 0..0"),
        (b"YQ== 0\nYg== 5\n", "ranks must be 0..1"),
        (b"YQ== 0\n", "single bytes are not tokens"),
        (b"not base64 at all\n", "not a .tiktoken file"),
    ],
    ids=["duplicate", "negative", "gap", "missing-bytes", "garbage"],
)
def test_bad_tiktoken_files_are_named(tmp_path, content, message):
    path = tmp_path / "bad.tiktoken"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        prepare.load_named_tokenizer(str(path))  # a user's file
    with pytest.raises(DataError, match=message):  # the bytes a checkpoint keeps: the same reader, checked
        shards.read_tiktoken(content, prepare.SPLIT_PATTERN, "bad", "the checkpoint's tokenizer")


def test_tokenizer_that_needs_the_network_offline(tmp_path, monkeypatch):
    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(DataError, match="Offline, use tokenizer='bpe' or a local .tiktoken file"):
        prepare.load_named_tokenizer("gpt2")


# ---- the fault cases tried (FAULT_CASES in conftest.py counts them in every file)


def test_report_the_cases_tried():
    """How many distinct fault cases the tests tried (conftest.py runs it last: python -m pytest -s prints it)."""
    print(f"fault cases tried: {sum(FAULT_CASES.values())} ({', '.join(f'{k} {n}' for k, n in FAULT_CASES.items())})")
    assert FAULT_CASES
