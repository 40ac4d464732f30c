"""The layout a fork relies on: imports run one way, the packing spec (data.py) and the model import nothing
from the repo, and the core (what a fork keeps) neither imports the studies nor needs them to run."""

import ast
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

TRAINING_SIDE = ("train", "model", "data", "shards", "checkpoints", "files", "config")  # what trains a prepared folder
CORE = (*TRAINING_SIDE, "corpora", "prepare", "sample", "export_hf", "pretrained")


def repo_modules() -> dict[str, object]:
    """Module name -> file, for the top-level modules and the studies package."""
    modules = {p.stem: p for p in ROOT.glob("*.py")}
    modules |= {f"studies.{p.stem}": p for p in (ROOT / "studies").glob("*.py") if p.stem != "__init__"}
    return modules


def imports_of(path, modules: dict) -> set[str]:
    """The repo modules a file imports, anywhere in it (imports inside functions count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def graph() -> dict[str, set[str]]:
    modules = repo_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def test_the_graph_is_read_from_the_code():
    edges = graph()
    assert set(CORE) <= set(edges) and "studies.ablate" in edges
    assert {"data", "model", "shards", "checkpoints", "files", "prepare"} <= edges["train"]  # the recipe uses the core
    assert {"studies.plan", "studies.probes", "studies.report", "train"} <= edges["studies.ablate"]
    assert {"studies.plan", "studies.stats", "studies.tables"} <= edges["studies.report"]


def test_imports_run_one_way():
    edges, state, cycle = graph(), {}, []

    def visit(name: str, path: list[str]) -> bool:
        state[name] = "open"
        for other in sorted(edges[name]):
            if state.get(other) == "open":
                cycle.extend(path[path.index(other) :] + [name, other] if other in path else [name, other])
                return True
            if other not in state and visit(other, path + [name]):
                return True
        state[name] = "done"
        return False

    for name in sorted(edges):
        if name not in state:
            assert not visit(name, []), f"an import circle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("leaf", ["data", "model", "files"])
def test_the_packing_spec_the_model_and_the_file_helpers_import_nothing_from_the_repo(leaf):
    assert graph()[leaf] == set()


def test_the_core_imports_no_study():
    edges = graph()
    for name in CORE:
        assert not {m for m in edges[name] if m.startswith("studies")}, name


@pytest.mark.slow
def test_the_core_runs_without_the_studies(tmp_path):
    for name in CORE:
        shutil.copy(ROOT / f"{name}.py", tmp_path)
    shutil.copy(ROOT / "requirements.txt", tmp_path)
    tiny = ["--tokenizer_vocab_size=300", "--seq_len=64", "--n_layer=1", "--n_embd=32", "--n_head=2"]
    tiny += ["--batch_size=4", "--max_iters=2", "--eval_interval=2", "--sample_tokens=5"]
    result = subprocess.run(
        [sys.executable, "train.py", *tiny], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )  # prepares the built-in corpus, trains, evaluates, samples
    assert result.returncode == 0 and "final val_doc_loss" in result.stdout, result.stderr[-2000:]
    assert not (tmp_path / "studies").exists()


@pytest.mark.slow
def test_training_from_a_prepared_folder_needs_neither_preparation_nor_corpora(tmp_path, tiny_corpus):
    import prepare
    from config import Config

    prepared = prepare.prepare(str(tiny_corpus), str(tmp_path / "data"), Config(tokenizer_vocab_size=300), log=print)
    for name in TRAINING_SIDE:
        shutil.copy(ROOT / f"{name}.py", tmp_path)
    tiny = ["--seq_len=64", "--n_layer=1", "--n_embd=32", "--n_head=2", "--batch_size=4", "--max_iters=2"]
    tiny += ["--eval_interval=2", "--sample_tokens=5", f"--dataset={prepared}"]
    result = subprocess.run(
        [sys.executable, "train.py", *tiny], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "final val_doc_loss" in result.stdout, result.stderr[-2000:]
    assert not (tmp_path / "prepare.py").exists() and not (tmp_path / "corpora.py").exists()
