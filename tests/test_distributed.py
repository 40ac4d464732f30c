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
