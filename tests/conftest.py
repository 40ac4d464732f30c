import dataclasses
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train
from cli import parse_config
from config import Config
from data import IGNORE_INDEX
from resolve import resolve
from run import checkpoint as checkpoints
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


def pytest_collection_modifyitems(items):
    """The tests that report the cases tried run last, after every test that counts them."""
    items.sort(key=lambda item: item.name == "test_report_the_cases_tried")


# ---- fault cases tried, counted across files (python -m pytest -s prints them at the end)

FAULT_CASES: dict[str, int] = {}


def tried(kind: str, n: int = 1) -> None:
    FAULT_CASES[kind] = FAULT_CASES.get(kind, 0) + n


# ---- helpers of the tests that run the scripts and check what they leave


def jsonl_bytes(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def python(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kwargs)


def one_line(result: subprocess.CompletedProcess, prefix: str = "error:") -> str:
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix) and result.returncode != 0, result.stderr[-2000:]
    return lines[0]


def complete_folders(data_dir: Path) -> list[Path]:
    return [p for p in data_dir.iterdir() if (p / "meta.json").exists()] if data_dir.exists() else []


def run_cli(*args: str, cwd=ROOT, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300, **kw)


def in_process(main, argv: list[str], capsys) -> subprocess.CompletedProcess:
    """A script's main called here, as run_cli would run it (the same exit code and stderr), without the
    seconds of starting Python and importing torch."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return subprocess.CompletedProcess(argv, code, "", capsys.readouterr().err)


def one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error:") and sum(line.startswith("error:") for line in lines) == 1, result.stderr
    assert all(f in lines[-1] for f in fragments), (fragments, lines[-1])


# ---- finished and stopped runs the tests start from


def records(out_dir):
    """metrics.jsonl without the wall-clock rates, which differ between runs."""
    lines = (out_dir / "metrics.jsonl").read_text().split("\n")[:-1]  # a last line with no newline is being written
    return [{k: v for k, v in json.loads(line).items() if "per_sec" not in k} for line in lines]


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for_step(out_dir, step: int, proc: subprocess.Popen) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        done = [r["step"] for r in records(out_dir)] if (out_dir / "metrics.jsonl").exists() else []
        if done and done[-1] >= step and (out_dir / "ckpt.pt").exists():
            return
        time.sleep(0.005)
    raise AssertionError(f"run ended or stalled before step {step}")


@pytest.fixture(scope="session")  # built once for every file that uses it
def long_args(tiny_corpus, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("data")
    reference = tmp_path_factory.mktemp("reference")

    def args(out_dir):  # 40 steps, a checkpoint every 3, dropout so that the RNG state matters
        return tiny_args(tiny_corpus, data_dir, out_dir, max_iters=40, eval_interval=3, dropout=0.1, eval_tokens=256)

    train.train(resolve(parse_config(args(reference))))
    return args, records(reference)


@pytest.fixture(scope="session")  # built once for every file that uses it
def reference_run(tiny_corpus, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("data")

    def args(out_dir, **overrides):
        return tiny_args(tiny_corpus, data_dir, out_dir, **{"max_iters": 12, "eval_interval": 3, **overrides})

    reference = tmp_path_factory.mktemp("reference")
    train.train(resolve(parse_config(args(reference))))
    return args, records(reference)


@pytest.fixture(scope="session")  # built once for every file that uses it
def trained(tiny_corpus, tmp_path_factory) -> tuple[Path, list[str]]:
    """A finished run of 4 steps with checkpoints at 2 and 4, and the arguments that made it."""
    tmp = tmp_path_factory.mktemp("trained")
    args = tiny_args(tiny_corpus, tmp / "data", tmp / "run", max_iters=4, eval_interval=2)
    train.train(resolve(parse_config(args)))
    return tmp / "run", args


def copy_of(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def hand_built_checkpoint(cfg: Config) -> dict:
    """What Checkpointer.save writes, without training: one weight large enough to be the file's largest
    member (the one flip_byte_in_weights changes), the settings of `cfg`, one process's RNG, and shards
    that do not exist (a resumed run that got past the checks would stop there, in one line)."""
    generator = torch.Generator().manual_seed(0)
    return {
        "model": {"weight": torch.randn(64, 64, generator=generator)},
        "optimizer": {"state": {}, "param_groups": []},
        "config": dataclasses.asdict(cfg),
        "model_config": {},
        "step": 2,
        "data": {"epoch": 0, "cursor": 0},
        "rng": [checkpoints.rng_states()],
        "tokenizer_sha256": "0" * 64,
        "run_id": "hand-built",
        "shards": "/nonexistent/shards",
    }
