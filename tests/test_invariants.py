"""The invariants that define a correct packed-document GPT, each written so that it fails when the
thing it protects is switched off."""

import numpy as np
import pytest
import torch

from data import Flags
from model import GPT, GPTConfig, attention_mask
from studies.scoring import batch_of_rows
from train import accumulate_gradients, token_losses

EOT = 63
T = 32


def tiny_gpt(pos_emb: str, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, seq_len=T, n_layer=2, n_head=2, n_embd=32, pos_emb=pos_emb))


def documents(seed: int = 0, lengths=(9, 6, 12)) -> list[np.ndarray]:
    """Documents as token arrays, each ending with its EOT."""
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(0, EOT, n - 1), EOT).astype(np.uint16) for n in lengths]


def packed(docs: list[np.ndarray], **flags: bool):
    """One row holding the documents back to back, padded to T."""
    stream = np.concatenate(docs)
    return batch_of_rows([stream], T, EOT, flags=Flags(**flags))


def alone(doc: np.ndarray):
    return batch_of_rows([doc], T, EOT)


def logits(model: GPT, batch, doc_mask: bool = True) -> torch.Tensor:
    with torch.no_grad():
        mask = attention_mask(batch.doc_ids, doc_mask, model.config.attn_impl)
        return model(batch.inputs, batch.position_ids, mask)


def summed_loss(model: GPT, batch) -> tuple[torch.Tensor, torch.Tensor]:
    losses, counted = token_losses(model, batch, model.config, doc_mask=True)
    return losses.sum(), counted.sum()


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_document_in_a_packed_row_matches_the_document_alone(pos_emb):
    docs = documents()
    start = len(docs[0])  # the second document sits at slot 9 of the row
    n = len(docs[1])
    model = tiny_gpt(pos_emb)
    got = logits(model, packed(docs))[0, start : start + n]
    expected = logits(model, alone(docs[1]))[0, :n]
    assert torch.allclose(got, expected, atol=1e-5)
    # with the mask off the earlier document leaks in, so the same comparison fails
    leaky = logits(model, packed(docs), doc_mask=False)[0, start : start + n]
    assert not torch.allclose(leaky, expected, atol=1e-3)


BOS = 64  # one past the vocabulary of the documents: the start marker


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_with_the_start_marker_a_packed_document_matches_it_alone_from_its_bos(pos_emb):
    docs = [np.insert(d, 0, BOS) for d in documents()]  # BOS, text, EOT
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, seq_len=T, n_layer=2, n_head=2, n_embd=32, pos_emb=pos_emb))
    start, n = len(docs[0]), len(docs[1])
    got = logits(model, packed(docs))[0, start : start + n]
    expected = logits(model, alone(docs[1]))[0, :n]
    assert torch.allclose(got, expected, atol=1e-5)
    assert packed(docs).position_ids[0, start] == 0  # the BOS sits at position 0
    leaky = logits(model, packed(docs), doc_mask=False)[0, start : start + n]
    assert not torch.allclose(leaky, expected, atol=1e-3)


def test_rope_with_doc_mask_does_not_depend_on_position_reset():
    docs, model = documents(), tiny_gpt("rope")
    reset, no_reset = logits(model, packed(docs)), logits(model, packed(docs, reset_position_ids=False))
    assert torch.allclose(reset, no_reset, atol=1e-5)  # scores depend only on i - j within a document


def test_learned_positions_depend_on_position_reset():
    docs, model = documents(), tiny_gpt("learned")
    reset, no_reset = logits(model, packed(docs)), logits(model, packed(docs, reset_position_ids=False))
    first = len(docs[0])
    assert torch.allclose(reset[0, :first], no_reset[0, :first], atol=1e-6)  # the first document starts at 0 anyway
    assert not torch.allclose(reset[0, first:], no_reset[0, first:], atol=1e-3)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_changing_one_document_never_changes_another(pos_emb):
    docs, model = documents(), tiny_gpt(pos_emb)
    changed = [docs[0].copy(), docs[1], docs[2]]
    changed[0][:-1] = (changed[0][:-1] + 7) % EOT  # same length, different tokens
    a, b = logits(model, packed(docs)), logits(model, packed(changed))
    start = len(docs[0])
    assert torch.allclose(a[0, start:], b[0, start:], atol=1e-6)
    assert not torch.allclose(a[0, :start], b[0, :start], atol=1e-3)
    # without the mask, documents B and C see the change
    assert not torch.allclose(
        logits(model, packed(docs), doc_mask=False)[0, start:],
        logits(model, packed(changed), doc_mask=False)[0, start:],
        atol=1e-3,
    )


