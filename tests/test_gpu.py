"""CUDA only: the FlexAttention path (compiled, block-sparse) against the dense SDPA path, forward and
backward, in fp32 and bf16, through the whole model; and the compiled training step (Inductor) as one
graph that never recompiles. Skipped without a GPU."""

import numpy as np
import pytest
import torch

import train
from model import GPT, GPTConfig, attention_mask
from studies.scoring import batch_of_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

EOT = 511
T = 256


def packed_batch(device):
    rng = np.random.default_rng(0)
    stream = rng.integers(0, EOT, size=8 * T + 1).astype(np.uint16)
    stream[rng.random(stream.size) < 1 / 40] = EOT  # ~40-token documents, boundaries off the 128 grid
    starts = np.arange(8) * T
    return batch_of_rows([stream[s : s + T + 1] for s in starts], T, EOT).to(device)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_flex_and_dense_agree_forward_and_backward(dtype, atol, pos_emb):
    batch = packed_batch("cuda")
    outputs, grads = [], []
    for impl in ("flex", "sdpa"):
        torch.manual_seed(0)
        model = GPT(
            GPTConfig(vocab_size=512, seq_len=T, n_layer=2, n_head=4, n_embd=128, pos_emb=pos_emb, attn_impl=impl)
        ).cuda()
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            logits = model(batch.inputs, batch.position_ids, attention_mask(batch.doc_ids, True, impl))
        logits.float().square().mean().backward()
        outputs.append(logits.float())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(outputs[0], outputs[1], atol=atol), (outputs[0] - outputs[1]).abs().max()
    scale = grads[1].abs().max()
    assert torch.allclose(grads[0], grads[1], atol=atol * scale), (grads[0] - grads[1]).abs().max()


def test_the_compiled_training_step_is_one_graph_and_never_recompiles():
    """Forward and loss trace as one graph with the CUDA BlockMask; under Inductor, forward, loss and
    backward with a new document layout every step compile nothing after the first step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, seq_len=T, n_layer=2, n_head=4, n_embd=128, pos_emb="rope")).cuda()
    compiled = torch.compile(model)
    rng = np.random.default_rng(1)

    def new_batch():
        stream = rng.integers(0, EOT, size=8 * T + 1).astype(np.uint16)
        stream[rng.random(stream.size) < rng.uniform(0.005, 0.05)] = EOT  # a new layout every step
        return batch_of_rows([stream[r * T : r * T + T + 1] for r in range(8)], T, EOT).to("cuda")

    b = new_batch()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(model)(
            b.inputs, b.position_ids, attention_mask(b.doc_ids, doc_mask=True), b.targets
        )
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    torch._dynamo.reset()
    counters.clear()
    for step in range(6):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            train.token_losses(compiled, new_batch(), model.config, doc_mask=True)[0].sum().backward()
        if step == 0:
            graphs_after_first = counters["stats"]["unique_graphs"]  # the model's and the BlockMask builder's
    assert counters["stats"]["unique_graphs"] == graphs_after_first


def test_generating_100_tokens_compiles_nothing():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, seq_len=T, n_layer=2, n_head=4, n_embd=128, attn_impl="flex")).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = torch.compile(model).eval().generate(torch.tensor([[1, 2, 3]], device="cuda"), max_new_tokens=100)
    assert out.shape == (1, 103)
    assert counters["stats"]["unique_graphs"] == 0
