"""What verifying checkpoints costs: a checkpoint of GPT-2 small's shape (the model and its AdamW state)
written and read back the way train.py does, with the digest timed on its own.

    python -m studies.bench_checkpoint                     # 12 layers, 768 wide, vocabulary 50304
    python -m studies.bench_checkpoint --n_layer=4 --n_embd=128 --vocab_size=8192

Every save computes the digest of the checkpoint's content and every read computes it again
(checkpoints.content_digest): this prints both, beside the time of torch.save and torch.load themselves.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from config import script_settings, setting


@dataclass
class CheckpointBenchSettings:
    n_layer: int = setting(12, "transformer blocks", minimum=1)
    n_embd: int = setting(768, "model width", minimum=2)
    n_head: int = setting(12, "attention heads", minimum=1)
    vocab_size: int = setting(50304, "vocabulary", minimum=1)
    seq_len: int = setting(1024, "positions (learned position table)", minimum=1)


def main(argv: list[str]) -> int:
    import checkpoints
    from model import GPT, GPTConfig

    args = script_settings(CheckpointBenchSettings, argv, __doc__, "python -m studies.bench_checkpoint")
    if args.n_embd % args.n_head or (args.n_embd // args.n_head) % 2:
        print(f"error: n_embd={args.n_embd} must split into n_head={args.n_head} heads of even size", file=sys.stderr)
        return 2
    config = GPTConfig(args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.n_embd)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.zeros(1, 8, dtype=torch.long)
    model(ids, torch.arange(8)[None], None, ids).sum().backward()
    optimizer.step()  # the AdamW state exists: two more tensors for every parameter
    small = {"config": {}, "model_config": {}, "data": {}, "rng": [], "tokenizer_sha256": ""}  # as train.py's
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1, **small}
    times = {}
    t0 = time.perf_counter()
    checkpoints.content_digest(state)
    times["digest"] = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(dir=".") as folder:
        path = Path(folder) / "ckpt.pt"
        t0 = time.perf_counter()
        checkpoints.save_checkpoint(path, state)
        times["save (digest included)"] = time.perf_counter() - t0
        size = path.stat().st_size
        t0 = time.perf_counter()
        torch.load(path, map_location="cpu", weights_only=False)
        times["torch.load alone"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        checkpoints.read_checkpoint(path)
        times["read_checkpoint (torch.load, then the digest)"] = time.perf_counter() - t0
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"checkpoint: {model.num_params() / 1e6:.1f}M parameters with AdamW state, {size / 1e9:.2f} GB")
    for name, seconds in times.items():
        print(f"  {name}: {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    from config import run_main

    run_main(main)
