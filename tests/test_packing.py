"""Packing semantics (data.py), pinned down against the spec in the README, section "Why packing needs care", and
against references written independently of the code: token-by-token loops and a brute-force best fit."""

import itertools

import numpy as np
import pytest
import torch
from conftest import reference_semantics

from data import (
    IGNORE_INDEX,
    PACKINGS,
    Documents,
    Flags,
    PackedBatches,
    best_fit_decreasing,
    boundary_loss_masked,
    concat_rows,
    document_chunks,
    document_ids,
    pad_rows,
    reset_positions,
)
from model import document_causal_dense
from reports import batches_statistics, describe_packing, packing_statistics
from studies.scoring import batch_of_rows

EOT = 99
BOS = 100


def row_from_lengths(lengths: list[int], start_offset: int = 0) -> torch.Tensor:
    """A row of documents with the given lengths (EOT included, so the last token of each is EOT)."""
    tokens = []
    for i, n in enumerate(lengths):
        tokens += [10 + i] * (n - 1) + [EOT]
    return torch.tensor(tokens[start_offset:])


def stream_of(lengths: list[int], seed: int = 0) -> np.ndarray:
    """Documents of these lengths (EOT included) with random text tokens, back to back."""
    rng = np.random.default_rng(seed)
    return np.concatenate([np.append(rng.integers(0, EOT, n - 1), EOT) for n in lengths]).astype(np.uint16)


def with_markers_by_hand(stream: np.ndarray) -> list[int]:
    """The document stream with the start marker, one token at a time: BOS before every document."""
    out, at_start = [], True
    for token in stream.tolist():
        if at_start:
            out.append(BOS)
        out.append(token)
        at_start = token == EOT
    return out


def test_worked_example_lengths_3_2_3():
    x = row_from_lengths([3, 2, 3])[None]
    assert document_ids(x, EOT).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert reset_positions(x, EOT).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]


def test_worked_example_with_the_start_marker():
    # the same documents, each now BOS, text, EOT: 4, 3 and 4 tokens in one 11-slot row
    stream = row_from_lengths([3, 2, 3]).numpy()
    docs = Documents(stream, EOT, bos_id=BOS)
    row = docs.tokens(np.arange(docs.n_tokens))
    assert row.tolist() == [BOS, 10, 10, EOT, BOS, 11, EOT, BOS, 12, 12, EOT]
    x = torch.from_numpy(row)[None]
    assert document_ids(x, EOT).tolist() == [[0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]]
    assert reset_positions(x, EOT).tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]]  # the BOS at position 0
    allowed = document_causal_dense(document_ids(x, EOT))[0, 0]
    blocks = torch.block_diag(*(torch.ones(n, n, dtype=torch.bool).tril() for n in (4, 3, 4)))
    assert torch.equal(allowed, blocks)  # three lower triangles, 4x4, 3x3 and 4x4
    # the first text token is predicted from the BOS and counts; the BOS itself, predicted from the EOT, does not
    b = batch_of_rows([row], 10, EOT)
    assert b.targets.tolist() == [[10, 10, EOT, IGNORE_INDEX, 11, EOT, IGNORE_INDEX, 12, 12, EOT]]


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
    b = batch_of_rows([np.array([1, 2, EOT, 3, 4, EOT, 5, 6, 7])], 8, EOT)
    # x = 1 2 EOT 3 4 EOT 5 6, y = 2 EOT 3 4 EOT 5 6 7
    assert b.targets.tolist() == [[2, EOT, IGNORE_INDEX, 4, EOT, IGNORE_INDEX, 6, 7]]


def test_last_target_is_right_when_the_row_ends_on_eot():
    # The last input is EOT: its target (first token of the next row's document) must be ignored,
    # which a target-side rule computed over T tokens instead of T+1 would get wrong.
    assert batch_of_rows([np.array([1, 2, 3, EOT, 8])], 4, EOT).targets.tolist() == [[2, 3, EOT, IGNORE_INDEX]]
    # and when the next row starts on an EOT target, that target (the last one here) is kept
    assert batch_of_rows([np.array([1, 2, 3, 4, EOT])], 4, EOT).targets.tolist() == [[2, 3, 4, EOT]]


