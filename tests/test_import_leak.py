"""The import-leak probe (import_leak.py): its pairs, its invariance under the document mask, and a leak it
detects in a model trained to copy the previous file's imports."""

import json
import random
import re

import numpy as np
import pytest
import torch
from conftest import tiny_args

import prepare
import train
from cli import parse_config
from data import Flags, PackedBatches
from model import GPT, GPTConfig
from resolve import resolve
from shards import start_marker_id, with_start_marker
from studies import ablate, import_leak
from studies.import_leak import find_pairs, parse_file, probe
from train import token_losses

MODULES = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


def python_files(seed: int = 0, n: int = 40) -> list[str]:
    """Files that each import one or two modules after a docstring, and use them."""
    rng = random.Random(seed)
    files = []
    for i in range(n):
        used = rng.sample(MODULES, 2 if i % 3 else 1)
        body = "".join(f"value_{j} = {m}.run({j})\n" for j, m in enumerate(used))
        files.append(f'"""File {i}."""\n\n' + "".join(f"import {m}\n" for m in used) + "\n" + body)
    return files


@pytest.fixture(scope="module")
def enc():
    return prepare.train_bpe(python_files(0) + python_files(1), vocab_size=320)


def test_parse_file_reads_module_level_imports_only():
    text = (
        "from __future__ import annotations\nfrom . import sibling\nimport a.b, c\nfrom d.e import f\n"
        "\ndef g():\n    import h\n"
    )
    f = parse_file(text)
    assert set(f.imports) == {"a", "c", "d"}  # no __future__, no relative import, nothing inside functions
    assert f.first_import == 0
    assert text[: f.imports["d"]].endswith("from d.e import f\n")
    assert parse_file("def broken(:\n") is None


def test_pairs_name_a_module_the_preceding_files_import_and_b_never_mentions(enc):
    texts = python_files(2)
    pairs = find_pairs(texts, enc, n_pairs=100)
    assert len(pairs) > 10 and len({p.document for p in pairs}) == len(pairs)  # each B used once
    for p in pairs:
        b = texts[p.document]
        assert not re.search(rf"\b{p.module}\b", b)
        assert p.document not in p.sources and len(p.sources) == max(import_leak.PRECEDING_FILES)
        assert all(f"import {p.module}\n" in texts[a] for a in p.sources)
        assert p.module in p.leak_modules and all(not re.search(rf"\b{m}\b", b) for m in p.leak_modules)
        before = enc.decode(p.preceding[(2, 0)].tolist()).split(enc.decode([enc.eot_token]))
        assert [t.endswith(f"import {p.module}\n") for t in before] == [True, True, False]  # 2 files, then ""
        start = enc.decode(p.context.tolist()) + p.context_rest
        assert b.startswith(start) and b[len(start) :].startswith("import ")  # cut just before B's first import
        assert [enc.decode(c.tolist()) for c in p.continuations] == [
            p.context_rest + f"import {p.module}",
            p.context_rest + f"from {p.module} import",
        ]
    again = find_pairs(texts, enc, n_pairs=100)  # deterministic
    assert [(p.document, p.sources, p.module, p.context.tolist()) for p in again] == [
        (p.document, p.sources, p.module, p.context.tolist()) for p in pairs
    ]


def tiny_gpt(vocab_size: int, seq_len: int = 128, n_head: int = 2, n_embd: int = 32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=2, n_head=n_head, n_embd=n_embd))


def test_with_the_document_mask_the_probe_sees_no_leak_at_all(enc):
    pairs = find_pairs(python_files(3), enc, n_pairs=12)
    model = tiny_gpt(enc.n_vocab).eval()
    result = probe(model, Flags(), enc, pairs, samples=2, device=torch.device("cpu"))
    deltas = [e["delta_logprob"] for e in result["logprob"].values() if e["pairs"]]
    assert len(deltas) >= 4 and max(abs(d) for d in deltas) < 1e-5  # B cannot see what came before it
    sampling = result["sampling"]
    assert sampling["difference"] == 0 and sampling["leak_rate_after"] == sampling["leak_rate_alone"]
    # the same weights without the mask: the files before B change what it predicts
    result = probe(model, Flags(doc_mask=False), enc, pairs, samples=2, device=torch.device("cpu"))
    assert max(abs(e["delta_logprob"]) for e in result["logprob"].values() if e["pairs"]) > 1e-3


def test_the_continuation_log_probability_is_the_sum_over_its_tokens():
    """Pinned against log_softmax of the model's logits at each position, written out."""
    model = tiny_gpt(64, seq_len=32).eval()
    start, continuation = np.array([3, 8, 63, 5, 9]), np.array([11, 12, 13])
    got = import_leak.continuation_logprobs(
        model, Flags(doc_mask=False), 63, [(start, continuation)], torch.device("cpu")
    )
    row = torch.from_numpy(np.concatenate([start, continuation]))[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(row, torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]), None)[0].double(), -1)
    expected = sum(logp[len(start) - 1 + j, token].item() for j, token in enumerate(continuation))
    assert got[0] == pytest.approx(expected, abs=1e-5)


