"""The layout a fork relies on: the teaching path (model.py, data.py, train.py) reads in one sitting, the run's
guarantees sit in one package (run/) below it, imports run one way, the core imports no study or benchmark,
and no function is over 60 lines."""

import ast
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

TEACHING_PATH, TEACHING_BUDGET = ("train", "model", "data"), 1050  # lines, all three together
GUARANTEES_BUDGET = 580  # lines of the run/ package
TRAINING_SIDE = ("train", "resolve", "model", "data", "shards", "config", "cli", "errors", "reports")  # and run/
CORE = (*TRAINING_SIDE, "corpora", "prepare", "sample", "export_hf", "huggingface")


def repo_modules() -> dict[str, object]:
    """Module name -> file: the top-level modules and those of the run, studies and bench packages."""
    modules = {p.stem: p for p in ROOT.glob("*.py")}
    for package in ("run", "studies", "bench"):
        modules |= {f"{package}.{p.stem}": p for p in (ROOT / package).glob("*.py") if p.stem != "__init__"}
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
        found |= {"run.session" for name in names if name == "run"}  # the package's door
    return found


def graph() -> dict[str, set[str]]:
    modules = repo_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def lines_of(*names: str) -> int:
    return sum(len(repo_modules()[name].read_text().splitlines()) for name in names)


def test_the_graph_is_read_from_the_code():
    edges = graph()
    assert set(CORE) <= set(edges) and {"run.session", "run.checkpoint", "bench.attention"} <= set(edges)
    assert {"data", "model", "reports", "run.session", "config", "cli"} <= edges["train"]
    assert {"train", "resolve", "studies.plan", "studies.report"} <= edges["studies.ablate"]


def test_the_teaching_path_and_the_guarantees_keep_their_budgets():
    assert lines_of(*TEACHING_PATH) <= TEACHING_BUDGET, "model.py + data.py + train.py"
    package = [name for name in repo_modules() if name.startswith("run.")]
    package_lines = lines_of(*package) + len((ROOT / "run" / "__init__.py").read_text().splitlines())
    assert package_lines <= GUARANTEES_BUDGET, "run/"


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


def import_chain(name: str, edges: dict[str, set[str]]) -> list[str]:
    """The longest chain of imports down from `name` (imports inside functions count)."""
    below = [import_chain(other, edges) for other in edges[name]]
    return [name, *max(below, key=len, default=[])]


def test_the_tower_from_train_is_at_most_nine_floors():
    """A reader who opens train.py follows at most nine modules down: train -> resolve -> prepare -> cli ->
    run.checkpoint -> shards -> config -> data -> errors. It was ten through pretrained -> export_hf -> sample,
    before the Hugging Face format became one module below the scripts."""
    chain = import_chain("train", graph())
    assert len(chain) <= 9, " -> ".join(chain)


def test_the_model_and_the_exceptions_import_nothing_and_the_packing_spec_only_the_exceptions():
    edges = graph()
    assert edges["model"] == set() and edges["errors"] == set() and edges["data"] == {"errors"}


def test_the_guarantees_sit_below_the_recipe():
    """run/ serves train.py and knows nothing of it, of the reports, the scripts or the studies."""
    above = {"train", "resolve", "reports", "prepare", "corpora", "sample", "export_hf", "huggingface"}
    for name, imported in graph().items():
        if name.startswith("run."):
            assert not imported & above and not {m for m in imported if m.startswith(("studies", "bench"))}, name


def test_the_hugging_face_format_sits_below_the_scripts():
    """huggingface.py, the format both ways, serves export_hf.py and init_from and imports no script: a run that
    starts from a folder loads neither the export's command nor sample.py."""
    edges = graph()
    assert edges["huggingface"] <= {"config", "errors", "model", "shards"} and "huggingface" in edges["export_hf"]


def test_the_core_imports_no_study_or_benchmark():
    """studies/ and bench/ sit above the core and use what they need of it by name; nothing below looks up."""
    edges = graph()
    for name in CORE:
        assert not {m for m in edges[name] if m.startswith(("studies", "bench"))}, name


def test_no_function_is_over_60_lines():
    long = []
    for path in [*ROOT.glob("*.py"), *ROOT.glob("*/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long


def test_the_settings_the_command_line_and_preparation_load_without_the_compiler():
    """Every script imports config.py and cli.py, and the benchmarks' child processes reports.py: none may
    import model.py, whose torch.compile wrappers load the compiler (about 4 s a process on a 2-core CPU)."""
    code = "import sys, cli, config, prepare, reports; print('torch._dynamo' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr[-2000:]


def copy_training_side(folder) -> None:
    for name in TRAINING_SIDE:
        shutil.copy(ROOT / f"{name}.py", folder)
    shutil.copytree(ROOT / "run", folder / "run", ignore=shutil.ignore_patterns("__pycache__"))


@pytest.mark.slow
def test_the_core_runs_without_the_studies(tmp_path):
    copy_training_side(tmp_path)
    for name in set(CORE) - set(TRAINING_SIDE):
        shutil.copy(ROOT / f"{name}.py", tmp_path)
    shutil.copy(ROOT / "requirements.txt", tmp_path)
    tiny = ["--tokenizer_vocab_size=300", "--seq_len=64", "--n_layer=1", "--n_embd=32", "--n_head=2"]
    tiny += ["--batch_size=4", "--max_iters=2", "--eval_interval=2", "--sample_tokens=5"]
    result = subprocess.run(
        [sys.executable, "train.py", *tiny], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )  # prepares the built-in corpus, trains, evaluates, samples
    assert result.returncode == 0 and "final val_doc_loss" in result.stdout, result.stderr[-2000:]
    assert not (tmp_path / "studies").exists() and not (tmp_path / "bench").exists()


@pytest.mark.slow
def test_training_from_a_prepared_folder_needs_neither_preparation_nor_corpora(tmp_path, tiny_corpus):
    import prepare
    from config import Config

    prepared = prepare.prepare(str(tiny_corpus), str(tmp_path / "data"), Config(tokenizer_vocab_size=300), log=print)
    copy_training_side(tmp_path)
    tiny = ["--seq_len=64", "--n_layer=1", "--n_embd=32", "--n_head=2", "--batch_size=4", "--max_iters=2"]
    tiny += ["--eval_interval=2", "--sample_tokens=5", f"--dataset={prepared}"]
    result = subprocess.run(
        [sys.executable, "train.py", *tiny], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "final val_doc_loss" in result.stdout, result.stderr[-2000:]
    assert not (tmp_path / "prepare.py").exists() and not (tmp_path / "corpora.py").exists()


def test_every_module_imports():
    """A study or benchmark that no other test runs still loads: a name it imports from the core exists."""
    names = sorted(repo_modules())
    code = "import importlib, sys; [importlib.import_module(name) for name in sys.argv[1:]]"
    result = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
