"""Each ablation flag, switched off alone, changes exactly what it should and nothing else."""

import dataclasses

import numpy as np
import torch

from data import IGNORE_INDEX, Flags
from model import GPT, GPTConfig, attention_mask
from studies.scoring import batch_of_rows

EOT = 63
T = 24
STREAM = np.array([5, 6, 7, EOT, 8, 9, EOT, 10, 11, 12, 13, EOT] * 3, dtype=np.uint16)


def batch(**flags: bool):
    return batch_of_rows([STREAM[0 : T + 1], STREAM[5 : T + 6]], T, EOT, flags=Flags(**flags))


def test_reset_position_ids_off_changes_only_the_position_ids():
    on, off = batch(), batch(reset_position_ids=False)
    assert torch.equal(off.position_ids, torch.arange(T).expand(2, T))
    assert not torch.equal(on.position_ids, off.position_ids)
    for name in ("inputs", "targets", "doc_ids", "doc_positions"):
        assert torch.equal(getattr(on, name), getattr(off, name)), name


def test_mask_boundary_loss_off_changes_only_the_targets_after_eot():
    on, off = batch(), batch(mask_boundary_loss=False)
    after_eot = on.inputs == EOT
    assert (on.targets[after_eot] == IGNORE_INDEX).all()
    assert (off.targets[after_eot] != IGNORE_INDEX).all()  # the next document's first token now counts
    assert torch.equal(on.targets[~after_eot], off.targets[~after_eot])
    assert (on.targets == EOT).sum() == (off.targets == EOT).sum() > 0  # predicting EOT counts either way
    for name in ("inputs", "doc_ids", "position_ids", "doc_positions"):
        assert torch.equal(getattr(on, name), getattr(off, name)), name


def test_doc_mask_off_changes_nothing_of_the_batch():
    """Its whole effect is model.attention_mask (the next test): the batch does not carry it."""
    on, off = batch(), batch(doc_mask=False)
    assert [f.name for f in dataclasses.fields(on)] == list(on.TENSORS)
    for name in on.TENSORS:
        assert torch.equal(getattr(on, name), getattr(off, name)), name


def test_doc_mask_off_changes_only_what_later_documents_see():
    b = batch()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=T, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        masked = model(b.inputs, b.position_ids, attention_mask(b.doc_ids, doc_mask=True))
        causal = model(b.inputs, b.position_ids, attention_mask(b.doc_ids, doc_mask=False))
    first_doc = b.doc_ids == 0
    assert torch.allclose(masked[first_doc], causal[first_doc], atol=1e-6)  # nothing earlier to see
    assert not torch.allclose(masked[~first_doc], causal[~first_doc], atol=1e-3)
