"""How a process ends (run/processes.py, errors.py): a stop signal (Ctrl-C, SIGTERM, SIGHUP) finishes the
step, saves the checkpoint and exits 128 + its number with one `interrupted:` line, in training, studies
and preparation alike; a second Ctrl-C stops at once; an error on one process under torchrun stops them
all with one line; and every train.py run closes with a summary of how it ended."""

import json
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    complete_folders,
    jsonl_bytes,
    make_documents,
    one_line,
    python,
    records,
    start,
    tiny_args,
    tried,
    wait_for_step,
)

import train
from cli import parse_config
from config import Config
from errors import Stopped, interrupted_exit_code
from reports import run_summary
from resolve import resolve
from run import processes
from run.checkpoint import read_checkpoint

# ---- the summary a run ends with


def write_run(out_dir: Path, records: list[dict], checkpoint: bool = True) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if checkpoint:
        (out_dir / "ckpt.pt").write_bytes(b"")


EVALUATION = {"step": 6, "val_loss": 5.25, "val_doc_loss": 5.125, "val_doc_loss_from_second": 5.0625}


TRAINING = [{"step": 0, "packing_statistics": {}}, {"step": 6, "train_loss": 5.5, "lr": 1e-3}]


def summary_commands(summary: str) -> dict[str, list[str]]:
    """`name: command` lines of a summary, each command split as the shell would."""
    commands = {}
    for line in summary.splitlines():
        name, _, rest = line.strip().partition(": ")
        if name in ("sample", "export", "continue", "resume"):
            commands[name] = shlex.split(rest.split("  (")[0])
    return commands


@pytest.mark.parametrize("bos", [False, True])
def test_a_finished_run_is_summarised_with_its_final_losses_checkpoint_and_next_commands(tmp_path, bos):
    out = tmp_path / "my run"  # a space: the commands must still paste as one argument
    write_run(out, [*TRAINING, EVALUATION])
    summary = run_summary(Config(out_dir=str(out), max_iters=6, bos=bos), seconds=75)
    assert "run finished: 6 steps, 1m15s wall time" in summary
    assert "final val_doc_loss 5.1250 | val_loss 5.2500" in summary
    assert ("val_doc_loss_from_second 5.0625" in summary) == bos  # only a run with the marker has it
    assert f"checkpoint: {out / 'ckpt.pt'}" in summary
    commands = summary_commands(summary)
    assert commands["sample"] == ["python", "sample.py", f"--out_dir={out}"]
    assert commands["export"] == ["python", "export_hf.py", f"--out_dir={out}", "--to=hf/my run"]
    assert commands["continue"] == ["python", "train.py", f"--out_dir={out}", "--resume=true", "--max_iters=12"]
    assert "resume" not in commands


def test_a_run_without_an_evaluation_is_summarised_with_what_it_has(tmp_path):
    cfg = Config(out_dir=str(tmp_path / "run"), max_iters=6)
    write_run(tmp_path / "run", TRAINING)
    summary = run_summary(cfg, seconds=3)
    assert "no evaluation; last train_loss 5.5000 (step 6)" in summary and "val_loss" not in summary
    write_run(tmp_path / "empty", [], checkpoint=False)
    summary = run_summary(Config(out_dir=str(tmp_path / "empty")), seconds=3)
    assert "no evaluation and no training step logged" in summary and "checkpoint: none written" in summary
    assert not summary_commands(summary)  # nothing to sample, export or continue from: no command that fails


def test_a_stopped_run_is_summarised_with_its_last_evaluation_and_only_its_resume(tmp_path):
    out = tmp_path / "run"
    write_run(out, [*TRAINING, {**EVALUATION, "step": 3}])
    summary = run_summary(Config(out_dir=str(out), max_iters=10), 3, world_size=2, stopped_after=4)
    assert "run stopped after step 4 of 10" in summary and "last evaluation (step 3): val_doc_loss 5.1250" in summary
    resume = ["torchrun", "--nproc_per_node=2", "train.py", f"--out_dir={out}", "--resume=true"]  # as many processes
    assert summary_commands(summary) == {"resume": resume}


def in_process_main(argv: list[str], capsys) -> tuple[int, str, str]:
    code = train.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_train_ends_with_the_summary_when_it_does_not_sample(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=4, eval_interval=2, bos="true", sample_tokens=0)
    code, stdout, _ = in_process_main(args, capsys)
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert code == 0 and "\nsample:\n" not in stdout
    closing = stdout.rstrip().splitlines()[-6:]
    assert closing[0].startswith("run finished: 4 steps, ") and closing[-1].startswith("  continue: python train.py")
    names = ("val_doc_loss", "val_loss", "val_doc_loss_from_second")
    assert closing[1] == "  final " + " | ".join(f"{name} {last[name]:.4f}" for name in names)


# ---- a stop signal: the checkpoint saved, then exit 128 + its number


