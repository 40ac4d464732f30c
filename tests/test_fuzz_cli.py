"""Fuzzing the command lines: train.py, sample.py, studies.ablate and bench.attention, each given adversarial values
(empty, nan, inf, negative, huge, unicode, a folder, a file, a missing path) for one to three of its
keys on top of a tiny, valid base. Every outcome must be either exit 0 with a working result, or a
non-zero exit whose stderr ends in one line starting "error:" with no traceback; and nothing outside the
run's own folders may change.

The CLIs run in this process (their `main`), so an unexpected exception fails the test with its
traceback. FUZZ_EXAMPLES=n runs n examples per CLI (default 40, derandomized so CI is repeatable).
Values that only make a valid run long (a huge max_iters, say) are left out for the keys where that is
all they do.
"""

import contextlib
import dataclasses
import io
import json
import os
from pathlib import Path

import pytest
from conftest import ROOT, make_documents
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sample
import train
from bench import attention as bench
from config import Config
from studies import ablate

pytestmark = pytest.mark.slow  # every test here runs the scripts' main functions

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
PLAIN = ["", "nan", "inf", "-inf", "-1", "0", "1", "0.5", "3", "true", "ünïcødé ✓", "1e308"]
VALID_LOOKING = ["2", "16", "64", "0.01", "false", "rope", "pad", "cpu", "sdpa", "synthetic", "sdpa_doc"]
HUGE = ["99999999999999999999", "100000000"]
TRIED: dict[str, set] = {}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A working folder with a tiny corpus, prepared data, a finished run, a folder, a file."""
    root = tmp_path_factory.mktemp("fuzz")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_documents(300)))
    (root / "a_folder").mkdir()
    (root / "a_folder" / "note.txt").write_text("a file in a folder")
    (root / "a_file.txt").write_text("just a file")
    base = train_base(root, root / "run")
    with contextlib.redirect_stdout(io.StringIO()):
        assert train.main(base) == 0
    return root


def train_base(root: Path, out_dir: Path) -> list[str]:
    return [
        f"--dataset={root / 'corpus.jsonl'}",
        f"--data_dir={root / 'data'}",
        f"--out_dir={out_dir}",
        "--tokenizer_vocab_size=300",
        "--seq_len=32",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=16",
        "--batch_size=2",
        "--max_iters=1",
        "--eval_tokens=256",
        "--sample_tokens=2",
    ]


def values_for(key: str, root: Path, long_keys: set[str]) -> list[str]:
    paths = [str(root / "a_folder"), str(root / "a_file.txt"), str(root / "missing" / "x")]
    return PLAIN + VALID_LOOKING + paths + ([] if key in long_keys else HUGE)


def overrides(keys: list[str], root: Path, long_keys: set[str] = frozenset()):
    pairs = st.sampled_from(keys).flatmap(
        lambda k: st.tuples(st.just(k), st.sampled_from(values_for(k, root, long_keys)))
    )
    return st.lists(pairs, min_size=1, max_size=3, unique_by=lambda kv: kv[0])


def snapshot(folder: Path, skip: tuple[str, ...]) -> dict:
    """Every file below a folder with its size and modification time, skipping caches."""
    files = {}
    for path in folder.rglob("*"):
        if path.is_file() and not any(part in skip for part in path.parts):
            stat = path.stat()
            files[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return files


CACHES = ("__pycache__", ".hypothesis", ".pytest_cache", ".git")


def run(cli: str, main, argv: list[str], root: Path, allowed: list[Path]) -> tuple[int, str]:
    """Run a CLI's main in `root` and check the contract; returns (exit code, stderr)."""
    TRIED.setdefault(cli, set()).add(tuple(argv))
    before_repo, before_root = snapshot(ROOT, CACHES), snapshot(root, CACHES)
    stderr, cwd = io.StringIO(), os.getcwd()
    os.chdir(root)
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse
                code = e.code
    finally:
        os.chdir(cwd)
    err = stderr.getvalue()
    assert "Traceback" not in err, err
    if code:
        lines = err.strip().splitlines()
        assert lines and lines[-1].startswith("error:"), (argv, err)
        assert sum(line.startswith("error:") for line in lines) == 1, (argv, err)
    assert snapshot(ROOT, CACHES) == before_repo, argv
    allowed = [(root / a).resolve() for a in allowed]
    changed = {
        path
        for path, stat in snapshot(root, CACHES).items()
        if before_root.get(path) != stat and not any(Path(path).resolve().is_relative_to(a) for a in allowed)
    }
    assert not changed, (argv, sorted(changed))
    return code, err


def value_of(argv: list[str], key: str) -> str:
    return [a.split("=", 1)[1] for a in argv if a.startswith(f"--{key}=")][-1]


