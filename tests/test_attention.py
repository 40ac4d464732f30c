"""Attention masking (model.py): the dense mask and the FlexAttention BlockMask agree, and pin the
document-causal semantics down."""

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import model
from bench.attention import block_mask_of, positions_in_documents
from data import document_ids
from model import (
    GPT,
    GPTConfig,
    apply_rope,
    attend,
    attention_mask,
    compiled_flex_attention,
    document_causal_dense,
)

EOT = 99


def test_worked_example_allowed_matrix_is_three_lower_triangles():
    doc = document_ids(torch.tensor([[1, 1, EOT, 2, EOT, 3, 3, EOT]]), EOT)
    allowed = document_causal_dense(doc)[0, 0].int()
    expected = torch.zeros(8, 8, dtype=torch.int)
    for start, end in [(0, 3), (3, 5), (5, 8)]:
        expected[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.int).tril()
    assert torch.equal(allowed, expected)


def test_doc_mask_off_means_plain_causal():
    doc = torch.tensor([[0, 0, 1, 1]])
    assert attention_mask(doc, doc_mask=False) is None
    q = torch.randn(1, 2, 4, 8)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.allclose(attend(q, q, q, None), F.scaled_dot_product_attention(q, q, q, attn_mask=causal), atol=1e-6)


def layouts_batch(T: int = 256) -> torch.Tensor:
    """Different document layouts per sample: many short documents, one long one, a boundary at 0 and at
    T-1, single-token documents, and boundaries that do not fall on 128-token blocks."""
    rows = []
    for lengths in ([T], [1, 1, 1, T - 3], [37, 91, 128], [T - 1, 1], [3] * (T // 3) + [T % 3], [129, 127]):
        tokens = []
        for n in lengths:
            tokens += [5] * (n - 1) + [EOT]
        rows.append(torch.tensor(tokens[:T]))
    return document_ids(torch.stack(rows), EOT)


def qkv(B: int, T: int, H: int = 4, D: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g) for _ in range(3))


def test_positions_in_documents_restart_on_each_document_of_the_worked_example():
    doc = document_ids(torch.tensor([[1, 1, EOT, 2, EOT, 3, 3, EOT]]), EOT)
    assert positions_in_documents(doc).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]


def test_positions_in_documents_are_the_reset_positions_of_any_batch_padding_included():
    import numpy as np

    from studies.scoring import batch_of_rows

    rng = np.random.default_rng(0)
    stream = rng.integers(0, EOT, 4 * 65).astype(np.int64)
    stream[rng.random(stream.size) < 0.1] = EOT
    rows = [stream[r * 65 : r * 65 + n] for r, n in enumerate([65, 40, 1, 65])]  # two rows padded
    batch = batch_of_rows(rows, 64, EOT)
    assert torch.equal(positions_in_documents(batch.doc_ids).long(), batch.position_ids)


# model.py's mask function (flex_doc) and the benchmark's one gather a score (flex_doc_by_position)
@pytest.mark.parametrize("variant", ["flex_doc_by_position", "flex_doc"])
def test_block_mask_matches_dense_mask(variant):
    doc = layouts_batch()
    block_mask = block_mask_of(variant, doc)
    assert block_mask.shape[0] == doc.shape[0]  # one mask per sample (B = batch size, never None)
    dense = torch.stack(
        [
            block_mask.mask_mod(
                torch.tensor(b), torch.tensor(0), torch.arange(256)[:, None], torch.arange(256)[None, :]
            )
            for b in range(doc.shape[0])
        ]
    )
    assert torch.equal(dense, document_causal_dense(doc)[:, 0])


