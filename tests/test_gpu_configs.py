"""Each GPU config (configs/*_gpu.toml) run end to end on the CPU at a tiny size, so that CI takes every path it
takes but the device's own: training under bf16 autocast and torch.compile, evaluation, checkpoints, resuming
and the export for the training config; every run, the probes and the report for the study configs.

Overridden: the size (model, rows, steps, tokens, seeds, probes), the data and the folders, and of what the GPU
decides only the device and the precision `auto` gives there (bfloat16). Every other setting is the config's,
and each test checks so against what the runs recorded: compile, the optimizer's, packing and flags, the
study's variants, bands and margins. What stays untested here is bound to CUDA: FlexAttention (attn_impl auto
is sdpa on a CPU, where flex has no backward) and Inductor's kernels (torch.compile runs with the aot_eager
backend: dynamo's graphs and AOT autograd, without Inductor's C++ compilation, 30 s a run on 2 cores), which
tests/test_gpu.py checks on a GPU; the fused AdamW and pinned-memory copies."""

import json
import tomllib

import pytest
import torch
from conftest import ROOT
from test_import_leak import python_files

import export_hf
import train
from cli import parse_config
from config import NOT_DECIDING
from resolve import resolve
from studies import ablate, compare

pytestmark = pytest.mark.slow  # each trains several tiny runs with torch.compile

RUNS = {  # how each GPU config runs: train.py, or the study module that reads it
    "gpt2_small_gpu.toml": "train",
    "ablate_gpu.toml": "ablate",
    "compare_gpu.toml": "compare",
    "import_leak_gpu.toml": "ablate",
    "practitioner_gpu.toml": "confirm",  # a registration: python -m studies.confirm ... --run, in test_confirm.py
}
DEVICE_BOUND = {"device": "cpu", "dtype": "bfloat16"}  # what `auto` picks on a GPU, made explicit on the CPU
SIZE = dict(
    n_layer=1, n_head=2, n_embd=32, seq_len=128, batch_size=4, max_iters=2, warmup_iters=1, eval_interval=2,
    eval_tokens=1024, log_interval=1, tokenizer_vocab_size=320,
)  # fmt: skip
STUDY_SIZE = dict(seeds=2, seeds_by_variant="", probe_docs=4, probe_offsets=16, leak_pairs=8)
PLACES = ("dataset", "data_dir", "out_dir")


def test_every_gpu_config_is_run_here():
    assert sorted(RUNS) == sorted(p.name for p in (ROOT / "configs").glob("*_gpu.toml"))
    # the studies of a GPU registration run through it (tests/test_confirm.py runs it end to end)
    registered = tomllib.loads((ROOT / "configs" / "practitioner_gpu.toml").read_text())["studies"].values()
    assert sorted(registered) == sorted(f"configs/{p.name}" for p in (ROOT / "configs").glob("*_gpu_*.toml"))


@pytest.fixture
def cpu_stand_ins(monkeypatch):
    """torch.compile with the aot_eager backend, failing past dynamo's recompile limit, and a record of each
    compile and each precision a run used."""
    used = {"compiled": 0, "precisions": []}
    real_compile, real_autocast = torch.compile, train.autocast

    def compile_(model, **kwargs):
        used["compiled"] += 1
        return real_compile(model, **{**kwargs, "backend": "aot_eager"})

    def autocast(device, dtype="auto"):
        precision = real_autocast(device, dtype)
        used["precisions"].append(precision.fast_dtype if isinstance(precision, torch.autocast) else None)
        return precision

    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(train, "autocast", autocast)
    # past dynamo's limit of graphs a function (8), the runs of a study that follow would train uncompiled:
    # eager's rounding, not the compiled one of the runs before
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    torch._dynamo.reset()
    yield used
    torch._dynamo.reset()


def overrides(settings: dict) -> list[str]:
    return [f"--{key}={value}" for key, value in settings.items()]


