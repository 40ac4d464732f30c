"""Data-parallel training through torchrun (gloo on CPU): 2 processes with batch B match 1 process with
batch B and twice the gradient accumulation, since both see the same rows in each step and normalise
the loss by the same counted targets. The tests marked slow start processes; the fast one runs the ranks
as threads of this process, with a stand-in for torch.distributed."""

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, tiny_args

import train

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def losses(out_dir) -> list[tuple]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("train_loss"), r.get("val_loss"), r.get("val_doc_loss")) for r in rows]


@pytest.mark.slow
@needs_gloo
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
    ours = [line for line in ddp.stderr.splitlines() if "Warning:" in line and str(ROOT) in line]
    assert not ours, ours  # no deprecated call of ours (torch's own warnings are torch's)
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
loss = train.accumulate_gradients(ddp, mine, torch.autocast("cpu", enabled=False), model.config, True)
torch.save({{"loss": loss, "grads": [p.grad for p in model.parameters()]}}, {out!r} + f"/grads{{rank}}.pt")
dist.destroy_process_group()
"""


def gradient_setup():
    """A small model and four micro-batches whose counted targets differ a lot (short and long documents)."""
    import numpy as np
    import torch

    from model import GPT, GPTConfig
    from studies.scoring import batch_of_rows

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, n_embd=16))
    rng = np.random.default_rng(0)
    rows = []
    for n in (3, 16, 5, 12):  # real tokens of each micro-batch's rows: the rest is padding
        rows.append([np.append(rng.integers(0, 63, n - 1), 63) for _ in range(2)])
    return model, [batch_of_rows(r, 16, 63) for r in rows]


@pytest.mark.slow
@needs_gloo
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
    total = sum(train.token_losses(model, b, model.config, doc_mask=True)[0].sum() for b in micro_batches)
    counted = sum(b.counted.sum() for b in micro_batches)
    (total / counted).backward()
    for rank in range(2):
        got = torch.load(tmp_path / f"grads{rank}.pt")
        assert torch.allclose(got["loss"], total / counted, rtol=1e-5)
        for g, p in zip(got["grads"], model.parameters()):
            assert torch.allclose(g, p.grad, rtol=1e-4, atol=1e-7)


class SimulatedRanks:
    """torch.distributed as accumulate_gradients uses it, for ranks run as threads of this process: all_reduce
    sums a tensor over the ranks, as gloo's default op does. DDP's own part, the average of the gradients at
    the last backward, the test does by hand."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=60)  # a rank that fails frees the others
        self.contributions: list[torch.Tensor | None] = [None] * world_size
        self.this_thread = threading.local()  # .rank: which rank the calling thread is

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self) -> int:
        return self.world_size

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.contributions[self.this_thread.rank] = tensor.clone()
        self.barrier.wait()
        total = sum(self.contributions)  # in rank order on every rank: the same bits everywhere
        self.barrier.wait()  # every rank has read the contributions before any writes its next one
        tensor.copy_(total)


def test_simulated_ranks_give_the_gradient_of_one_process_with_doubled_accumulation(monkeypatch):
    """The fast guard of the test above: two ranks of two micro-batches each, whose counted targets differ a
    lot, against one process accumulating all four. Each rank's loss is a global mean, scaled by the world
    size because DDP averages the ranks' gradients: without that factor the gradient is halved (Adam's
    update would hide it), and without the all_reduce of the counted targets each rank divides by its own."""
    ranks = SimulatedRanks(world_size=2)
    replicas = [gradient_setup() for _ in range(ranks.world_size)]  # the same init on every rank
    fp32 = torch.autocast("cpu", enabled=False)
    step = replicas[0][1]  # the step's four micro-batches
    counted = [sum(b.counted.sum() for b in step[rank :: ranks.world_size]) for rank in range(ranks.world_size)]
    assert counted[0] * 3 < counted[1]  # a rank's own count is far from the step's: dividing by it would show

    def run_rank(rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ranks.this_thread.rank = rank
        model, micro_batches = replicas[rank]
        model.no_sync = nullcontext  # DDP's skips the gradient all-reduce of earlier micro-batches: none here
        loss = train.accumulate_gradients(model, micro_batches[rank :: ranks.world_size], fp32, model.config, True)
        return loss, [p.grad for p in model.parameters()]

    monkeypatch.setattr(train, "dist", ranks)
    with ThreadPoolExecutor(max_workers=ranks.world_size) as pool:
        outcomes = list(pool.map(run_rank, range(ranks.world_size)))  # re-raises what a rank raised
    monkeypatch.undo()  # one process, no process group
    model, micro_batches = gradient_setup()
    one_process_loss = train.accumulate_gradients(model, micro_batches, fp32, model.config, True)
    for loss, _ in outcomes:
        assert torch.allclose(loss, one_process_loss, rtol=1e-5)
    averaged = [sum(grads) / ranks.world_size for grads in zip(*(grads for _, grads in outcomes))]  # DDP's average
    for got, p in zip(averaged, model.parameters()):
        assert torch.allclose(got, p.grad, rtol=1e-4, atol=1e-7)