@pytest.mark.parametrize("variant", ["flex_doc_by_position", "flex_doc"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_forward_matches_dense_sdpa(compiled, variant):
    doc = layouts_batch()
    q, k, v = qkv(doc.shape[0], doc.shape[1])
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_dense(doc))
    flex = compiled_flex_attention if compiled else flex_attention
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # eager flex warns that it is a slow reference
        got = flex(q, k, v, block_mask=block_mask_of(variant, doc))
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    # the test can fail: the same kernel with a shuffled batch of masks disagrees
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        wrong = flex(q, k, v, block_mask=block_mask_of(variant, doc.roll(1, dims=0)))
    assert not torch.allclose(wrong, expected, atol=1e-3)


def test_rope_rotates_each_pair_by_its_angle_and_scores_depend_on_distance_only():
    """apply_rope against complex multiplication by e^(i * position * frequency), and the property that
    makes position reset unnecessary with the mask: shifting every position by 100 leaves q.k unchanged."""
    B, T, H, D = 2, 16, 3, 8
    cos, sin = model.rope_tables(D, 256, 10000.0)
    qk = torch.randn(B, T, 2, H, D, dtype=torch.float64).float()
    positions = torch.randint(0, 128, (B, T))

    def rotated(pos):
        return apply_rope(qk, cos[pos][:, :, None, None], sin[pos][:, :, None, None])

    angles = positions[:, :, None, None, None] * (1.0 / 10000.0 ** (torch.arange(0, D, 2) / D))
    as_complex = torch.complex(*qk.double().chunk(2, dim=-1)) * torch.exp(1j * angles.double())
    expected = torch.cat([as_complex.real, as_complex.imag], dim=-1)
    assert torch.allclose(rotated(positions).double(), expected, atol=1e-5)
    scores = lambda x: torch.einsum("bqhd,bkhd->bhqk", x[:, :, 0], x[:, :, 1])  # noqa: E731
    assert torch.allclose(scores(rotated(positions)), scores(rotated(positions + 100)), atol=1e-4)
    assert not torch.allclose(scores(rotated(positions)), scores(rotated(positions * 2)), atol=1e-2)


def test_rotated_queries_keep_the_token_major_layout_so_the_output_needs_no_copy(monkeypatch):
    """FlexAttention's output takes the query's memory layout; RoPE rotates q in the (B, T, H, D) layout,
    so the attention output transposed back to (B, T, C) is already contiguous (a view, no copy)."""
    outputs = []

    def recording_attend(q, k, v, mask):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = attend(q, k, v, mask)
        outputs.append(out)
        return out

    monkeypatch.setattr(model, "attend", recording_attend)
    gpt = GPT(GPTConfig(vocab_size=128, seq_len=64, n_layer=1, n_head=2, n_embd=32, pos_emb="rope", attn_impl="flex"))
    doc = document_ids(torch.tensor([[1] * 20 + [EOT] + [2] * 43]), EOT)
    with torch.no_grad():  # flex forward only: no backward on CPU
        gpt(torch.ones(1, 64, dtype=torch.long), positions_in_documents(doc).long(), attention_mask(doc, True, "flex"))
    assert outputs and all(out.transpose(1, 2).is_contiguous() for out in outputs)


def test_every_query_attends_to_at_least_itself():
    allowed = document_causal_dense(layouts_batch())
    assert allowed.diagonal(dim1=-2, dim2=-1).all()


@pytest.mark.slow
def test_bench_script_runs_and_reports_every_variant(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "bench.json"
    args = [
        "--seq_lens=128",
        "--tokens=256",
        "--steps=1",
        "--warmup=1",
        "--layouts=real,synthetic",
        "--pos_embs=learned,rope",
        "--variants=reference_causal,reference_causal_cudnn,flex_doc,flex_doc_by_position,sdpa_causal,sdpa_doc,varlen",
        f"--out={out}",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "bench.attention", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = {(r["layout"], r["pos_emb"], r["variant"]): r for r in report["results"]}
    assert len(rows) == len(report["results"]) == 2 * (2 + 2 * 5) and report["peak_flops"] > 0
    for layout in ("real", "synthetic"):
        reference = rows[layout, "learned", "reference_causal"]
        assert reference["tokens_per_sec"] > 0 and "attention_ms" not in reference
        assert rows[layout, "learned", "reference_causal_cudnn"]["skipped"] == "cuDNN attention needs CUDA"
        for pos_emb in ("learned", "rope"):
            assert rows[layout, pos_emb, "sdpa_causal"]["tokens_per_sec"] > 0
            assert 0 < rows[layout, pos_emb, "sdpa_doc"]["mfu_doc"] <= rows[layout, pos_emb, "sdpa_doc"]["mfu"] < 1
            for flex in ("flex_doc", "flex_doc_by_position"):
                assert rows[layout, pos_emb, flex]["attention_ms"] > 0  # forward only on CPU
                assert "skipped" in rows[layout, pos_emb, flex]
            assert "skipped" in rows[layout, pos_emb, "varlen"]
            assert not any("error" in r for r in report["results"])
    assert rows["synthetic", "rope", "sdpa_doc"]["ideal_doc_mask_speedup"] > 1.5  # 64-token documents, T=128
    assert "| 128 | real | 1.0 | learned | reference_causal |" in result.stdout


@pytest.mark.slow
def test_bench_records_a_failing_variant_and_goes_on(tmp_path, monkeypatch):
    import json

    from bench import attention as bench

    out = tmp_path / "bench.json"
    out.write_text('{"an earlier benchmark": 1}')
    written, found = [], []
    real_step, real_write = bench.bench_training_step, bench.write_atomically

    def failing_step(variant, *args):
        if variant == "sdpa_doc":
            raise RuntimeError("out of memory\nsecond line")
        return real_step(variant, *args)

    def recording_write(path, text, *args, **kwargs):
        if Path(path).name == "bench.json":
            written.append(len(json.loads(text).get("results", [])))
            found.append(out.read_text())
        return real_write(path, text, *args, **kwargs)

    monkeypatch.setattr(bench, "bench_training_step", failing_step)
    monkeypatch.setattr(bench, "write_atomically", recording_write)
    argv = ["--seq_lens=64", "--tokens=128", "--steps=1", "--warmup=0", "--layouts=synthetic", "--pos_embs=rope"]
    assert bench.main([*argv, "--variants=sdpa_doc,sdpa_causal", f"--out={out}"]) == 0
    failed, other = json.loads(out.read_text())["results"]
    assert failed["error"] == "RuntimeError: out of memory" and "step_ms" not in failed
    assert other["variant"] == "sdpa_causal" and other["step_ms"] > 0
    assert written == [1, 2]  # rewritten after every row...
    assert found[0] == '{"an earlier benchmark": 1}'  # ...and an earlier benchmark's file kept until the first


def test_every_empty_benchmark_cell_says_why():
    from bench import attention as bench

    common = {"seq_len": 64, "batch_size": 2, "layout": "synthetic", "docs_per_row": 1.0, "ideal_doc_mask_speedup": 1.0}
    timed = {"step_ms": 2.0, "tokens_per_sec": 64.0, "mfu": 0.1, "mfu_doc": 0.1}
    rows = [  # as a CPU run records them
        {"variant": "reference_causal", "pos_emb": "learned", **timed, "attention_skipped": "same call"},
        {
            "variant": "reference_causal_cudnn",
            "pos_emb": "learned",
            "skipped": "needs CUDA",
            "attention_skipped": "same call",
        },
        {"variant": "flex_doc", "pos_emb": "rope", "kernel_options": None, "skipped": "no backward"},
        {"variant": "sdpa_causal", "pos_emb": "rope", **timed, "attention_ms": 1.0, "backward": True},
        {"variant": "sdpa_doc", "pos_emb": "rope", "error": "RuntimeError: out of memory"},
        {"variant": "varlen", "pos_emb": "rope", "skipped": "alone", "attention_skipped": "needs CUDA"},
    ]
    lines = bench.format_table([{**common, **row} for row in rows], n_layer=2).splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    legend = lines[-1]
    # a cell's reason is in its row's last column, by what it belongs to, or in the legend under the table
    belongs = dict.fromkeys(["step ms", "tokens/s", "MFU", "MFU doc"], ("step",))
    belongs |= {"vs fastest reference": ("step", "vs reference"), "vs sdpa_causal": ("step", "vs sdpa_causal")}
    belongs["attn fwd+bwd ms"] = ("attention",)
    for line in lines[2 : 2 + len(rows)]:
        cells = dict(zip(header, (cell.strip() for cell in line.strip("|").split("|"))))
        reasons = {reason.split(": ")[0] for reason in cells["why '-'"].split("; ") if reason}
        for column in (column for column, value in cells.items() if value == "-"):
            explained = f"{column}: " in legend or "error" in reasons or reasons & set(belongs.get(column, ()))
            assert explained, (cells["variant"], column, cells["why '-'"])
    assert "step: needs CUDA" in lines[3] and "attention: same call" in lines[3]