@pytest.mark.parametrize("bos_id", [None, BOS])
def test_concat_batches_match_the_token_by_token_reference(bos_id):
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 20, size=5000).astype(np.uint16)
    stream[rng.random(5000) < 0.08] = EOT  # documents of ~12 tokens on average, some of one token
    T = 64
    by_hand = np.array(with_markers_by_hand(stream) if bos_id else stream.tolist())
    batches = PackedBatches(stream, EOT, T, 1, bos_id=bos_id, shuffle=False)
    b = batches.batch(np.arange(len(batches)))
    assert len(b.inputs) == (len(by_hand) - 1) // T
    for r in range(len(b.inputs)):
        x, y = by_hand[r * T : r * T + T].tolist(), by_hand[r * T + 1 : r * T + T + 1].tolist()
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
    rows = concat_rows(Documents(stream_of([10] * 100), EOT), 64)
    assert rows.start.tolist() == list(range(0, 1000 - 64, 64))
    assert (rows.start[-1] + 64 + 1) <= 1000 and (rows.length == 65).all()


def test_document_stream_positions_count_from_the_first_text_token():
    docs = Documents(stream_of([3, 2]), EOT, bos_id=BOS)
    assert docs.starts.tolist() == [0, 4] and docs.lengths.tolist() == [4, 3]
    assert docs.doc_positions(np.arange(7)).tolist() == [-1, 0, 1, 2, -1, 0, 1]
    plain = Documents(stream_of([3, 2]), EOT)
    assert plain.doc_positions(np.arange(5)).tolist() == [0, 1, 2, 0, 1]


def test_pad_rows_hold_one_document_or_chunk_each():
    # documents of 3, 2 and 11 tokens (EOT included), T = 4: the long one needs ceil(10/4) = 3 chunks
    stream = np.array([1, 1, EOT, 2, EOT] + [3] * 10 + [EOT], dtype=np.uint16)
    rows = pad_rows(Documents(stream, EOT), 4)
    assert rows.start.tolist() == [0, 3, 5, 9, 13]
    assert rows.length.tolist() == [3, 2, 5, 5, 3]
    b = PackedBatches(stream, EOT, 4, 8, "pad", shuffle=False).batch(np.arange(5))
    assert b.inputs[0].tolist() == [1, 1, EOT, EOT]  # padding inputs are EOT
    assert b.targets[0].tolist() == [1, EOT, IGNORE_INDEX, IGNORE_INDEX]  # padding targets never count
    assert b.targets[1].tolist() == [EOT] + [IGNORE_INDEX] * 3
    assert b.doc_positions[3].tolist() == [4, 5, 6, 7]  # within-document positions continue across chunks
    assert b.position_ids[3].tolist() == [0, 1, 2, 3]  # ...while the model sees a row start at 0
    counted = sum(int((b.targets[r] != IGNORE_INDEX).sum()) for r in range(5))
    assert counted == (3 - 1) + (2 - 1) + (11 - 1)  # every next-token prediction inside each document


def test_pad_rows_with_the_marker_start_each_document_with_its_bos():
    stream = np.array([1, 1, EOT, 2, EOT] + [3] * 6 + [EOT], dtype=np.uint16)
    b = PackedBatches(stream, EOT, 4, 8, "pad", bos_id=BOS, shuffle=False).batch(np.arange(4))
    assert b.inputs.tolist() == [[BOS, 1, 1, EOT], [BOS, 2, EOT, EOT], [BOS, 3, 3, 3], [3, 3, 3, EOT]]
    # a later chunk of a long document starts inside it: no BOS there, and position 0 for the model
    assert b.doc_positions.tolist() == [[-1, 0, 1, 2], [-1, 0, 1, 0], [-1, 0, 1, 2], [3, 4, 5, 6]]
    assert b.targets[0].tolist() == [1, 1, EOT, IGNORE_INDEX]  # the first text token counts, from the BOS
    assert int(b.counted.sum()) == 3 + 2 + 7  # every text token and each EOT, once


def test_padding_gets_its_own_documents_so_no_attention_row_is_empty():
    b = batch_of_rows([np.array([1, 2, EOT])], 6, EOT)
    assert b.doc_ids.tolist() == [[0, 0, 0, 1, 2, 3]]


@pytest.mark.parametrize("length, chunks", [(5, [5]), (6, [6]), (7, [6, 2]), (11, [6, 6]), (12, [6, 6, 2])])
def test_documents_longer_than_a_row_are_cut_into_chunks_that_share_one_token(length, chunks):
    # T = 5: a row holds T + 1 = 6 tokens; chunks start every T tokens
    start, size = document_chunks(Documents(stream_of([length]), EOT), 5)
    assert size.tolist() == chunks
    assert start.tolist() == [5 * i for i in range(len(chunks))]


