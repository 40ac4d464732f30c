"""Data-parallel training through torchrun (gloo on CPU): 2 processes with batch B match 1 process with
batch B and twice the gradient accumulation, since both see the same rows in each step and normalise
the loss by the same counted targets."""

import json
import subprocess
import sys

import pytest
import torch.distributed as dist
from conftest import ROOT, tiny_args

pytestmark = [  # every test here starts processes
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]


def losses(out_dir) -> list[tuple]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("train_loss"), r.get("val_loss"), r.get("val_doc_loss")) for r in rows]


def test_two_processes_match_one_with_doubled_accumulation(tiny_corpus, tmp_path):
    common = dict(max_iters=6, eval_interval=3, batch_size=4, eval_tokens=512)
    one = tmp_path / "one"
    single = subprocess.run(
        [sys.executable, "train.py", *tiny_args(tiny_corpus, tmp_path / "data", one, grad_accum=2, **common)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr
    two = tmp_path / "two"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    ddp = subprocess.run(
        [*torchrun, "train.py", *tiny_args(tiny_corpus, tmp_path / "data", two, grad_accum=1, **common)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "2 processes" in ddp.stdout and ddp.stdout.count("model:") == 1  # only process 0 prints
    expected, got = losses(one), losses(two)
    assert [r[0] for r in got] == [r[0] for r in expected]
    for e, g in zip(expected, got):
        for a, b in zip(e[1:], g[1:]):
            assert (a is None and b is None) or abs(a - b) < 2e-4, (e, g)


WORKER = """
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from test_distributed import gradient_setup
import train
dist.init_process_group("gloo")
rank = dist.get_rank()
model, micro_batches = gradient_setup()
ddp = DistributedDataParallel(model, broadcast_buffers=False)
mine = micro_batches[rank::2]  # each process its own micro-batches
loss = train.accumulate_gradients(ddp, mine, torch.autocast("cpu", enabled=False), model.config)
torch.save({{"loss": loss, "grads": [p.grad for p in model.parameters()]}}, {out!r} + f"/grads{{rank}}.pt")
dist.destroy_process_group()
"""


def gradient_setup():
    """A small model and four micro-batches whose counted targets differ a lot (short and long documents)."""
    import numpy as np
    import torch

    from data import batch_of_rows
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, n_embd=16))
    rng = np.random.default_rng(0)
    rows = []
    for n in (3, 16, 5, 12):  # real tokens of each micro-batch's rows: the rest is padding
        rows.append([np.append(rng.integers(0, 63, n - 1), 63) for _ in range(2)])
    return model, [batch_of_rows(r, 16, 63) for r in rows]


def test_two_processes_give_the_gradient_of_one_process_over_all_their_rows(tmp_path):
    """Pinned against the single-process gradient of the summed loss over every counted target, divided by
    their number: a constant factor (which Adam's update would hide) fails here."""
    import torch

    import train

    worker = tmp_path / "worker.py"
    worker.write_text(WORKER.format(root=str(ROOT), tests=str(ROOT / "tests"), out=str(tmp_path)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    result = subprocess.run(torchrun, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    model, micro_batches = gradient_setup()
    total = sum(train.token_losses(model, b, model.config)[0].sum() for b in micro_batches)
    counted = sum(b.counted.sum() for b in micro_batches)
    (total / counted).backward()
    for rank in range(2):
        got = torch.load(tmp_path / f"grads{rank}.pt")
        assert torch.allclose(got["loss"], total / counted, rtol=1e-5)
        for g, p in zip(got["grads"], model.parameters()):
            assert torch.allclose(g, p.grad, rtol=1e-4, atol=1e-7)
