"""Generate text from a checkpoint written by train.py.

python sample.py                                  # out/ckpt.pt, prompt "def "
python sample.py --out_dir=out --prompt="class " --num_samples=3 --max_new_tokens=200

The checkpoint holds its tokenizer, so a run folder works from any working folder and on another machine.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

import tiktoken
import torch

from cli import run_main, script_settings
from config import MAX_SEED, resolve_device, setting
from errors import ConfigError, DataError
from model import GPT, GPTConfig
from run.checkpoint import read_checkpoint
from shards import decoded, document_opening, read_tiktoken, with_start_marker


@dataclass
class SampleSettings:
    out_dir: str = setting("out", "the training run's folder (holds ckpt.pt)", path=True)
    prompt: str = setting("def ", "text the samples continue; each starts a new document (after its BOS)")
    num_samples: int = setting(1, "how many samples to print", minimum=1)
    max_new_tokens: int = setting(200, "stop after this many tokens (or at EOT)", minimum=0)
    temperature: float = setting(0.8, "0 is greedy; higher is more random", minimum=0.0)
    top_k: int = setting(50, "sample among the k most likely tokens (0: all)", minimum=0)
    seed: int = setting(0, "random seed of the sampling", minimum=0, maximum=MAX_SEED)
    device: str = setting("cpu", "cpu, cuda or cuda:N")


def trained_model(state: dict, device: torch.device, attn_impl: str | None = None) -> GPT:
    """The model of a checkpoint, in eval mode; attn_impl overrides the attention it trained with."""
    known = {f.name for f in fields(GPTConfig)}  # earlier checkpoints held doc_mask and flex_kernel_options here
    saved = {k: v for k, v in state["model_config"].items() if k in known}
    model = GPT(GPTConfig(**{**saved, "attn_impl": attn_impl or saved.get("attn_impl", "auto")}))
    model.load_state_dict(state["model"])
    return model.to(device).eval()


def checkpoint_tokenizer(state: dict) -> tiktoken.Encoding:
    """The tokenizer a checkpoint was trained with, stored in it so a run folder stands alone."""
    tok = state["tokenizer"]
    enc = read_tiktoken(tok["file"], tok["pattern"], tok["name"], "the checkpoint's tokenizer", tok.get("eot_id"))
    return with_start_marker(enc, tok.get("bos_id"))


class TrainedRun(NamedTuple):
    model: GPT
    tokenizer: tiktoken.Encoding
    checkpoint: dict


def load_run(out_dir: Path, device: torch.device, attn_impl: str | None = None) -> TrainedRun:
    """The trained model of a run folder (in eval mode), its tokenizer and its checkpoint."""
    state = read_checkpoint(Path(out_dir) / "ckpt.pt")
    return TrainedRun(trained_model(state, device, attn_impl), checkpoint_tokenizer(state), state)


def main(argv: list[str]) -> int:
    args = script_settings(SampleSettings, argv, __doc__, "python sample.py")
    try:
        device = resolve_device(args.device)
        model, enc, state = load_run(Path(args.out_dir), device, attn_impl="sdpa")  # one document: no mask
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