@pytest.mark.parametrize("doc_mask", [True, False])
def test_changing_a_future_token_never_changes_past_logits(doc_mask):
    docs = documents()
    model = tiny_gpt("learned")
    later = [d.copy() for d in docs]
    later[1][2] = (later[1][2] + 1) % EOT  # slot 11 of the row
    a, b = logits(model, packed(docs), doc_mask=doc_mask), logits(model, packed(later), doc_mask=doc_mask)
    slot = len(docs[0]) + 2
    assert torch.allclose(a[0, :slot], b[0, :slot], atol=1e-6)
    assert not torch.allclose(a[0, slot:], b[0, slot:], atol=1e-3)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_packed_loss_and_gradients_equal_the_sum_over_documents(pos_emb):
    docs, model = documents(), tiny_gpt(pos_emb)
    loss, count = summed_loss(model, packed(docs))
    loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total, total_count = 0.0, 0
    for doc in docs:
        doc_loss, doc_count = summed_loss(model, alone(doc))
        doc_loss.backward()  # gradients add up across the documents
        total, total_count = total + doc_loss, total_count + doc_count
    assert count == total_count == sum(len(d) - 1 for d in docs)
    assert torch.allclose(loss, total, rtol=1e-5)
    for g_packed, p in zip(packed_grads, model.parameters()):
        assert torch.allclose(g_packed, p.grad, atol=1e-5)
    # without the boundary mask, the packed loss also counts the cross-document predictions
    unmasked, unmasked_count = summed_loss(model, packed(docs, mask_boundary_loss=False))
    assert unmasked_count == count + len(docs) - 1 and not torch.allclose(unmasked, total, rtol=1e-3)


def test_gradient_accumulation_normalises_by_counted_targets_of_the_whole_step():
    # two micro-batches with very different numbers of counted targets
    short, long = documents(1, lengths=(4,)), documents(2, lengths=(10, 11, 9))
    micro = [packed(short), packed(long)]
    assert micro[0].counted.sum() * 5 < micro[1].counted.sum()
    model = tiny_gpt("learned")
    accumulated = accumulate_gradients(model, micro, torch.autocast("cpu", enabled=False), model.config, True)
    grads_accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # the definition, written out: every counted target of the step weighs the same
    by_hand = sum(summed_loss(model, m)[0] for m in micro) / sum(summed_loss(model, m)[1] for m in micro)
    by_hand.backward()
    assert torch.allclose(accumulated, by_hand.detach(), rtol=1e-6)
    for g, p in zip(grads_accumulated, model.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-7)
    model.zero_grad()
    both = type(micro[0])(*(torch.cat([getattr(m, f) for m in micro]) for f in micro[0].TENSORS))
    whole = accumulate_gradients(model, [both], torch.autocast("cpu", enabled=False), model.config, True)
    assert torch.allclose(accumulated, whole, rtol=1e-5)
    for g, p in zip(grads_accumulated, model.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6)
    # averaging per micro-batch instead weighs the short micro-batch's few targets far more
    model.zero_grad()
    for m in micro:
        loss, count = summed_loss(model, m)
        (loss / count / len(micro)).backward()
    differs = [not torch.allclose(g, p.grad, atol=1e-4) for g, p in zip(grads_accumulated, model.parameters())]
    assert any(differs)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_the_model_sees_the_order_of_earlier_tokens(pos_emb):
    """Attention without positions is blind to the order of what it attends to: swapping two earlier tokens
    would leave the last logits as they are. Both position kinds must change them."""
    model = tiny_gpt(pos_emb).eval()
    x = torch.tensor([[5, 9, 17, 3, 40]])
    swapped = torch.tensor([[9, 5, 17, 3, 40]])
    positions = torch.arange(5)[None]
    with torch.no_grad():
        a, b = model(x, positions, None)[0, -1], model(swapped, positions, None)[0, -1]
    assert not torch.allclose(a, b, atol=1e-4)