def test_a_stop_is_exit_128_plus_the_signal():
    assert interrupted_exit_code(Stopped(signal.SIGINT, 3, "out")) == 130
    assert interrupted_exit_code(Stopped(signal.SIGTERM, 3, "out")) == 143
    assert interrupted_exit_code(Stopped(signal.SIGHUP, 3, "out")) == 129
    assert interrupted_exit_code(KeyboardInterrupt()) == 130  # Ctrl-C before training began


def test_a_stopped_run_saves_its_checkpoint_exits_143_and_says_so_in_one_line(
    tiny_corpus, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    # SIGTERM received during step 3
    monkeypatch.setattr(processes.StopRequest, "agreed", lambda self, step, every, device: signal.SIGTERM * (step == 3))
    code, stdout, stderr = in_process_main(tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=6), capsys)
    assert code == 143 and read_checkpoint(out / "ckpt.pt")["step"] == 3
    lines = [line for line in stderr.splitlines() if line.startswith("interrupted:")]
    assert lines == [
        f"interrupted: SIGTERM stopped the run after step 3 with its checkpoint saved; exit 143 (unfinished); "
        f"resume it with: python train.py --out_dir={out} --resume=true"
    ]
    assert "run stopped after step 3 of 6" in stdout and "export_hf.py" not in stdout


def test_a_stop_during_the_last_step_finishes_the_run_and_stops_a_caller(tiny_corpus, tmp_path, capsys, monkeypatch):
    """train.py: the run is finished all the same (exit 0, the finished summary). A study calling train():
    the stop reaches it, so the next run does not start as if nothing had been asked."""
    out = tmp_path / "run"
    monkeypatch.setattr(processes.StopRequest, "agreed", lambda self, step, every, device: signal.SIGINT * (step == 4))
    code, stdout, stderr = in_process_main(tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=4), capsys)
    assert code == 0 and read_checkpoint(out / "ckpt.pt")["step"] == 4
    assert "run finished: 4 steps" in stdout and "interrupted" not in stderr
    again = parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "other", max_iters=4))
    with pytest.raises(Stopped) as stopped:
        train.train(resolve(again))
    assert stopped.value.step == 4 and read_checkpoint(tmp_path / "other" / "ckpt.pt")["step"] == 4


