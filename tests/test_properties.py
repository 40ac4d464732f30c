"""Property-based: random document layouts (lengths 1..3T, rows starting anywhere, many documents per
row) keep every invariant and the loss-mask rule, for both position kinds and all flag combinations."""

import numpy as np
import pytest
import torch
from conftest import reference_semantics
from hypothesis import given, settings
from hypothesis import strategies as st

from data import IGNORE_INDEX, Flags, PackedBatches
from model import GPT, GPTConfig, attention_mask
from studies.scoring import batch_of_rows

EOT = 63
T = 32
MODELS = {}


def logits(pos_emb: str, doc_mask: bool):
    """A function (inputs, doc_ids, position_ids) -> logits of one small model per position kind."""
    if pos_emb not in MODELS:
        torch.manual_seed(0)
        MODELS[pos_emb] = GPT(GPTConfig(vocab_size=64, seq_len=T, n_layer=2, n_head=2, n_embd=32, pos_emb=pos_emb))
    model = MODELS[pos_emb].eval()
    return lambda inputs, doc_ids, position_ids: model(inputs, position_ids, attention_mask(doc_ids, doc_mask))


@st.composite
def layouts(draw):
    """A stream of documents with lengths 1..3T (EOT included) and a row start anywhere in it."""
    lengths = draw(st.lists(st.integers(1, 3 * T), min_size=1, max_size=40))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    stream = np.concatenate([np.append(rng.integers(0, EOT, n - 1), EOT) for n in lengths]).astype(np.uint16)
    stream = np.concatenate([stream, rng.integers(0, EOT, T + 1).astype(np.uint16)])  # room for a full row
    start = draw(st.integers(0, len(stream) - T - 1))
    return stream, start


def row(stream, start, **flags: bool):
    return batch_of_rows([stream[start : start + T + 1]], T, EOT, flags=Flags(**flags))


def segments(doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    ids = doc_ids[0].tolist()
    bounds = [0] + [t for t in range(1, T) if ids[t] != ids[t - 1]] + [T]
    return list(zip(bounds[:-1], bounds[1:]))


@settings(max_examples=200, deadline=None)
@given(layouts(), st.booleans(), st.booleans())
def test_batch_matches_the_reference_for_every_flag_combination(layout, reset, mask_loss):
    stream, start = layout
    b = row(stream, start, reset_position_ids=reset, mask_boundary_loss=mask_loss)
    x, y = stream[start : start + T].tolist(), stream[start + 1 : start + T + 1].tolist()
    docs, positions, masked = reference_semantics(x, y, EOT)
    assert b.doc_ids[0].tolist() == docs
    assert b.position_ids[0].tolist() == (positions if reset else list(range(T)))
    assert b.targets[0].tolist() == (masked if mask_loss else y)
    if mask_loss:  # the rule: a target is ignored exactly when its input is EOT
        assert ((b.targets == IGNORE_INDEX) == (b.inputs == EOT)).all()


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_pad_rows_count_every_prediction_inside_each_document_once(layout):
    stream, _ = layout
    stream = stream[: np.flatnonzero(stream == EOT)[-1] + 1]  # whole documents only
    batches = PackedBatches(stream, EOT, T, 1, "pad", shuffle=False)
    b = batches.batch(np.arange(len(batches)))
    lengths = np.diff(np.concatenate([[-1], np.flatnonzero(stream == EOT)]))
    assert int((b.targets != IGNORE_INDEX).sum()) == int((lengths - 1).sum())


@settings(max_examples=40, deadline=None)
@given(layouts(), st.sampled_from(["learned", "rope"]))
def test_each_segment_of_a_row_matches_itself_alone_with_the_doc_mask(layout, pos_emb):
    stream, start = layout
    b = row(stream, start)
    with torch.no_grad():
        packed = logits(pos_emb, True)(b.inputs, b.doc_ids, b.position_ids)
        for s, e in segments(b.doc_ids):
            alone = b.inputs[:, s:e]
            expected = logits(pos_emb, True)(alone, torch.zeros_like(alone), torch.arange(e - s)[None])
            assert torch.allclose(packed[:, s:e], expected, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_rope_with_the_doc_mask_ignores_the_position_reset(layout):
    stream, start = layout
    on, off = row(stream, start), row(stream, start, reset_position_ids=False)
    with torch.no_grad():
        a = logits("rope", True)(on.inputs, on.doc_ids, on.position_ids)
        b = logits("rope", True)(off.inputs, off.doc_ids, off.position_ids)
    assert torch.allclose(a, b, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(layouts(), st.sampled_from(["learned", "rope"]), st.data())
def test_changing_one_segment_leaves_the_others_alone(layout, pos_emb, draw):
    stream, start = layout
    b = row(stream, start)
    spans = segments(b.doc_ids)
    s, e = spans[draw.draw(st.integers(0, len(spans) - 1))]
    changed = b.inputs.clone()
    changed[0, s:e] = torch.where(changed[0, s:e] == EOT, EOT, (changed[0, s:e] + 1) % EOT)
    with torch.no_grad():
        before = logits(pos_emb, True)(b.inputs, b.doc_ids, b.position_ids)
        after = logits(pos_emb, True)(changed, b.doc_ids, b.position_ids)
    outside = torch.ones(T, dtype=torch.bool)
    outside[s:e] = False
    assert torch.allclose(before[0, outside], after[0, outside], atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(layouts(), st.sampled_from(["learned", "rope"]))
def test_packed_loss_is_the_sum_of_segment_losses(layout, pos_emb):
    stream, start = layout
    b = row(stream, start)
    m = logits(pos_emb, True)
    loss = torch.nn.functional.cross_entropy
    with torch.no_grad():
        packed = loss(
            m(b.inputs, b.doc_ids, b.position_ids)[0], b.targets[0], ignore_index=IGNORE_INDEX, reduction="sum"
        )
        total = torch.zeros(())
        for s, e in segments(b.doc_ids):
            alone = b.inputs[:, s:e]
            alone_logits = m(alone, torch.zeros_like(alone), torch.arange(e - s)[None])[0]
            total += loss(alone_logits, b.targets[0, s:e], ignore_index=IGNORE_INDEX, reduction="sum")
    assert torch.allclose(packed, total, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_the_properties_can_fail_without_the_mask(pos_emb):
    rng = np.random.default_rng(0)
    stream = np.concatenate([np.append(rng.integers(0, EOT, 9), EOT), rng.integers(0, EOT, T)]).astype(np.uint16)
    b = row(stream, 0)
    with torch.no_grad():
        packed = logits(pos_emb, False)(b.inputs, b.doc_ids, b.position_ids)
        alone = b.inputs[:, 10:]
        expected = logits(pos_emb, False)(alone, torch.zeros_like(alone), torch.arange(T - 10)[None])
    assert not torch.allclose(packed[:, 10:], expected, atol=1e-3)
