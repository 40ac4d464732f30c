"""Generate text from a checkpoint written by train.py.

python sample.py                                  # out/ckpt.pt, prompt "def "
python sample.py --out_dir=out --prompt="class " --num_samples=3 --max_new_tokens=200

The checkpoint holds its tokenizer, so a run folder works from any working folder and on another machine.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

import run_folder
from config import MAX_SEED, ArgumentParser, ConfigError, expanded_path, resolve_device, run_main
from data import DataError, decoded, document_opening


def main(argv: list[str]) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out_dir", default="out", type=expanded_path, help="the training run's folder (holds ckpt.pt)"
    )
    parser.add_argument(
        "--prompt", default="def ", help="text the samples continue; each starts a new document (after its BOS)"
    )
    parser.add_argument("--num_samples", type=int, default=1, help="how many samples to print")
    parser.add_argument("--max_new_tokens", type=int, default=200, help="stop after this many tokens (or at EOT)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy; higher is more random")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    args = parser.parse_args(argv)
    for name, minimum in (("num_samples", 1), ("max_new_tokens", 0), ("top_k", 0), ("seed", 0)):
        if getattr(args, name) < minimum:
            parser.error(f"--{name}={getattr(args, name)}: must be at least {minimum}")
    if args.seed > MAX_SEED:
        parser.error(f"--seed={args.seed}: must be at most {MAX_SEED}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature={args.temperature}: must be a finite number, at least 0")

    try:
        device = resolve_device(args.device)
        model, enc, state = run_folder.load_run(Path(args.out_dir), device, attn_impl="sdpa")  # one document: no mask
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    prompt = torch.tensor([document_opening(enc, args.prompt)], dtype=torch.long, device=device)
    if prompt.shape[1] == 0:
        print("error: the prompt is empty, and this run has no start marker (bos) to start from", file=sys.stderr)
        return 1
    torch.manual_seed(args.seed)
    for i in range(args.num_samples):
        out = model.generate(
            prompt, args.max_new_tokens, args.temperature, args.top_k or None, stop_token=enc.eot_token
        )
        text = decoded(enc, out[0].tolist())
        print(f"--- sample {i + 1} (step {state['step']})\n{text}")
    return 0


if __name__ == "__main__":
    run_main(main)
