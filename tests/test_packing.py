"""Packing semantics (data.py), pinned down against the spec in the README, section "The three flags"."""

import numpy as np
import pytest
import torch
from conftest import reference_semantics

from data import (
    IGNORE_INDEX,
    PackedBatches,
    boundary_loss_masked,
    concat_rows,
    document_ids,
    make_batch,
    pad_rows,
    reset_positions,
)

EOT = 99


def row_from_lengths(lengths: list[int], start_offset: int = 0) -> torch.Tensor:
    """A row of documents with the given lengths (EOT included, so the last token of each is EOT)."""
    tokens = []
    for i, n in enumerate(lengths):
        tokens += [10 + i] * (n - 1) + [EOT]
    return torch.tensor(tokens[start_offset:])


def test_worked_example_lengths_3_2_3():
    x = row_from_lengths([3, 2, 3])[None]
    assert document_ids(x, EOT).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert reset_positions(x, EOT).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]


@pytest.mark.parametrize(
    "x, docs, positions",
    [
        ([EOT, 1, 2, 3], [0, 1, 1, 1], [0, 0, 1, 2]),  # boundary at slot 0
        ([1, 2, 3, EOT], [0, 0, 0, 0], [0, 1, 2, 3]),  # boundary at T-1: the EOT keeps its document
        ([EOT, EOT, EOT, 1], [0, 1, 2, 3], [0, 0, 0, 0]),  # single-token documents
        ([1, 2, 3, 4], [0, 0, 0, 0], [0, 1, 2, 3]),  # no boundary
        ([7, EOT, 1, 2], [0, 0, 1, 1], [0, 1, 0, 1]),  # row starts mid-document: position 0 mid-document
    ],
)
def test_edge_cases(x, docs, positions):
    x = torch.tensor([x])
    assert document_ids(x, EOT).tolist() == [docs]
    assert reset_positions(x, EOT).tolist() == [positions]


def test_loss_mask_ignores_target_after_eot_and_keeps_eot_as_target():
    stream = np.array([1, 2, EOT, 3, 4, EOT, 5, 6, 7], dtype=np.uint16)
    b = make_batch(stream, np.array([0]), np.array([9]), 8, EOT)
    # x = 1 2 EOT 3 4 EOT 5 6, y = 2 EOT 3 4 EOT 5 6 7
    assert b.targets.tolist() == [[2, EOT, IGNORE_INDEX, 4, EOT, IGNORE_INDEX, 6, 7]]


def test_last_target_is_right_when_the_row_ends_on_eot():
    # The last input is EOT: its target (first token of the next row's document) must be ignored,
    # which a target-side rule computed over T tokens instead of T+1 would get wrong.
    stream = np.array([1, 2, 3, EOT, 8], dtype=np.uint16)
    b = make_batch(stream, np.array([0]), np.array([5]), 4, EOT)
    assert b.targets.tolist() == [[2, 3, EOT, IGNORE_INDEX]]
    # and when the next row starts on an EOT target, that target (the last one here) is kept
    stream = np.array([1, 2, 3, 4, EOT], dtype=np.uint16)
    assert make_batch(stream, np.array([0]), np.array([5]), 4, EOT).targets.tolist() == [[2, 3, 4, EOT]]


def test_vectorised_batch_matches_the_token_by_token_reference():
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 20, size=5000).astype(np.uint16)
    stream[rng.random(5000) < 0.08] = EOT  # documents of ~12 tokens on average, some of one token
    T = 64
    starts, n_real, _ = concat_rows(len(stream), T)
    b = make_batch(stream, starts, n_real, T, EOT)
    for r, s in enumerate(starts):
        x, y = stream[s : s + T].tolist(), stream[s + 1 : s + T + 1].tolist()
        docs, pos, masked = reference_semantics(x, y, EOT)
        assert b.inputs[r].tolist() == x
        assert b.doc_ids[r].tolist() == docs
        assert b.position_ids[r].tolist() == pos
        assert b.targets[r].tolist() == masked


def test_boundary_loss_masked_uses_the_input_token():
    x = torch.tensor([[5, EOT, 6]])
    y = torch.tensor([[EOT, 6, 7]])
    assert boundary_loss_masked(x, y, EOT).tolist() == [[EOT, IGNORE_INDEX, 7]]


def test_concat_rows_cover_the_stream_without_overlap():
    starts, n_real, _ = concat_rows(1000, 64)
    assert starts.tolist() == list(range(0, 1000 - 64, 64))
    assert (starts[-1] + 64 + 1) <= 1000 and (n_real == 65).all()


def test_pad_rows_hold_one_document_or_chunk_each():
    # documents of 3, 2 and 11 tokens (EOT included), T = 4: the long one needs ceil(10/4) = 3 chunks
    stream = np.array([1, 1, EOT, 2, EOT] + [3] * 10 + [EOT], dtype=np.uint16)
    starts, n_real, offsets = pad_rows(stream, EOT, 4)
    assert starts.tolist() == [0, 3, 5, 9, 13]
    assert n_real.tolist() == [3, 2, 5, 5, 3]
    assert offsets.tolist() == [0, 0, 0, 4, 8]
    b = make_batch(stream, starts, n_real, 4, EOT, doc_offsets=offsets)
    assert b.inputs[0].tolist() == [1, 1, EOT, EOT]  # padding inputs are EOT
    assert b.targets[0].tolist() == [1, EOT, IGNORE_INDEX, IGNORE_INDEX]  # padding targets never count
    assert b.targets[1].tolist() == [EOT] + [IGNORE_INDEX] * 3
    assert b.doc_positions[3].tolist() == [4, 5, 6, 7]  # within-document positions continue across chunks
    assert b.position_ids[3].tolist() == [0, 1, 2, 3]  # ...while the model sees a row start at 0
    counted = sum(int((b.targets[r] != IGNORE_INDEX).sum()) for r in range(5))
    assert counted == (3 - 1) + (2 - 1) + (11 - 1)  # every next-token prediction inside each document


def test_padding_gets_its_own_documents_so_no_attention_row_is_empty():
    stream = np.array([1, 2, EOT], dtype=np.uint16)
    b = make_batch(stream, np.array([0]), np.array([3]), 6, EOT)
    assert b.doc_ids.tolist() == [[0, 0, 0, 1, 2, 3]]


def test_batches_are_deterministic_and_resume_from_their_state():
    stream = np.random.default_rng(1).integers(0, EOT + 1, size=4000).astype(np.uint16)
    a = PackedBatches(stream, EOT, 32, 8, seed=3)
    first = [a.next().inputs for _ in range(30)]  # crosses an epoch boundary (15 batches per epoch)
    b = PackedBatches(stream, EOT, 32, 8, seed=3)
    for _ in range(12):
        b.next()
    c = PackedBatches(stream, EOT, 32, 8, seed=3)
    c.load_state_dict(b.state_dict())
    assert all(torch.equal(first[12 + i], c.next().inputs) for i in range(18))
    other_seed = PackedBatches(stream, EOT, 32, 8, seed=4).next().inputs
    assert not torch.equal(first[0], other_seed)