def test_with_the_start_marker_every_file_begins_with_its_bos_and_the_mask_still_hides_them(enc):
    marked = with_start_marker(enc, start_marker_id(enc))
    bos = start_marker_id(enc)
    pairs = find_pairs(python_files(3), marked, n_pairs=12)
    for pair in pairs:
        assert pair.context[0] == bos and (pair.context[1:] != bos).all()  # B begins with its BOS
        for excerpt in [pair.neutral, *pair.preceding.values()]:
            assert (excerpt == bos).sum() == (excerpt == enc.eot_token).sum()  # each file: BOS ... EOT
            assert excerpt[0] == bos and excerpt[-1] == enc.eot_token
    model = tiny_gpt(marked.n_vocab).eval()
    result = probe(model, Flags(), marked, pairs, samples=2, device=torch.device("cpu"))
    assert result["logprob"]["neutral"]["pairs"] and result["logprob"]["k=1,extra=0 vs neutral"]["pairs"]
    assert max(abs(e["delta_logprob"]) for e in result["logprob"].values() if e["pairs"]) < 1e-5


def runs_of_files(n_files: int, seed: int) -> list[str]:
    """Files in runs of four that import the same module: after the first of a run, only a model that sees
    the file before can know what the next one imports."""
    rng = random.Random(seed)
    modules = [rng.choice(MODULES) for _ in range(0, n_files, 4)]
    return [f'"""File {i}."""\n\nimport {modules[i // 4]}\n\nvalue = {modules[i // 4]}.run()\n' for i in range(n_files)]


@pytest.mark.slow
def test_a_model_trained_to_copy_the_previous_imports_leaks_without_the_mask(enc):
    flags = Flags(doc_mask=False)
    model = tiny_gpt(enc.n_vocab, seq_len=64, n_head=4, n_embd=64)
    stream = np.array(sum((enc.encode_ordinary(t) + [enc.eot_token] for t in runs_of_files(8000, seed=0)), []))
    batches = PackedBatches(stream, enc.eot_token, 64, 16, flags=flags, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(600):
        losses, counted = token_losses(model, batches.next(), model.config, flags.doc_mask)
        (losses.sum() / counted.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    pairs = find_pairs(runs_of_files(64, seed=1), enc, n_pairs=16)
    result = probe(model.eval(), flags, enc, pairs, samples=4, device=torch.device("cpu"))
    low, _ = result["logprob"]["k=1,extra=0"]["ci95"]
    assert low > 0.2  # "import m" more likely once a file importing m comes first
    assert result["logprob"]["k=1,extra=0 vs neutral"]["ci95"][0] > 0.2  # than after a file that does not import m
    sampling = result["sampling"]
    assert sampling["ci95"][0] > 0 and sampling["leak_rate_after"] > sampling["leak_rate_alone"]


@pytest.mark.slow
def test_a_study_with_the_leak_probe_reports_it_per_variant(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(python_files(5, n=120)):
        (corpus / f"file{i}.py").write_text(text)
    config = tmp_path / "leak.toml"
    config.write_text(
        f'dataset = "{corpus}"\ndata_dir = "{tmp_path / "data"}"\ntokenizer_vocab_size = 320\nval_fraction = 0.3\n'
        "seq_len = 128\nn_layer = 1\nn_head = 2\nn_embd = 32\nbatch_size = 4\nmax_iters = 2\neval_interval = 2\n"
        f'eval_tokens = 512\nwarmup_iters = 1\n[ablate]\nseeds = 2\nout_dir = "{tmp_path / "study"}"\n'
        'pos_embs = ["learned"]\nvariants = ["reference", "no_doc_mask"]\nprobe_docs = 4\nprobe_offsets = [8]\n'
        "import_leak = true\nleak_pairs = 8\n"
    )
    assert ablate.main([str(config)]) == 0
    study = tmp_path / "study"
    summary = json.loads((study / "results.json").read_text())["summary"]
    assert sorted(summary) == ["learned/no_doc_mask", "learned/reference"]
    reference = summary["learned/reference"]["endpoints"]
    assert (
        reference["leak_logprob"]["verdict"] == "invariant" and reference["leak_logprob"]["max_abs_difference"] < 1e-5
    )
    assert reference["leak_rate"]["verdict"] == "invariant"
    unmasked = summary["learned/no_doc_mask"]["endpoints"]["leak_logprob"]
    assert unmasked["role"] == "secondary" and unmasked["estimate"] != 0  # an untrained model still sees A
    report = (study / "results.md").read_text()
    assert "## Import leak" in report and "\n| learned/no_doc_mask | " in report.split("## Import leak")[1]
    assert (study / "import_leak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_command_line_says_in_one_line_what_is_wrong(tiny_corpus, tmp_path, capsys):
    assert import_leak.main([f"--out_dir={tmp_path / 'none'}"]) == 1
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'none' / 'ckpt.pt'} not found")
    with pytest.raises(SystemExit) as exit_code:
        import_leak.main(["--pairs=0"])
    assert exit_code.value.code == 2 and capsys.readouterr().err == "error: --pairs=0: must be at least 1\n"
    run = tmp_path / "run"  # documents that are not whole Python files with imports
    train.train(resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", run, max_iters=1, eval_interval=1))))
    capsys.readouterr()
    assert import_leak.main([f"--out_dir={run}"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "the probe needs whole Python files" in error
    assert not (run / "import_leak.json").exists()
