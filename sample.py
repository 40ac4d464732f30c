"""Generate text from a checkpoint written by train.py.

python sample.py                                  # out/ckpt.pt, prompt "def "
python sample.py --out_dir=out --prompt="class " --num_samples=3 --max_new_tokens=200
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import data
from model import GPT, GPTConfig


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="out", help="the training run's folder (holds ckpt.pt)")
    parser.add_argument("--prompt", default="def ", help="text the samples continue; each starts a new document")
    parser.add_argument("--num_samples", type=int, default=1, help="how many samples to print")
    parser.add_argument("--max_new_tokens", type=int, default=200, help="stop after this many tokens (or at EOT)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy; higher is more random")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    args = parser.parse_args(argv)

    ckpt_path = Path(args.out_dir) / "ckpt.pt"
    if not ckpt_path.is_file():
        print(
            f"error: {ckpt_path} not found; train first with: python train.py --out_dir={args.out_dir}", file=sys.stderr
        )
        return 1
    state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    shard_path = Path(state["shards"])
    if not (shard_path / "tokenizer.tiktoken").is_file():
        print(
            f"error: the run's tokenizer {shard_path}/tokenizer.tiktoken is missing; prepare its data again",
            file=sys.stderr,
        )
        return 1
    enc = data.load_tokenizer(shard_path)
    model = GPT(GPTConfig(**{**state["model_config"], "attn_impl": "sdpa"}))
    model.load_state_dict(state["model"])
    model.to(args.device).eval()

    torch.manual_seed(args.seed)
    prompt = torch.tensor([enc.encode_ordinary(args.prompt)], device=args.device)
    if prompt.shape[1] == 0:
        print("error: the prompt is empty", file=sys.stderr)
        return 1
    for i in range(args.num_samples):
        out = model.generate(
            prompt, args.max_new_tokens, args.temperature, args.top_k or None, stop_token=enc.eot_token
        )
        text = enc.decode([t for t in out[0].tolist() if t < enc.eot_token])
        print(f"--- sample {i + 1} (step {state['step']})\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
