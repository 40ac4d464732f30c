"""The command lines (cli.py, config.py): settings from config files and --key=value arguments, parsed and
checked before anything runs; bad input of any kind, to any script, is one `error:` line with no
traceback; --help lists every key; output into a pipe that closes early or a full device ends quietly or
in one line; ~ is the home folder in every path; and the commands a message suggests paste as they are."""

import dataclasses
import json
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import (
    ROOT,
    in_process,
    jsonl_bytes,
    make_documents,
    one_error_line,
    run_cli,
    tiny_args,
    tried,
)

import prepare
import sample
import train
from cli import parse_config, run_main
from config import Config
from errors import ConfigError
from resolve import check_fits, model_settings, resolve
from run.checkpoint import read_checkpoint

# ---- settings: config files and arguments


def test_quickstart_config_is_the_default():
    assert parse_config([str(ROOT / "configs/quickstart.toml")]) == Config()


@pytest.mark.parametrize("name", ["gpt2_small_gpu.toml", "ablate_base.toml"])
def test_shipped_configs_parse(name):
    parse_config([str(ROOT / "configs" / name)])


def test_cli_overrides_file_and_types_are_parsed(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('pos_emb = "rope"\nmax_iters = 5\n')
    cfg = parse_config([str(toml), "--max_iters=7", "--doc_mask=false", "--lr=1e-3"])
    assert (cfg.pos_emb, cfg.max_iters, cfg.doc_mask, cfg.lr) == ("rope", 7, False, 1e-3)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--doc_mask_off=true"], "unknown config key 'doc_mask_off' (did you mean doc_mask?)"),
        (["--max_iters=ten"], "max_iters='ten': expected int"),
        (["--doc_mask=maybe"], "doc_mask='maybe': expected bool"),
        (["--pos_emb=alibi"], "pos_emb='alibi': choose one of learned, rope"),
        (["--packing=best"], "packing='best': choose one of concat, bestfit, pad"),
        (["--batch_size=0"], "batch_size=0: must be at least 1"),
        (["--n_embd=100", "--n_head=3"], "must split into n_head=3 heads"),
        (["no_such_config.toml"], "config file no_such_config.toml not found"),
        (["max_iters=3"], "config file max_iters=3 not found"),
    ],
)
def test_bad_settings_are_one_clear_error(args, message):
    with pytest.raises(ConfigError) as error:
        parse_config(args)
    assert message in str(error.value)