def assert_the_configs_own(recorded: dict, name: str, overridden: set[str]) -> None:
    """Every setting the config gives is the run's, but those overridden."""
    config = tomllib.loads((ROOT / "configs" / name).read_text())
    kept = {key: value for key, value in config.items() if not isinstance(value, dict) and key not in overridden}
    assert kept and {key: recorded[key] for key in kept} == kept


def test_the_gpu_training_config_trains_resumes_and_exports(tiny_corpus, tmp_path, cpu_stand_ins):
    name, run = "gpt2_small_gpu.toml", tmp_path / "run"
    places = dict(dataset=tiny_corpus, data_dir=tmp_path / "data", out_dir=run)
    settings = [str(ROOT / "configs" / name), *overrides({**DEVICE_BOUND, **SIZE, **places})]
    train.train(resolve(parse_config(settings)))
    assert torch.load(run / "ckpt.pt", weights_only=False)["step"] == 2
    train.train(resolve(parse_config([f"--out_dir={run}", "--resume=true", "--max_iters=4"])))
    state = torch.load(run / "ckpt.pt", weights_only=False)
    assert state["step"] == 4 and state["evaluation"]["step"] == 4
    assert_the_configs_own(state["config"], name, {*DEVICE_BOUND, *SIZE, *PLACES})
    assert state["config"]["compile"] and cpu_stand_ins["compiled"] == 2  # the run and its resumption
    assert set(cpu_stand_ins["precisions"]) == {torch.bfloat16}
    checked = export_hf.export(run, tmp_path / "hf")  # RoPE: a GPT-NeoX folder, held to the run's fp32 logits
    assert checked["max_abs_logit_difference"] <= export_hf.LOGIT_TOLERANCE


@pytest.mark.parametrize("name", ["ablate_gpu.toml", "compare_gpu.toml", "import_leak_gpu.toml"])
def test_each_gpu_study_config_runs_its_study(tiny_corpus, tmp_path, cpu_stand_ins, name):
    dataset = tiny_corpus
    if name == "import_leak_gpu.toml":  # its probe reads whole Python files with imports
        dataset = tmp_path / "files"
        dataset.mkdir()
        for i, text in enumerate(python_files(5, n=400)):
            (dataset / f"file{i}.py").write_text(text)
    study = tmp_path / "study"
    places = dict(dataset=dataset, data_dir=tmp_path / "data", out_dir=study)
    if name == "compare_gpu.toml":  # the comparison refuses fewer than 50 validation documents
        places.update(val_fraction=0.3, eval_tokens=0)
    argv = [str(ROOT / "configs" / name), *overrides({**DEVICE_BOUND, **SIZE, **STUDY_SIZE, **places})]
    main = {"ablate": ablate.main, "compare": compare.main}[RUNS[name]]
    assert main(argv) == 0
    saved = json.loads((study / "results.json").read_text())
    config = tomllib.loads((ROOT / "configs" / name).read_text())
    table = {key: saved["study"][key] for key in config["ablate"] if key not in {*STUDY_SIZE, "out_dir"}}
    assert table == {key: value for key, value in config["ablate"].items() if key in table}
    kinds, variants = config["ablate"]["pos_embs"], config["ablate"]["variants"]
    assert sorted(saved["summary"]) == sorted(f"{pos}/{variant}" for pos in kinds for variant in variants)
    runs = list(study.glob("*/*/seed*/result.json"))
    assert runs and cpu_stand_ins["compiled"] == len(runs)  # every run compiled, none more than once
    assert set(cpu_stand_ins["precisions"]) == {torch.bfloat16}
    for run in runs:  # what decides each run's result, as it recorded it (the folders and the log aside)
        recorded = json.loads(run.read_text())["decided_by"]["config"]
        assert recorded["compile"] and recorded["dtype"] == "bfloat16" and recorded["device"] == "cpu"
        assert_the_configs_own(recorded, name, {*DEVICE_BOUND, *SIZE, *places, *NOT_DECIDING})
    assert (study / "results.md").is_file() and (study / "effects.png").is_file()