def start_until_training(command: list[str]) -> subprocess.Popen:
    """The command started, returned once it prints its first training step."""
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # Ctrl-C as from a terminal
    )
    for line in proc.stdout:
        if line.startswith("step "):
            return proc
    raise AssertionError(f"no training step: {proc.communicate()[1][-2000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_train_and_a_study_stopped_by_a_signal_exit_128_plus_it_after_saving(tiny_corpus, tmp_path, signum):
    out = tmp_path / "run"
    args = tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=100000, eval_interval=100000)
    proc = start_until_training([sys.executable, "train.py", *args])
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    step = read_checkpoint(out / "ckpt.pt")["step"]
    assert proc.returncode == 128 + signum and f"run stopped after step {step} of 100000" in stdout
    interrupted = [line for line in stderr.splitlines() if line.startswith("interrupted:")]
    assert len(interrupted) == 1 and f"after step {step} with its checkpoint saved; exit {128 + signum}" in stderr
    config = tmp_path / "study.toml"
    settings = dict(a.removeprefix("--").split("=", 1) for a in args if "out_dir" not in a)
    config.write_text(
        "".join(f'{k} = "{v}"\n' for k, v in settings.items())
        + f'[ablate]\nout_dir = "{tmp_path}/s"\nprobe_docs = 8\nprobe_offsets = [16]\n'
    )
    proc = start_until_training([sys.executable, "-m", "studies.ablate", str(config)])
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    interrupted = [line for line in stderr.splitlines() if line.startswith("interrupted:")]
    assert proc.returncode == 128 + signum and len(interrupted) == 1, stderr[-2000:]
    assert "with its checkpoint saved" in interrupted[0] and f"python -m studies.ablate {config}" in interrupted[0]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_stop_signal_finishes_the_step_saves_and_exits_128_plus_it(long_args, tmp_path, signum):
    args, uninterrupted = long_args
    out = tmp_path / "stopped"
    proc = start(args(out))
    wait_for_step(out, 10, proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum  # unfinished: `train.py && export_hf.py` exports nothing
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith("interrupted:") and "--resume=true" in last_line
    stopped_at = int(last_line.split(" after step ")[1].split()[0])
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == stopped_at == records(out)[-1]["step"]
    resumed = start(args(out) + ["--resume=true"])
    resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and records(out) == uninterrupted


@pytest.mark.slow
def test_sighup_stops_training_like_ctrl_c(tiny_corpus, tmp_path):
    args = tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "run", max_iters=100000, eval_interval=100000)
    child = subprocess.Popen(
        [sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in child.stdout:
        if line.startswith("step "):
            break
    child.send_signal(signal.SIGHUP)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGHUP and "SIGHUP: finishing this step" in out, err[-2000:]
    step = read_checkpoint(tmp_path / "run" / "ckpt.pt")["step"]
    assert f"run stopped after step {step} of 100000" in out
    assert f"interrupted: SIGHUP stopped the run after step {step} with its checkpoint saved; exit 129" in err


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_in_one_line_and_the_run_resumes_by_its_name(reference_run, tmp_path):
    args, _ = reference_run
    out = tmp_path / "run"
    # a model slow enough per step that the second Ctrl-C lands within the step the first one lets finish
    slow = args(out, max_iters=400, eval_interval=100, n_embd=128, n_head=4, seq_len=128, batch_size=16)
    proc = subprocess.Popen(
        [sys.executable, "train.py", *slow], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in proc.stdout:
        if line.startswith("step   110/"):
            break
    proc.send_signal(signal.SIGINT)
    for line in proc.stdout:
        if line.startswith("SIGINT: finishing this step"):
            proc.send_signal(signal.SIGINT)
            break
    _, stderr = proc.communicate(timeout=120)
    tried("second Ctrl-C during a step")
    assert proc.returncode == 130, stderr[-2000:]
    message = one_line(subprocess.CompletedProcess([], 130, "", stderr), "interrupted:")
    assert f"python train.py --out_dir={out} --resume=true" in message
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == 100  # the last checkpoint, intact
    assert not list(out.glob("ckpt.pt.tmp*"))
    resumed = python("train.py", f"--out_dir={out}", "--resume=true", "--max_iters=102")  # settings from config.json
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == 102


# ---- signals and kills during preparation


@pytest.mark.slow
def test_sigterm_or_sighup_during_preparation_is_one_line_and_leaves_nothing(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_documents(20000)))
    for signum in (signal.SIGTERM, signal.SIGHUP):
        data_dir = tmp_path / f"data{signum}"
        child = subprocess.Popen(
            [sys.executable, "prepare.py", str(corpus), f"--data_dir={data_dir}", "--tokenizer_vocab_size=300"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + 120
        while not any(data_dir.glob(".*.tmp-*")) and time.time() < deadline:  # the preparation has begun
            time.sleep(0.05)
        child.send_signal(signum)
        _, err = child.communicate(timeout=120)
        assert child.returncode == 128 + signum, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("interrupted:") and "Traceback" not in err
        assert not list(data_dir.glob(".*.tmp-*")) and not list(data_dir.glob("*/meta.json"))


@pytest.mark.slow
def test_interrupts_and_kills_at_random_points_of_preparation_leave_it_clean_and_resumable(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(make_documents(30000, seed=3)))
    command = [sys.executable, "prepare.py", str(corpus), "--tokenizer_vocab_size=300"]
    reference = python(*command[1:], f"--data_dir={tmp_path / 'reference'}")
    assert reference.returncode == 0, reference.stderr
    (expected,) = complete_folders(tmp_path / "reference")
    seconds = json.loads((expected / "timings.json").read_text())["seconds"]["total"]  # tokenizer, encoding, shards
    data_dir = tmp_path / "data"
    rng = random.Random(0)
    interrupted, latest = 0, 0.5 * seconds
    for _ in range(16):
        if interrupted == 8:
            break
        signum = signal.SIGINT if interrupted % 2 == 0 else signal.SIGKILL  # as many of each
        proc = subprocess.Popen(
            [*command, f"--data_dir={data_dir}"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # Ctrl-C as from a terminal, even when pytest runs as a background job (which ignores SIGINT,
            # and a child that starts with SIGINT ignored keeps ignoring it)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        while proc.poll() is None and not list(data_dir.glob(f".*.tmp-{proc.pid}")):  # its preparation has begun
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, latest))  # a random point of the preparation
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
        tried("interrupt or kill during preparation")
        if proc.returncode == 0:  # it had finished (later runs are faster than the first): start afresh, sooner
            (done,) = complete_folders(data_dir)
            shutil.rmtree(done)
            latest /= 2
            continue
        interrupted += 1
        assert complete_folders(data_dir) == []  # nothing that looks complete
        if signum == signal.SIGINT:
            assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
            assert (stdout + stderr).count("interrupted:") == 1
            assert not list(data_dir.glob(".*.tmp-*"))  # the unfinished preparation was removed
    assert interrupted == 8
    finished = python(*command[1:], f"--data_dir={data_dir}")
    assert finished.returncode == 0, finished.stderr
    (folder,) = complete_folders(data_dir)
    assert folder.name == expected.name
    for shard in sorted(expected.glob("*.bin")):
        assert (folder / shard.name).read_bytes() == shard.read_bytes()
    assert not list(data_dir.glob(".*.tmp-*"))


# ---- several processes: an error on one stops them all, in one line


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_an_error_before_the_first_barrier_stops_every_process_with_one_line(reference_run, tmp_path):
    args, _ = reference_run
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    held = tmp_path / "held"
    train.train(resolve(parse_config(args(held, max_iters=1))))  # a finished run: a new one into it is refused
    for case, argv in (
        ("bad data", args(tmp_path / "a") + [f"--dataset={tmp_path / 'missing.jsonl'}"]),
        ("refused out_dir", args(held)),
    ):
        t0 = time.time()
        result = python(*torchrun, *argv, timeout=180)
        assert result.returncode != 0 and time.time() - t0 < 120, case
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "gloo" not in result.stderr.lower(), (case, result.stderr[-3000:])
        tried("error on one process under torchrun")