def brute_force_best_fit(sizes: list[int], capacity: int, alone: int = 0) -> list[int]:
    """Best fit by definition: scan every open row for the one with the least room that fits the item,
    the first such row on ties, where rows are ranked by the order they were last put in their room class;
    each of the first `alone` items opens a row of its own."""
    rooms, last_touched, rows = [], [], []
    clock = 0
    for item, size in enumerate(sizes):
        fitting = [r for r, room in enumerate(rooms) if room >= size] if item >= alone else []
        if fitting:
            least = min(rooms[r] for r in fitting)
            row = max((r for r in fitting if rooms[r] == least), key=lambda r: last_touched[r])
        else:
            row = len(rooms)
            rooms.append(capacity)
            last_touched.append(0)
        rooms[row] -= size
        clock += 1
        last_touched[row] = clock
        rows.append(row)
    return rows


@pytest.mark.parametrize("seed", range(12))
def test_best_fit_decreasing_matches_the_brute_force_definition(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(1, 40))
    sizes = sorted(rng.integers(1, capacity + 1, int(rng.integers(0, 200))).tolist(), reverse=True)
    alone = int(rng.integers(0, len(sizes) + 1)) if seed % 2 else 0
    assert best_fit_decreasing(sizes, capacity, alone=alone).tolist() == brute_force_best_fit(sizes, capacity, alone)


def test_best_fit_takes_the_row_it_fills_exactly_and_opens_a_row_only_when_none_fits():
    # capacity 10: 7 opens row 0 (room 3), 6 opens row 1 (room 4), 4 fills row 1 exactly, 3 fills row 0
    assert best_fit_decreasing([7, 6, 4, 3, 10, 9, 1], 10).tolist() == [0, 1, 1, 0, 2, 3, 3]


@pytest.mark.parametrize("bos_id", [None, BOS])
@pytest.mark.parametrize("seed", range(4))
def test_bestfit_predicts_every_token_of_every_document_exactly_once(bos_id, seed):
    rng = np.random.default_rng(seed)
    T = 16
    lengths = rng.integers(2, 3 * T, 60).tolist() + [T, T + 1, T + 2, 2 * T + 1]  # and the boundary lengths
    stream = stream_of(lengths, seed)
    batches = PackedBatches(stream, EOT, T, 4, "bestfit", bos_id=bos_id, shuffle=False)
    docs, rows = batches.documents, batches.rows
    index, n_real = rows.index(np.arange(len(rows)), T + 1)
    assert (n_real <= T + 1).all() and (n_real >= 2).all()  # no row holds more than T + 1 tokens
    inputs, targets = index[:, :-1].ravel(), index[:, 1:].ravel()
    real = inputs >= 0
    inputs, targets = inputs[real], targets[real]
    # every prediction inside a document (from the token before, in the same piece) is made exactly once:
    # every token but each document's first; and no token is an input twice
    inside = targets[(targets == inputs + 1) & ~np.isin(targets, docs.starts)]  # (two pieces may be adjacent)
    assert sorted(inside.tolist()) == sorted(set(range(docs.n_tokens)) - set(docs.starts.tolist()))
    assert len(set(inputs.tolist())) == len(inputs)
    # a piece follows another only after that one's EOT: its first target is a boundary prediction, which
    # mask_boundary_loss ignores
    across = (targets >= 0) & (targets != inputs + 1)
    assert across.any() and (docs.tokens(inputs[across]) == EOT).all()
    # and its first target opens a document: a chunk that continues one starts its row, so the token it
    # shares with the chunk before is never a target twice, even with mask_boundary_loss off
    assert np.isin(targets[across], docs.starts).all()
    # the tokens come out as the document stream holds them, the marker included
    by_hand = np.array(with_markers_by_hand(stream) if bos_id else stream.tolist())
    b = batches.batch(np.arange(len(rows)))
    real = index[:, :-1] >= 0
    assert torch.equal(b.inputs[torch.from_numpy(real)], torch.from_numpy(by_hand[index[:, :-1][real]]))
    assert int(b.counted.sum()) == sum(n - 1 for n in docs.lengths.tolist())  # with the boundary mask


