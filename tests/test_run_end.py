"""How a run ends: the summary every train.py run closes with (finished, stopped, or without an evaluation),
and the exit code and one line of a run or study a stop signal ended, its checkpoint saved."""

import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, tiny_args

import train
from cli import parse_config
from config import Config
from errors import Stopped, interrupted_exit_code
from reports import run_summary
from run import processes
from run.checkpoint import read_checkpoint

# ---- the summary


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
        train.train(again)
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