def folders(*values: str) -> list[Path]:
    """The folders a run may write to; an empty setting allows none (it must be refused)."""
    return [Path(v) for v in values if v.strip()]


TRAIN_KEYS = [f.name for f in dataclasses.fields(Config) if f.name not in ("compile", "wandb")]


@FUZZ
@given(data=st.data())
def test_train_cli(sandbox, data):
    long_keys = {"max_iters", "grad_accum", "sample_tokens", "batch_size", "eval_interval", "warmup_iters"}
    changes = data.draw(overrides(TRAIN_KEYS, sandbox, long_keys))
    out_dir = sandbox / "runs" / f"r{len(TRIED.get('train', ()))}"
    argv = train_base(sandbox, out_dir) + [f"--{k}={v}" for k, v in changes]
    allowed = folders(value_of(argv, "out_dir"), value_of(argv, "data_dir"))
    code, _ = run("train", train.main, argv, sandbox, allowed)
    if code == 0 and value_of(argv, "max_iters") not in ("0",):
        assert (sandbox / value_of(argv, "out_dir") / "ckpt.pt").is_file()


@FUZZ
@given(data=st.data())
def test_sample_cli(sandbox, data):
    keys = ["out_dir", "prompt", "num_samples", "max_new_tokens", "temperature", "top_k", "seed", "device"]
    changes = data.draw(overrides(keys, sandbox, {"num_samples", "max_new_tokens"}))
    argv = [f"--out_dir={sandbox / 'run'}", "--max_new_tokens=3"] + [f"--{k}={v}" for k, v in changes]
    run("sample", sample.main, argv, sandbox, [])


BENCH_KEYS = ["seq_lens", "tokens", "n_layer", "n_head", "n_embd", "vocab_size", "doc_len", "layouts", "variants"]
BENCH_KEYS += ["steps", "warmup", "out"]


@FUZZ
@given(data=st.data())
def test_bench_cli(sandbox, data):
    changes = data.draw(overrides(BENCH_KEYS, sandbox, {"steps", "warmup", "tokens"}))
    base = ["--seq_lens=32", "--tokens=64", "--n_layer=1", "--n_head=2", "--n_embd=16", "--vocab_size=64"]
    base += ["--layouts=synthetic", "--variants=sdpa_causal,sdpa_doc", "--steps=1", "--warmup=0"]
    argv = base + [f"--out={sandbox / 'bench' / 'b.json'}"] + [f"--{k}={v}" for k, v in changes]
    code, _ = run("bench", bench.main, argv, sandbox, folders(value_of(argv, "out")))
    if code == 0:
        assert json.loads((sandbox / value_of(argv, "out")).read_text())["results"]


ABLATE_TABLE = {"seeds": "1", "out_dir": '"study"', "probe_docs": "4", "probe_offsets": "[4]"}
ABLATE_TOML_VALUES = ["[1]", "8", '"x"', "-1", "0", "nan", "inf", "true", '""', "[]", '["a"]', "{}", "1e308"]


@FUZZ
@given(data=st.data())
def test_ablate_cli(sandbox, data):
    """The [ablate] table's values (as TOML) and the command line's."""
    table = dict(ABLATE_TABLE)
    for key in data.draw(st.lists(st.sampled_from(sorted(table)), min_size=1, max_size=2, unique=True)):
        table[key] = data.draw(st.sampled_from(ABLATE_TOML_VALUES))
    config = sandbox / "studies" / f"s{len(TRIED.get('ablate', ()))}.toml"
    config.parent.mkdir(exist_ok=True)
    train_keys = [a[2:].split("=", 1) for a in train_base(sandbox, Path("unused")) if not a.startswith("--out_dir")]
    config.write_text(
        "\n".join(f"{k} = {json.dumps(v)}" for k, v in train_keys)
        + "\n[ablate]\n"
        + "\n".join(f"{k} = {v}" for k, v in table.items())
        + "\n"
    )
    cli = (
        data.draw(overrides(["seeds", "out_dir", "probe_docs"], sandbox, {"seeds"})) if data.draw(st.booleans()) else []
    )
    argv = [str(config)] + [f"--{k}={v}" for k, v in cli]
    study = dict(cli).get("out_dir", table["out_dir"].strip('"'))
    run("ablate", ablate.main, argv, sandbox, folders(str(sandbox / "data"), study))


def test_report_the_cases_tried():
    """Prints how many distinct argument lists each CLI was run with (run it last: pytest -s)."""
    print("fuzz cases tried: " + ", ".join(f"{cli} {len(cases)}" for cli, cases in sorted(TRIED.items())))
    assert TRIED