def test_bestfit_rows_hold_whole_documents_and_pad_the_rest():
    # T = 8 (rows of 9): documents of 9, 5, 4, 3, 3 and 2 tokens fill rows 9 | 5+4 | 3+3+2 with 1 padding slot
    stream = stream_of([3, 9, 2, 5, 3, 4])
    rows = PACKINGS["bestfit"](Documents(stream, EOT), 8)
    held = [sorted(rows.length[rows.offsets[r] : rows.offsets[r + 1]].tolist()) for r in range(len(rows))]
    assert held == [[9], [4, 5], [2, 3, 3]]


def test_bestfit_starts_a_row_with_the_last_chunk_of_a_long_document():
    # T = 8 (rows of 9): a document of 11 tokens (slots 0-10) fills row 0 with slots 0-8; its last chunk (8-10,
    # sharing slot 8) and a document of 5 tokens (11-15) share row 1, the chunk first although it was placed
    # second, so that the row starts inside a document as a concat row does
    rows = PACKINGS["bestfit"](Documents(stream_of([11, 5]), EOT), 8)
    index, n_real = rows.index(np.arange(len(rows)), 9)
    assert index.tolist() == [list(range(0, 9)), [8, 9, 10, 11, 12, 13, 14, 15, -1]]
    assert n_real.tolist() == [9, 8]


def test_bestfit_rows_depend_on_the_data_only():
    stream = stream_of(np.random.default_rng(3).integers(2, 50, 200).tolist())
    a, b = (PACKINGS["bestfit"](Documents(s, EOT), 32) for s in (stream, stream.copy()))
    assert np.array_equal(a.start, b.start) and np.array_equal(a.offsets, b.offsets)


@pytest.mark.parametrize("packing", ["concat", "pad", "bestfit"])
@pytest.mark.parametrize("bos_id", [None, BOS])
def test_batches_are_deterministic_and_resume_from_their_state(packing, bos_id):
    stream = stream_of(np.random.default_rng(1).integers(2, 40, 200).tolist())
    a = PackedBatches(stream, EOT, 32, 8, packing, bos_id=bos_id, seed=3)
    per_epoch = len(a) // 8
    first = [a.next().inputs for _ in range(2 * per_epoch + 3)]  # crosses two epoch boundaries
    b = PackedBatches(stream, EOT, 32, 8, packing, bos_id=bos_id, seed=3)
    for _ in range(per_epoch + 1):  # stopped mid-epoch
        b.next()
    c = PackedBatches(stream, EOT, 32, 8, packing, bos_id=bos_id, seed=3)
    c.load_state_dict(b.state_dict())
    assert c.state_dict() == {"epoch": 1, "cursor": 8}  # two integers
    assert all(torch.equal(first[per_epoch + 1 + i], c.next().inputs) for i in range(per_epoch + 2))
    other_seed = PackedBatches(stream, EOT, 32, 8, packing, bos_id=bos_id, seed=4).next().inputs
    assert not torch.equal(first[0], other_seed)


def test_packing_statistics_on_a_hand_counted_layout():
    # T = 4 (rows of 5 tokens), documents of 3, 2 and 11 tokens
    stream = np.array([1, 1, EOT, 2, EOT] + [3] * 10 + [EOT], dtype=np.uint16)
    docs = Documents(stream, EOT)
    # concat: rows 0-4 (3 | 2), 4-8 (EOT of doc 1 | 3 of doc 2), 8-12 (inside doc 2)
    concat = packing_statistics(docs, concat_rows(docs, 4), 4)
    assert concat["rows"] == 3 and concat["documents"] == 3
    assert concat["documents_per_row"] == pytest.approx(5 / 3)  # inputs: {0, 1}, {1, 2}, {2}
    assert concat["padding_share"] == 0
    # document 1 (tokens 3-4) is whole in row 0, whose last target is its EOT; document 2 crosses row edges
    assert concat["documents_split_or_cut"] == pytest.approx(1 / 3)
    # inputs whose document began in the row: 4 of row 0, 0 + 3 of row 1, none of row 2
    assert concat["tokens_with_their_document_start_in_the_row"] == pytest.approx(7 / 12)
    assert concat["tokens_seeing_another_document_without_the_mask"] == pytest.approx(4 / 12)  # slot 3 | 5, 6, 7
    pad = packing_statistics(docs, pad_rows(docs, 4), 4)
    assert pad["documents_per_row"] == 1 and pad["tokens_seeing_another_document_without_the_mask"] == 0
    assert pad["padding_share"] == pytest.approx(4 / 20)  # real inputs: 3 + 2 + 4 + 4 + 3 of 5 rows x 4
    assert pad["documents_split_or_cut"] == pytest.approx(1 / 3)
    assert pad["tokens_with_their_document_start_in_the_row"] == pytest.approx(9 / 16)  # 3 + 2 + 4 + 0 + 0