def test_toml_that_does_not_parse(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("max_iters = = 3\n")
    with pytest.raises(ConfigError, match="does not parse"):
        parse_config([str(bad)])


def test_config_files_that_are_folders_or_not_utf8(tmp_path):
    with pytest.raises(ConfigError, match="is a folder, not a config file"):
        parse_config([str(tmp_path)])
    (tmp_path / "latin1.toml").write_bytes(b'dataset = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        parse_config([str(tmp_path / "latin1.toml")])


def test_non_finite_and_out_of_range_settings_are_refused_before_anything_else(tmp_path):
    for bad, message in [
        ("--lr=nan", "lr=nan: must be a finite number"),
        ("--lr=inf", "lr=inf: must be a finite number"),
        ("--dropout=nan", "dropout=nan: must be a finite number"),
        ("--seed=-1", "seed=-1: must be at least 0"),
        ("--data_seed=99999999999999999999", "data_seed=99999999999999999999: must be at most"),
        ("--tokenizer_vocab_size=70000", "tokenizer_vocab_size=70000: must be at most 65536"),
        ("--seq_len=99999999999999999999", "seq_len=99999999999999999999: must be at most 1048576"),
        ("--n_layer=99999999999999999999", "n_layer=99999999999999999999: must be at most 1024"),
        ("--grad_accum=99999999999999999999", "grad_accum=99999999999999999999: must be at most 65536"),
        ("--out_dir=", "out_dir is empty"),
        ("--data_dir=", "data_dir is empty"),
        ("--device=meta", "device='meta'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config([bad, "--resume=true", f"--out_dir={tmp_path / 'none'}"] if "out_dir" not in bad else [bad])


def test_an_empty_path_is_refused_by_every_script_before_it_reads_or_writes(capsys):
    """An empty path would be the working folder: sample.py looked there, then suggested training into it."""
    import export_hf
    from studies import import_leak

    for main, argv in [
        (sample.main, ["--out_dir="]),
        (export_hf.main, ["--out_dir=", "--to=hf"]),
        (import_leak.main, ["--out_dir= "]),
        (train.main, ["--data_dir="]),
    ]:
        one_error_line(in_process(main, argv, capsys), "is empty: give a path")
    tried("an empty path", 4)


def test_one_command_line_convention_everywhere(capsys):
    with pytest.raises(ConfigError, match="bad argument '--max_iters': use --key=value"):
        parse_config(["--max_iters", "5"])
    with pytest.raises(SystemExit) as exit_code:
        sample.main(["--out_dir", "out"])
    assert exit_code.value.code == 2 and "bad argument '--out_dir': use --key=value" in capsys.readouterr().err
    tried("--key value", 2)


def test_a_corpus_where_the_config_file_goes_says_to_use_dataset(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(jsonl_bytes(make_documents(3)))
    with pytest.raises(ConfigError, match=f"give it as --dataset={corpus}"):
        parse_config([str(corpus)])
    (tmp_path / "empty.jsonl").write_text("")  # would parse as an empty TOML file: the defaults
    with pytest.raises(ConfigError, match="is not a .toml config file"):
        parse_config([str(tmp_path / "empty.jsonl")])
    with pytest.raises(ConfigError, match=f"is a folder, not a config file .*give it as --dataset={tmp_path}"):
        parse_config([str(tmp_path)])
    tried("corpus given as a config file", 3)


def test_a_leading_tilde_is_the_home_folder_for_every_path(tmp_path, monkeypatch):
    from studies import plan

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.toml").write_text('data_dir = "~/d"\n')
    cfg = parse_config(["~/c.toml", "--out_dir=~/run", "--dataset=~/corpus.jsonl", "--tokenizer=~/t.tiktoken"])
    assert (cfg.data_dir, cfg.out_dir) == (f"{tmp_path}/d", f"{tmp_path}/run")
    assert (cfg.dataset, cfg.tokenizer) == (f"{tmp_path}/corpus.jsonl", f"{tmp_path}/t.tiktoken")
    toml = tmp_path / "study.toml"
    toml.write_text('data_dir = "~/d"\n[ablate]\nout_dir = "~/study"\n')
    study, _ = plan.parse_args([str(toml)])
    assert study.out_dir == f"{tmp_path}/study"
    tried("~ in a path", 6)


# ---- bad input: one `error:` line


@pytest.mark.slow
def test_cli_error_is_one_line_without_traceback(tmp_path):
    result = run_cli("train.py", "--pos_emb=alibi")
    assert result.returncode == 1
    assert result.stderr.strip() == "error: pos_emb='alibi': choose one of learned, rope"
    missing = run_cli("train.py", f"--dataset={tmp_path / 'none'}", f"--out_dir={tmp_path / 'o'}")
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.startswith("error: dataset") and missing.stderr.count("\n") == 1


@pytest.mark.slow
def test_help_lists_every_key():
    result = run_cli("train.py", "--help")
    assert result.returncode == 0
    assert all(f"--{f.name}=" in result.stdout for f in dataclasses.fields(Config))


@pytest.mark.slow
def test_flex_on_cpu_is_refused(tiny_corpus, tmp_path):
    with pytest.raises(ConfigError, match="FlexAttention has no backward on CPU"):
        train.train(
            resolve(
                parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "o", attn_impl="flex", device="cpu"))
            )
        )


@pytest.mark.slow
def test_a_model_too_large_for_the_machine_is_refused(tiny_corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"needs about .* GB .* this machine has"):
        train.train(
            resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "o", n_embd=2**16, n_layer=64)))
        )


def test_a_step_whose_micro_batches_cannot_fit_is_refused():
    settings = ["--batch_size=1024", "--seq_len=256", "--n_layer=1", "--n_embd=16", "--n_head=2"]
    cfg = parse_config([*settings, "--grad_accum=65536"])  # 687 GB of token ids, built before the step
    with pytest.raises(ConfigError, match=r"65536 x 1024 x 256 tokens a step\) needs about 687\.5 GB"):
        check_fits(model_settings(cfg, 300), cfg.batch_size, torch.device("cpu"), cfg.grad_accum)
    fitting = parse_config([*settings, "--grad_accum=1"])
    check_fits(model_settings(fitting, 300), fitting.batch_size, torch.device("cpu"), fitting.grad_accum)


