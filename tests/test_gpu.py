"""CUDA only: the FlexAttention path (compiled, block-sparse) against the dense SDPA path, forward and
backward, in fp32 and bf16, through the whole model. Skipped without a GPU."""

import numpy as np
import pytest
import torch

from data import make_batch
from model import GPT, GPTConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

EOT = 511
T = 256


def packed_batch(device):
    rng = np.random.default_rng(0)
    stream = rng.integers(0, EOT, size=8 * T + 1).astype(np.uint16)
    stream[rng.random(stream.size) < 1 / 40] = EOT  # ~40-token documents, boundaries off the 128 grid
    starts = np.arange(8) * T
    return make_batch(stream, starts, np.full(8, T + 1), T, EOT).to(device)


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
            logits = model(batch.inputs, batch.doc_ids, batch.position_ids)
        logits.float().square().mean().backward()
        outputs.append(logits.float())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(outputs[0], outputs[1], atol=atol), (outputs[0] - outputs[1]).abs().max()
    scale = grads[1].abs().max()
    assert torch.allclose(grads[0], grads[1], atol=atol * scale), (grads[0] - grads[1]).abs().max()


def test_no_recompilation_when_document_boundaries_change():
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, seq_len=T, n_layer=2, n_head=4, n_embd=128, pos_emb="rope")).cuda()
    compiled = torch.compile(model)
    rng = np.random.default_rng(1)

    def step():
        stream = rng.integers(0, EOT, size=8 * T + 1).astype(np.uint16)
        stream[rng.random(stream.size) < rng.uniform(0.005, 0.05)] = EOT  # a new layout every step
        batch = make_batch(stream, np.arange(8) * T, np.full(8, T + 1), T, EOT).to("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            compiled(batch.inputs, batch.doc_ids, batch.position_ids).float().mean().backward()

    for _ in range(3):  # warm-up
        step()
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(5):
        step()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames_before