@pytest.mark.parametrize("bos_id", [None, BOS])
def test_concat_leaves_out_the_splits_last_tokens_too_few_for_a_row_and_the_log_says_how_many(bos_id):
    """(n_tokens - 1) mod T of them, as Megatron-LM leaves out; pad and bestfit hold every token."""
    T = 8
    for n_documents in range(1, 12):
        documents = Documents(stream_of([2 + (3 * i) % 5 for i in range(n_documents)]), EOT, bos_id)
        if documents.n_tokens <= T:
            continue
        stats = packing_statistics(documents, concat_rows(documents, T), T)
        left_out = (documents.n_tokens - 1) % T
        assert stats["tokens_in_no_row"] == left_out
        said = f"; the split's last {left_out} token{'s' * (left_out != 1)} in no row (too few for one)"
        assert (said in describe_packing("concat", {**stats, "rows_left_out_each_epoch": 0})) == (left_out > 0)
        for packing in (pad_rows, PACKINGS["bestfit"]):
            assert packing_statistics(documents, packing(documents, T), T)["tokens_in_no_row"] == 0


def test_padding_is_counted_over_every_row_and_the_figures_from_a_sample_say_so():
    """Above max_rows, the per-row and per-token figures come from a sample; the padding is every row's (it was
    the sample's too: 0.0114% logged where 0.0036% was exact, on 25,801 rows)."""
    lengths = np.random.default_rng(0).integers(1, 40, 500).tolist()
    documents = Documents(stream_of(lengths), EOT)
    rows = pad_rows(documents, 16)
    real = np.minimum(rows.length, 16)  # one piece a row: its real input slots
    stats = packing_statistics(documents, rows, 16, max_rows=50)
    assert stats["padding_share"] == pytest.approx(1 - real.sum() / (len(rows) * 16), abs=1e-12)
    assert (stats["rows"], stats["rows_sampled"]) == (len(rows), 50)
    line = describe_packing("pad", {**stats, "rows_left_out_each_epoch": 0})
    assert f"packing=pad: {len(rows):,} rows, {stats['padding_share']:.1%} padding, " in line
    assert "of documents split or cut; in 50 rows spread over the split: 1.00 documents a row, " in line
    whole = packing_statistics(documents, rows, 16)
    assert whole["rows_sampled"] == whole["rows"] and "spread over" not in describe_packing(
        "pad", {**whole, "rows_left_out_each_epoch": 0}
    )


def test_a_packing_that_is_not_known_is_refused():
    with pytest.raises(ValueError, match="packing must be one of concat, pad, bestfit"):
        PackedBatches(stream_of([5] * 40), EOT, 8, 2, "greedy")


def test_the_row_order_is_the_documented_seeded_permutation_and_each_process_takes_its_own_rows():
    """Pinned against the rule written out by hand, not against a second loader."""
    stream = stream_of(np.random.default_rng(2).integers(2, 40, 300).tolist())
    n_rows = len(concat_rows(Documents(stream, EOT), 16))
    for rank in range(2):
        batches = PackedBatches(stream, EOT, 16, 4, seed=11, rank=rank, world_size=2)
        per_epoch = n_rows // 8
        for epoch in range(2):
            order = np.random.default_rng([11, epoch]).permutation(n_rows)
            for step in range(per_epoch):
                rows = order[step * 8 + rank * 4 : step * 8 + rank * 4 + 4]
                expected = [stream[r * 16 : r * 16 + 16].tolist() for r in rows]
                assert batches.next().inputs.tolist() == expected


@pytest.mark.parametrize("extra", [0, 1, 15, 16, 17])
def test_concat_rows_at_the_edge_of_the_stream(extra):
    # a stream of 4T + extra tokens: a row needs T + 1 of them, so a stream of exactly kT + 1 has k rows
    T = 16
    stream = np.full(4 * T + extra, 5, dtype=np.uint16)
    stream[-1] = EOT
    rows = concat_rows(Documents(stream, EOT), T)
    assert len(rows) == (len(stream) - 1) // T
    assert rows.start[-1] + T + 1 <= len(stream)