@pytest.mark.parametrize(
    "table, message",
    [
        ("seeds = [1]", "seeds=[1]: expected int"),
        ("probe_offsets = 8", "probe_offsets=8: expected a list of int"),
        ('probe_offsets = ["a"]', "probe_offsets='a': expected int"),
        ("out_dir = []", "out_dir=[]: expected str"),
        ('out_dir = ""', "out_dir is empty"),
        ("probe_docs = 0", "probe_docs=0: must be at least 1"),
    ],
)
def test_ablate_settings_of_the_wrong_type(tmp_path, table, message, capsys):
    from studies import ablate

    config = tmp_path / "c.toml"
    config.write_text(f"[ablate]\n{table}\n")
    one_error_line(in_process(ablate.main, [str(config)], capsys), message)


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda saved: saved["runs"]["learned"]["reference"]["20"].pop("val_doc_loss"),
            "(run learned/reference/seed20: it has no val_doc_loss)",
        ),
        (lambda saved: saved["runs"]["learned"]["reference"].pop("21"), "no_doc_mask has seeds [21] that its baseline"),
        (lambda saved: saved.update(runs=[]), "is not a study's results.json: it holds no runs"),
        (lambda saved: saved.update(runs=["learned"]), "AttributeError"),
        (
            lambda saved: saved["config"].update(seq_len="x"),
            "results.json cannot be read as a study's results.json (its recorded settings do not read: seq_len='x'",
        ),
    ],
)
def test_a_damaged_results_json_is_one_line_and_no_report(tmp_path, damage, message, capsys):
    """A results.json that is JSON but not in the shape studies.ablate writes (a run's field or a seed gone,
    runs of another type) is named in one line, and no results.md or figure is written."""
    from studies import report

    saved = json.loads((ROOT / "results/decided/import_leak_cpu_bos/results.json").read_text())
    damage(saved)
    (tmp_path / "results.json").write_text(json.dumps(saved))
    one_error_line(in_process(report.main, [str(tmp_path / "results.json")], capsys), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


@pytest.mark.slow
def test_a_bad_study_setting_is_one_line_from_the_command_line(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[ablate]\nprobe_docs = 0\n")
    one_error_line(run_cli("-m", "studies.ablate", str(config)), "probe_docs=0: must be at least 1")


def test_bench_checks_its_arguments_before_it_runs(tmp_path, capsys):
    from bench import attention as bench

    one_error_line(in_process(bench.main, ["--seq_lens=0"], capsys), "--seq_lens")
    one_error_line(in_process(bench.main, ["--doc_len=0"], capsys), "--doc_len")
    one_error_line(in_process(bench.main, [f"--out={tmp_path}"], capsys), "is a folder")


# ---- output that cannot be written


@pytest.mark.slow
def test_output_into_a_pipe_that_closes_early_ends_quietly(reference_run, tmp_path):
    args, _ = reference_run
    out = tmp_path / "run"
    train.train(resolve(parse_config(args(out, max_iters=1, eval_interval=1))))
    proc = subprocess.Popen(
        [sys.executable, "sample.py", f"--out_dir={out}", "--num_samples=400", "--max_new_tokens=30"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    stderr = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert proc.returncode == 141 and "Traceback" not in stderr and stderr.strip() == "", stderr[-2000:]
    tried("closed output pipe")


@pytest.mark.slow
def test_stdout_on_a_full_device_is_one_error_line_from_every_entry_point(monkeypatch, capsys):
    """Each script's main, under the one wrapper, with its output failing as print does on a full disk."""
    import importlib

    import cli

    def full(*args, **kwargs):
        if kwargs.get("file") is None:
            raise OSError(28, "No space left on device")
        return real_print(*args, **kwargs)

    real_print = print
    for name in ENTRY_POINTS:
        module = importlib.import_module(name)
        monkeypatch.setattr("builtins.print", full)
        monkeypatch.setattr(sys, "argv", [name, "--help"])
        monkeypatch.setattr(cli, "_silence_stdout", lambda: None)  # pytest owns the real stdout
        with pytest.raises(SystemExit) as ended:
            run_main(module.main)
        monkeypatch.setattr("builtins.print", real_print)
        assert ended.value.code == 1, name
        err = capsys.readouterr().err
        assert err.strip() == "error: cannot write the output (No space left on device); what was saved before is kept"


ENTRY_POINTS = (
    *("train", "sample", "prepare", "export_hf"),
    *("studies.ablate", "bench.attention", "bench.preparation", "bench.packing"),
    *("studies.import_leak", "studies.ladder", "studies.report"),
)


# ---- hints to paste: a command in a message is quoted where the shell would change it


def test_prepare_quotes_a_glob_in_its_train_hint(tiny_corpus, tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_bytes(tiny_corpus.read_bytes())
    glob = str(tmp_path / "corpus" / "*.jsonl")
    assert prepare.main([glob, f"--data_dir={tmp_path / 'data'}", "--tokenizer_vocab_size=300"]) == 0
    (hint,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train on it with ")]
    pasted = hint.removeprefix("train on it with ").split(" (or ")[0]
    assert f"'--dataset={glob}'" in pasted  # quoted: the shell leaves the glob to the script
    assert shlex.split(pasted) == [f"--dataset={glob}", f"--data_dir={tmp_path / 'data'}", "--tokenizer_vocab_size=300"]


def test_a_missing_checkpoint_hint_pastes(tmp_path):
    with pytest.raises(ConfigError) as error:
        read_checkpoint(tmp_path / "my run" / "ckpt.pt")
    assert shlex.split(str(error.value).split("train first with: ")[1])[-1] == f"--out_dir={tmp_path / 'my run'}"
