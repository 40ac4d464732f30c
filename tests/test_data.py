"""Corpora, tokenizer and shards (data.py): round trips, determinism, and errors that name the problem."""

import json
import os

import numpy as np
import pytest

import data
from data import EOT_TEXT, DataError


def prepare_docs(tmp_path, docs: list[str], name: str = "c.jsonl", **kw):
    corpus = tmp_path / name
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return data.prepare(
        str(corpus), str(tmp_path / "data"), vocab_size=300, val_fraction=0.25, log=lambda *_: None, **kw
    )


def decoded_documents(path, split: str) -> list[str]:
    shards, enc = data.load_shards(path), data.load_tokenizer(path)
    stream = getattr(shards, split)
    ends = np.flatnonzero(stream == shards.eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [enc.decode(stream[s:e].tolist()) for s, e in zip(starts, ends)]


def test_prepare_round_trips_every_document(tmp_path):
    docs = [f"document {i}: " + "word " * (i % 17) for i in range(40)]
    path = prepare_docs(tmp_path, docs)
    train, val = decoded_documents(path, "train"), decoded_documents(path, "val")
    assert sorted(train + val) == sorted(docs) and len(val) == 10
    meta = json.loads((path / "meta.json").read_text())
    assert meta["splits"]["train"]["documents"] == 30 and meta["eot_id"] == meta["vocab_size"] - 1 <= 299
    assert meta["dtype"] == "uint16"


def test_literal_endoftext_in_a_document_stays_text(tmp_path):
    docs = [f"a {EOT_TEXT} b"] * 1 + [f"doc {i}" for i in range(7)]
    path = prepare_docs(tmp_path, docs)
    shards = data.load_shards(path)
    n_eot = int((shards.train == shards.eot_id).sum() + (shards.val == shards.eot_id).sum())
    assert n_eot == 8  # one per document, none from the literal text
    assert f"a {EOT_TEXT} b" in decoded_documents(path, "train") + decoded_documents(path, "val")


def test_preparation_is_deterministic(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " + "x y z " * (i % 5)}) + "\n" for i in range(30)))
    a, b = (data.prepare(str(corpus), str(tmp_path / d), vocab_size=300, log=lambda *_: None) for d in "ab")
    for name in ("train.bin", "val.bin", "tokenizer.tiktoken", "meta.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_duplicates_and_empty_documents_are_dropped_and_counted(tmp_path):
    docs = ["same"] * 3 + ["", "   \n"] + [f"d{i}" for i in range(6)]
    path = prepare_docs(tmp_path, docs)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["skipped"]["duplicate"] == 2 and meta["skipped"]["empty"] == 2
    assert sum(s["documents"] for s in meta["splits"].values()) == 7


def test_directory_corpus_skips_and_counts_files_that_are_not_utf8(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(5):
        (root / f"{i}.txt").write_text(f"file {i}")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    docs, skipped = data.load_documents(str(root))
    assert docs == [f"file {i}" for i in range(5)] and skipped["not_utf8"] == 1


def test_separated_text_corpus(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text(f"one{EOT_TEXT}two\n{EOT_TEXT}{EOT_TEXT}three")
    docs, skipped = data.load_documents(str(path))
    assert docs == ["one", "two\n", "three"] and skipped["empty"] == 1


def test_bad_jsonl_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        data.load_documents(str(path))


def test_missing_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        data.load_documents(str(tmp_path / "nowhere"))


def test_stdlib_corpus_is_split_into_top_level_definitions():
    docs, _ = data.load_stdlib(split_definitions=True)
    assert len(docs) > 3000
    assert all(d.lstrip().startswith(("def ", "async def ", "class ", "@")) for d in docs)


def test_truncated_shard_is_detected_and_named(tmp_path):
    path = prepare_docs(tmp_path, [f"doc {i} text" for i in range(20)])
    with open(path / "train.bin", "r+b") as f:
        f.truncate(os.path.getsize(path / "train.bin") - 2)
    with pytest.raises(DataError, match="train.bin is truncated"):
        data.load_shards(path)


def test_tokenizer_mismatch_is_detected(tmp_path):
    path = prepare_docs(tmp_path, [f"doc {i} text" for i in range(20)])
    (path / "tokenizer.tiktoken").write_text((path / "tokenizer.tiktoken").read_text().replace(" 0\n", " 1\n", 1))
    with pytest.raises(DataError, match="does not match"):
        data.load_shards(path)


def test_interrupted_preparation_leaves_no_valid_looking_shards(tmp_path, monkeypatch):
    real_encode, calls = data.encode_documents, []

    def encode_then_die(enc, docs):
        calls.append(1)
        if len(calls) == 2:  # train.bin is written, val.bin is not
            raise KeyboardInterrupt
        return real_encode(enc, docs)

    monkeypatch.setattr(data, "encode_documents", encode_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare_docs(tmp_path, [f"doc {i}" for i in range(10)])
    assert list((tmp_path / "data").iterdir()) == []  # nothing left behind, complete or not
    monkeypatch.setattr(data, "encode_documents", real_encode)
    path = prepare_docs(tmp_path, [f"doc {i}" for i in range(10)])
    assert data.load_shards(path).meta["splits"]["val"]["documents"] > 0