def test_the_evaluation_subset_is_the_whole_documents_that_fit_exactly():
    from shards import leading_documents

    stream = stream_of([3, 4, 5])  # documents end at 3, 7 and 12
    assert len(leading_documents(stream, EOT, 7)) == 7  # the second ends exactly at the budget: kept
    assert len(leading_documents(stream, EOT, 6)) == 3  # one token short: left out
    assert len(leading_documents(stream, EOT, 2)) == 3  # at least the first document
    assert len(leading_documents(stream, EOT, 0)) == len(leading_documents(stream, EOT, 99)) == 12


def test_each_epoch_leaves_out_its_last_partial_global_batch_and_the_statistics_say_how_many():
    eot = 9
    stream = np.array([1, 2, eot] * 40)  # 120 tokens: 14 concat rows of 8 + 1
    for world_size, batch_size, left_out in ((1, 4, 2), (2, 2, 2), (3, 1, 2), (1, 7, 0)):
        batches = PackedBatches(stream, eot, 8, batch_size, world_size=world_size, seed=3)
        assert len(batches) == 14
        for _ in range(14 // (batch_size * world_size)):
            batches.next()
        assert batches.epoch == 0
        batches.next()
        assert (batches.epoch, batches.cursor) == (1, batch_size * world_size)  # the remainder was never served
        stats = batches_statistics(batches)
        assert stats["rows_left_out_each_epoch"] == left_out
        said = f"{left_out} rows left out of each epoch" if left_out else "left out of each epoch"
        assert (said in describe_packing("concat", stats)) == (left_out > 0)
    one_left = batches_statistics(PackedBatches(stream, eot, 8, 13, seed=3))
    assert "; 1 row left out of each epoch" in describe_packing("concat", one_left)
    assert batches_statistics(PackedBatches(stream, eot, 8, 4, shuffle=False))["rows_left_out_each_epoch"] == 0


FLAG_NAMES = ("doc_mask", "reset_position_ids", "mask_boundary_loss")
EVERY_FLAG_SETTING = [Flags(**dict(zip(FLAG_NAMES, on))) for on in itertools.product([True, False], repeat=3)]


@pytest.mark.parametrize("bos_id", [None, BOS])
@pytest.mark.parametrize("flags", EVERY_FLAG_SETTING)
def test_no_stream_token_is_a_counted_target_twice_under_any_flags(bos_id, flags):
    """Token by token: each counted target of every row, traced back to its place in the stream."""
    T = 16
    lengths = np.random.default_rng(3).integers(2, 3 * T, 60).tolist() + [T, T + 1, T + 2, 2 * T + 1]
    stream = stream_of(lengths, 3)
    for packing in PACKINGS:
        batches = PackedBatches(stream, EOT, T, 4, packing, flags=flags, bos_id=bos_id, shuffle=False)
        index, _ = batches.rows.index(np.arange(len(batches.rows)), T + 1)
        counted = batches.batch(np.arange(len(batches.rows))).counted.numpy()
        targets = index[:, 1:][counted]
        assert len(np.unique(targets)) == len(targets), packing


def row_pieces(rows) -> list[tuple[int, int]]:
    """(first, end) of each row's pieces in rows.start and rows.length."""
    bounds = rows.offsets.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def test_bestfit_row_order_and_piece_order_are_pinned():
    # T = 8 (rows of 9). Documents (EOT included) of 4, 20, 9, 3, 12, 5, 2, 6 and 3 tokens; the 20 is chunks
    # 4-12, 12-20 and 20-23, the 12 is chunks 36-44 and 44-47. First the full chunks, a row each, in stream
    # order; then the last chunks, longest first (ties in stream order), each opening a row; then the whole
    # documents, longest first: 6 opens row 6, 5 fills row 5 (of the two rows with room 5, the one last put
    # there), 4 goes to row 4, 3 fills row 6, the next 3 opens row 7, where 2 goes too. In a row: its last
    # chunk first, then the documents in the order they were placed.
    lengths = [4, 20, 9, 3, 12, 5, 2, 6, 3]
    rows = PACKINGS["bestfit"](Documents(stream_of(lengths), EOT), 8)
    held = [list(zip(rows.start[a:b].tolist(), rows.length[a:b].tolist())) for a, b in row_pieces(rows)]
    assert held == [
        [(4, 9)],
        [(12, 9)],
        [(24, 9)],
        [(36, 9)],
        [(20, 4), (0, 4)],
        [(44, 4), (48, 5)],
        [(55, 6), (33, 3)],
        [(61, 3), (53, 2)],
    ]
    batches = PackedBatches(stream_of(lengths), EOT, 8, 2, "bestfit", shuffle=False)
    first_documents = batches.documents.document_of(batches.rows.start[batches.rows.offsets[:-1]])
    assert first_documents.tolist() == [1, 1, 2, 4, 1, 4, 7, 8]  # the document each row starts in


@pytest.mark.parametrize(
    "sizes, capacity, alone, rows",
    [
        ([], 10, 0, []),
        ([3], 10, 0, [0]),
        ([3], 10, 1, [0]),
        ([10, 10, 10], 10, 0, [0, 1, 2]),  # items of exactly the capacity: a row each
        ([10, 10, 1], 10, 0, [0, 1, 2]),  # a full row takes nothing more
        ([5, 4, 3, 2, 1], 10, 2, [0, 1, 0, 0, 1]),  # 5 and 4 open rows of their own; 3 then fits row 0 best
        ([6, 5, 4, 1], 10, 2, [0, 1, 0, 1]),  # the 4 fills row 0 (room 4), not row 1 (room 5)
        ([6, 5, 4, 1], 10, 0, [0, 1, 0, 1]),
        ([5, 5, 5, 5], 10, 4, [0, 1, 2, 3]),  # `alone` opens a row each even where one would fit
        ([5, 5, 5, 5], 10, 0, [0, 0, 1, 1]),
    ],
)
def test_best_fit_decreasing_at_the_edges(sizes, capacity, alone, rows):
    assert best_fit_decreasing(sizes, capacity, alone=alone).tolist() == rows
    assert best_fit_decreasing(sizes, capacity, alone=alone).dtype == np.int64


def test_concat_keeps_the_tail_for_evaluation_and_the_last_batch_is_filled_with_empty_rows():
    stream = stream_of([5] * 6)  # 30 tokens, T = 8: 3 full rows, the last (30 - 1) mod 8 = 5 tokens in none
    assert len(PackedBatches(stream, EOT, 8, 3, shuffle=False)) == 3
    batches = PackedBatches(stream, EOT, 8, 3, shuffle=False, keep_tail=True)
    assert batches.rows.start.tolist() == [0, 8, 16, 24] and batches.rows.length.tolist() == [9, 9, 9, 6]
    first, last = batches.all_batches()
    assert first.inputs.tolist() == [stream[r : r + 8].tolist() for r in (0, 8, 16)]
    assert last.inputs[0].tolist() == stream[24:].tolist() + [EOT] * 2  # the tail, padded with EOT
    # slot 24 is the fifth document's EOT: the target predicted from it is ignored, and so is padding
    assert last.targets[0].tolist() == [IGNORE_INDEX] + stream[26:].tolist() + [IGNORE_INDEX] * 3
    assert (last.inputs[1:] == EOT).all() and not last.counted[1:].any()  # two empty rows
    assert last.doc_ids[1].tolist() == list(range(8)) and (last.position_ids[1:] == 0).all()
    assert last.doc_positions[1:].eq(0).all()


@pytest.mark.parametrize("bos_id", [None, BOS])
def test_a_stream_cut_inside_its_last_document_ends_with_that_document(bos_id):
    stream = np.array([1, 2, EOT, 3, 4], dtype=np.uint16)  # no EOT at the end: a probe's or a test's array
    docs = Documents(stream, EOT, bos_id)
    bos = 1 if bos_id else 0  # tokens a document gains from the marker
    assert docs.starts.tolist() == [0, 3 + bos] and docs.lengths.tolist() == [3 + bos, 2 + bos]
    assert docs.n_tokens == 5 + 2 * bos
    by_hand = with_markers_by_hand(stream) if bos_id else stream.tolist()
    assert docs.tokens(np.arange(docs.n_tokens)).tolist() == by_hand
    assert len(Documents(np.zeros(0, dtype=np.uint16), EOT, bos_id)) == 0
