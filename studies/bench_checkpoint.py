"""What verifying checkpoints costs: a checkpoint of GPT-2 small's shape (the model and its AdamW state)
written and read back the way train.py does, with the digest timed on its own.

    python -m studies.bench_checkpoint                     # 12 layers, 768 wide, vocabulary 50304
    python -m studies.bench_checkpoint --n_layer=4 --n_embd=128 --vocab_size=8192

Every save computes the digest of the checkpoint's content and every read computes it again
(run_folder.content_digest): this prints both, beside the time of torch.save and torch.load themselves.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path

import torch


def main(argv: list[str]) -> int:
    import run_folder
    from config import ArgumentParser
    from model import GPT, GPTConfig

    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--n_layer", type=int, default=12)
    parser.add_argument("--n_embd", type=int, default=768)
    parser.add_argument("--n_head", type=int, default=12)
    parser.add_argument("--vocab_size", type=int, default=50304)
    parser.add_argument("--seq_len", type=int, default=1024)
    args = parser.parse_args(argv)
    if min(args.n_layer, args.n_embd, args.n_head, args.vocab_size, args.seq_len) < 1:
        parser.error("every size must be at least 1")
    if args.n_embd % args.n_head or (args.n_embd // args.n_head) % 2:
        parser.error(f"--n_embd={args.n_embd} must split into --n_head={args.n_head} heads of even size")
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
    run_folder.content_digest(state)
    times["digest"] = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(dir=".") as folder:
        path = Path(folder) / "ckpt.pt"
        t0 = time.perf_counter()
        run_folder.save_checkpoint(path, state)
        times["save (digest included)"] = time.perf_counter() - t0
        size = path.stat().st_size
        t0 = time.perf_counter()
        torch.load(path, map_location="cpu", weights_only=False)
        times["torch.load alone"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        run_folder.read_checkpoint(path)
        times["read_checkpoint (torch.load, then the digest)"] = time.perf_counter() - t0
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"checkpoint: {model.num_params() / 1e6:.1f}M parameters with AdamW state, {size / 1e9:.2f} GB")
    for name, seconds in times.items():
        print(f"  {name}: {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    from config import run_main

    run_main(main)
