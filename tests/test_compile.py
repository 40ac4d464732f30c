"""torch.compile sees one graph per setting and never recompiles in training, evaluation or generation.

Graph breaks and recompilations are decided by dynamo before any backend runs, so these tests trace
with the cheap "eager" backend on CPU; tests/test_gpu.py repeats the training-step check with Inductor
and FlexAttention on CUDA."""

from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import train
from config import Config
from model import GPT, GPTConfig, attention_mask
from studies.scoring import batch_of_rows

EOT = 63
T = 32


def packed_batch(seed: int, rows: int = 4):
    """Rows of random tokens, a new document layout for every seed."""
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, EOT, size=rows * T + 1).astype(np.uint16)
    stream[rng.random(stream.size) < rng.uniform(0.05, 0.3)] = EOT
    return batch_of_rows([stream[r * T : r * T + T + 1] for r in range(rows)], T, EOT)


def tiny_gpt(**settings) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=T, n_layer=2, n_head=2, n_embd=32, **settings))


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "attention", [dict(doc_mask=True), dict(doc_mask=True, attn_impl="flex"), dict(doc_mask=False)], ids=str
)
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_the_training_forward_with_its_loss_is_one_graph(pos_emb, attention):
    doc_mask = attention["doc_mask"]
    model = tiny_gpt(pos_emb=pos_emb, **{k: v for k, v in attention.items() if k != "doc_mask"})
    b = packed_batch(0)
    mask = attention_mask(b.doc_ids, doc_mask, model.config.attn_impl)
    with torch.no_grad() if model.config.attn_impl == "flex" else nullcontext():  # no flex backward on CPU
        explanation = torch._dynamo.explain(model)(b.inputs, b.position_ids, mask, b.targets)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_new_document_layouts_do_not_recompile():
    model = tiny_gpt()
    compiled = torch.compile(model, backend="eager")
    for seed in range(6):
        b = packed_batch(seed)
        train.token_losses(compiled, b, model.config, doc_mask=True)[0].sum().backward()
        if seed == 0:
            after_first = compiled_graphs()
    assert compiled_graphs() == after_first == 1


def test_evaluation_compiles_once_even_when_the_last_batch_is_short():
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, EOT, n), EOT) for n in rng.integers(5, 60, size=23)]
    val = np.concatenate(docs).astype(np.uint16)  # 23 documents: the pad pass's last batch of 4 is short
    cfg = Config(seq_len=T, batch_size=4)
    model = tiny_gpt()
    compiled = torch.compile(model, backend="eager")
    train.token_losses(compiled, packed_batch(0), model.config, doc_mask=True)[0].sum().backward()  # a step first
    after_training = compiled_graphs()
    cpu, fp32 = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    first = train.evaluate(compiled, model.config, *train.validation_sets(val, EOT, cfg), cpu, fp32)
    assert compiled_graphs() == after_training + 1  # the same shapes without gradients: one graph for all batches
    second = train.evaluate(compiled, model.config, *train.validation_sets(val, EOT, cfg), cpu, fp32)
    assert compiled_graphs() == after_training + 1
    assert first == second
    eager = train.evaluate(model, model.config, *train.validation_sets(val, EOT, cfg), cpu, fp32)
    assert eager["val_doc_loss"] == pytest.approx(first["val_doc_loss"], rel=1e-5)


@pytest.mark.parametrize("attn_impl", ["sdpa", "flex"])
def test_generation_does_not_compile_per_token(attn_impl):
    """A growing context once compiled FlexAttention anew for every length; one document needs only
    causal attention, which takes any length."""
    model = tiny_gpt(attn_impl=attn_impl).eval()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        b = packed_batch(0)
        compiled(b.inputs, b.position_ids, attention_mask(b.doc_ids, True, attn_impl), b.targets)
    before = compiled_graphs()
    torch.manual_seed(0)
    out = compiled.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=40)
    assert out.shape == (1, 43)
    assert compiled_graphs() == before
