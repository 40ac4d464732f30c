import json
import random
from pathlib import Path

import pytest

from data import IGNORE_INDEX
from run.checkpoint import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]

WORDS = (
    "def class return self value items for in if else while import from yield lambda None True False "
    "data list dict key append result print range len open read write"
).split()


def make_documents(n: int, seed: int = 0) -> list[str]:
    """Small synthetic documents with learnable structure (a header line, then indented lines)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [f"def f{i % 50}({rng.choice(WORDS)}):"]
        for _ in range(rng.randint(1, 12)):
            lines.append("    " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))))
        docs.append("\n".join(lines) + "\n")
    return docs


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """A .jsonl corpus of 600 short documents."""
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_documents(600)))
    return path


def tiny_args(corpus: Path, data_dir: Path, out_dir: Path, **overrides) -> list[str]:
    """train.py arguments for a run that takes a few seconds on a CPU."""
    settings = dict(
        dataset=corpus,
        data_dir=data_dir,
        out_dir=out_dir,
        tokenizer_vocab_size=320,
        seq_len=64,
        n_layer=2,
        n_head=2,
        n_embd=32,
        batch_size=4,
        max_iters=6,
        eval_interval=3,
        log_interval=1,
        warmup_iters=2,
        eval_tokens=1024,
        sample_tokens=0,
    )
    settings.update(overrides)
    return [f"--{k}={v}" for k, v in settings.items()]


def reference_semantics(x: list[int], y: list[int], eot: int) -> tuple[list[int], list[int], list[int]]:
    """The spec, one token at a time: doc ids, reset positions, loss-masked targets."""
    doc, pos, masked = [], [], []
    current_doc, current_pos = 0, 0
    for t, token in enumerate(x):
        doc.append(current_doc)
        pos.append(current_pos)
        masked.append(IGNORE_INDEX if token == eot else y[t])
        if token == eot:
            current_doc, current_pos = current_doc + 1, 0
        else:
            current_pos += 1
    return doc, pos, masked


def rewrite_checkpoint(path: Path, change, to: Path | None = None) -> None:
    """A checkpoint with `change(state)` applied and saved anew, its CRC-32s with it: a deliberate edit, which
    reads as a valid checkpoint (a byte changed in the file without new CRC-32s is refused as damage)."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    state.pop("content_sha256", None)
    change(state)
    save_checkpoint(to or path, state)
