"""Resuming a run (the one resume check in run/checkpoint.py): a resumed run takes its settings from its
checkpoint, not from config.json; only the settings that may change do, the others are named; a run
stopped by a kill, a signal or a cut metrics line goes on exactly as if it had never stopped; and it
trains on the shards and tokenizer its checkpoint names, or not at all."""

import dataclasses
import json
import random
import re
import shutil
import signal
from pathlib import Path

import pytest
from conftest import (
    copy_of,
    hand_built_checkpoint,
    make_documents,
    metrics,
    records,
    rewrite_checkpoint,
    start,
    tiny_args,
    tried,
    wait_for_step,
)

import train
from cli import parse_config
from config import Config
from errors import ConfigError, Stopped
from resolve import resolve
from run import checkpoint as checkpoints
from run import processes
from run.checkpoint import read_checkpoint, save_checkpoint

# ---- settings from the checkpoint, and what may change


def stopped_run(folder: Path, cfg: Config) -> Path:
    """A run folder as a stopped run leaves it, built by hand: config.json and ckpt.pt of `cfg`, of one run
    (the same run id in both)."""
    folder.mkdir()
    state = hand_built_checkpoint(dataclasses.replace(cfg, out_dir=str(folder)))
    (folder / "config.json").write_text(json.dumps({"run_id": state["run_id"], **state["config"]}))
    save_checkpoint(folder / "ckpt.pt", state)
    return folder


def test_a_resumed_run_takes_its_settings_from_its_checkpoint_not_from_config_json(tmp_path):
    """Settings edited into config.json change nothing; given ones are checked once, against the checkpoint:
    those a resumed run may change pass, the others are named."""
    run = stopped_run(tmp_path / "run", Config(n_embd=32))
    saved = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**saved, "n_embd": 48}))
    cfg = parse_config([f"--out_dir={run}", "--resume=true", "--max_iters=700"])
    assert cfg.n_embd == 32 and cfg.max_iters == 700
    state = read_checkpoint(run / "ckpt.pt")
    checkpoints.check_resumable(run / "ckpt.pt", state, cfg, world_size=1)
    cfg = parse_config([f"--out_dir={run}", "--resume=true", "--n_embd=48"])
    with pytest.raises(
        ConfigError, match=rf"cannot resume {re.escape(str(run))} with other settings \(n_embd: 32 -> 48\)"
    ):
        checkpoints.check_resumable(run / "ckpt.pt", state, cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"with other settings \(n_embd: 32 -> 48\)"):
        train.train(resolve(cfg))  # the one check, before anything is prepared or written


def test_the_packing_cannot_change_when_a_run_resumes(tmp_path):
    """The rows are planned from the packing, and the data position counts rows: resumed under another
    packing, a run would go on at its cursor in other rows."""
    run = stopped_run(tmp_path / "run", Config(packing="concat"))
    cfg = parse_config([f"--out_dir={run}", "--resume=true", "--packing=bestfit"])
    changed = re.escape("(packing: 'concat' -> 'bestfit')")
    with pytest.raises(ConfigError, match=rf"cannot resume {re.escape(str(run))} with other settings {changed}"):
        checkpoints.check_resumable(run / "ckpt.pt", read_checkpoint(run / "ckpt.pt"), cfg, world_size=1)


@pytest.mark.slow
def test_a_damaged_config_json_beside_a_good_checkpoint_resumes_with_its_settings(trained, tmp_path, capsys):
    run = copy_of(trained[0], tmp_path)
    (run / "config.json").write_text('{"max_iters": 4, "n_embd": ')  # cut short
    cfg = parse_config([f"--out_dir={run}", "--resume=true", "--max_iters=6"])
    assert cfg.n_embd == 32 and cfg.max_iters == 6 and not capsys.readouterr().err
    train.train(resolve(cfg))
    assert json.loads((run / "config.json").read_text())["max_iters"] == 6  # written whole again
    (run / "ckpt.pt").unlink()
    with pytest.raises(ConfigError, match="resume=true but .*ckpt.pt does not exist"):
        train.train(resolve(parse_config([f"--out_dir={run}", "--resume=true"])))


@pytest.mark.slow
def test_resume_with_a_different_model_setting_is_refused(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    train.train(resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2))))
    with pytest.raises(ConfigError, match=r"n_embd: 32 -> 64"):
        train.train(
            resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", out, n_embd=64) + ["--resume=true"]))
        )
    for changed, named in (
        ("--bos=true", "bos: False -> True"),
        ("--packing=bestfit", "packing: 'concat' -> 'bestfit'"),
    ):
        with pytest.raises(ConfigError, match=named):  # checked once, against the checkpoint, before any work
            train.train(resolve(parse_config([f"--out_dir={out}", "--resume=true", changed])))


def test_the_session_takes_only_the_checkpoint_the_plan_read(tmp_path):
    """The fast guard of the test below: the Session, once it holds the folder's lock, refuses a checkpoint
    other than the one it is handed (another run wrote one after the plan read it), and takes that one."""
    import torch

    from run import Session

    run = stopped_run(tmp_path / "run", Config())
    cfg, processes = parse_config([f"--out_dir={run}", "--resume=true"]), (0, 1, torch.device("cpu"))
    read_by_the_plan = {**read_checkpoint(run / "ckpt.pt"), "step": 1}  # the folder's is at step 2 now
    with pytest.raises(ConfigError, match="changed while this run started"):
        with Session(cfg, processes, read_by_the_plan):
            pass
    handed = read_checkpoint(run / "ckpt.pt")
    with Session(cfg, processes, handed) as session:  # the folder's own: taken as handed, not read again
        assert session.resumed is handed


@pytest.mark.slow
def test_a_checkpoint_written_after_the_plan_read_it_is_refused_under_the_lock(tiny_corpus, tmp_path):
    """A resumed run's plan reads the checkpoint before the run folder's lock is held; another run that
    writes one in between (here: by hand) is found once the Session holds the lock, before anything is written."""
    out = tmp_path / "run"
    train.train(resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2))))
    plan = resolve(parse_config([f"--out_dir={out}", "--resume=true", "--max_iters=4"]))
    before = (out / "metrics.jsonl").read_bytes()
    rewrite_checkpoint(out / "ckpt.pt", lambda state: state.update(step=1))
    with pytest.raises(ConfigError, match="changed while this run started"):
        train.train(plan)
    assert (out / "metrics.jsonl").read_bytes() == before and read_checkpoint(out / "ckpt.pt")["step"] == 1
    assert train.train(resolve(parse_config([f"--out_dir={out}", "--resume=true", "--max_iters=4"])))["step"] == 4


@pytest.mark.slow
def test_resuming_to_fewer_steps_than_the_checkpoint_is_refused(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=4, eval_interval=2)
    train.train(resolve(parse_config(args)))
    with pytest.raises(ConfigError, match=r"ckpt.pt is at step 4, past max_iters=2"):
        train.train(resolve(parse_config(args + ["--max_iters=2", "--resume=true"])))


@pytest.mark.slow
def test_a_run_records_the_warmup_it_started_with_and_a_longer_resumed_run_keeps_it(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    train.train(resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=20, warmup_iters=-1))))
    assert json.loads((out / "config.json").read_text())["warmup_iters"] == 2  # a tenth of 20
    assert resolve(parse_config([f"--out_dir={out}", "--resume=true", "--max_iters=200"])).cfg.warmup_iters == 2


@pytest.mark.slow
def test_resuming_by_name_keeps_the_saved_settings_and_names_what_may_not_change(reference_run, tmp_path, monkeypatch):
    args, uninterrupted = reference_run
    out = tmp_path / "run"
    ctrl_c_at_step_6 = lambda self, step, every, device: signal.SIGINT * (step == 6)  # noqa: E731
    monkeypatch.setattr(processes.StopRequest, "agreed", ctrl_c_at_step_6)
    with pytest.raises(Stopped):
        train.train(resolve(parse_config(args(out))))
    monkeypatch.undo()
    cfg = parse_config([f"--out_dir={out}", "--resume=true"])
    assert cfg == parse_config(args(out) + ["--resume=true"])  # every saved setting
    assert parse_config([f"--out_dir={out}", "--resume=true", "--max_iters=20"]).max_iters == 20  # may change
    for change, name in (("--lr=0.5", "lr"), ("--seq_len=32", "seq_len"), ("--doc_mask=false", "doc_mask")):
        with pytest.raises(ConfigError, match=f"cannot resume {out} with other settings \\({name}: "):
            train.train(resolve(parse_config([f"--out_dir={out}", "--resume=true", change])))
        tried("rerun with a changed setting")
    with (out / "metrics.jsonl").open("a") as log:  # a kill while the next line was being written
        log.write('{"step": 7, "train_lo')
    train.train(resolve(cfg))
    assert records(out) == uninterrupted  # the cut line dropped (with a warning), the run exact
    tried("damaged run folder")
    (out / "config.json").write_text("{ damaged")  # the checkpoint holds the settings too
    assert parse_config([f"--out_dir={out}", "--resume=true"]) == cfg
    tried("damaged run folder")


# ---- stopped runs resumed exactly


@pytest.mark.slow
@pytest.mark.parametrize("packing, bos", [("concat", False), ("bestfit", True)])
def test_resume_continues_exactly_where_the_run_stopped(tiny_corpus, tmp_path, packing, bos):
    # A constant learning rate (lr = min_lr) makes the schedule independent of max_iters, so stopping at
    # step 4 and resuming to 8 must match 8 straight steps bit for bit; dropout exercises the RNG state.
    def args(out, max_iters):
        return tiny_args(
            tiny_corpus, tmp_path / "data", out, max_iters=max_iters, eval_interval=4, dropout=0.1, lr=2e-3, min_lr=2e-3
        ) + [f"--packing={packing}", f"--bos={bos}"]

    def without_rates(records):
        return [{k: v for k, v in r.items() if "per_sec" not in k} for r in records]

    train.train(resolve(parse_config(args(tmp_path / "straight", 8))))
    train.train(resolve(parse_config(args(tmp_path / "resumed", 4))))
    train.train(resolve(parse_config(args(tmp_path / "resumed", 8) + ["--resume=true"])))
    straight, resumed = without_rates(metrics(tmp_path / "straight")), without_rates(metrics(tmp_path / "resumed"))
    assert len(straight) == 11 and resumed == straight  # packing statistics, 8 steps and 2 evaluations
    # the test can fail: without restoring the data position, step 5 trains on other rows
    fresh = tmp_path / "fresh"
    train.train(resolve(parse_config(args(fresh, 4))))
    rewrite_checkpoint(fresh / "ckpt.pt", lambda state: state["data"].update(cursor=0))
    train.train(resolve(parse_config(args(fresh, 8) + ["--resume=true"])))
    assert without_rates(metrics(fresh)) != straight


@pytest.mark.slow
def test_resume_after_kill_9_at_random_steps_is_exact(long_args, tmp_path):
    args, uninterrupted = long_args
    out = tmp_path / "killed"
    rng = random.Random(0)
    kill_steps = sorted(rng.sample(range(4, 36), 3))
    for i, step in enumerate(kill_steps):
        proc = start(args(out) + (["--resume=true"] if i else []))
        wait_for_step(out, step, proc)
        proc.kill()  # SIGKILL: no handler runs, the work since the last checkpoint is lost
        proc.wait()
    final = start(args(out) + ["--resume=true"])
    _, stderr = final.communicate(timeout=300)
    assert final.returncode == 0, stderr
    assert records(out) == uninterrupted


# ---- the shards and tokenizer a checkpoint trained on


@pytest.mark.slow
def test_a_resumed_run_trains_on_the_shards_its_checkpoint_names_or_not_at_all(tiny_corpus, tmp_path):
    corpus = tmp_path / "docs.jsonl"
    shutil.copy(tiny_corpus, corpus)
    args = tiny_args(corpus, tmp_path / "data", tmp_path / "run", max_iters=2, eval_interval=2)
    train.train(resolve(parse_config(args)))
    shards = read_checkpoint(tmp_path / "run" / "ckpt.pt")["shards"]
    with open(corpus, "a") as f:  # the corpus grows: preparing it again would give other shards
        f.write("".join(json.dumps({"text": d}) + "\n" for d in make_documents(300, seed=9)))
    train.train(resolve(parse_config([f"--out_dir={tmp_path / 'run'}", "--resume=true", "--max_iters=4"])))
    assert read_checkpoint(tmp_path / "run" / "ckpt.pt")["shards"] == shards
    assert [p.name for p in (tmp_path / "data").iterdir() if not p.name.startswith(".")] == [Path(shards).name]
    shutil.rmtree(shards)  # and once they are gone, it is refused
    with pytest.raises(ConfigError, match=f"trained on the shards in {shards}, which cannot be read now"):
        train.train(resolve(parse_config([f"--out_dir={tmp_path / 'run'}", "--resume=true", "--max_iters=6"])))


@pytest.mark.slow
def test_shards_with_another_tokenizer_than_the_checkpoint(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2)
    train.train(resolve(parse_config(args)))
    rewrite_checkpoint(out / "ckpt.pt", lambda state: state.update(tokenizer_sha256="0" * 64))
    with pytest.raises(ConfigError, match="trained with another tokenizer"):
        train.train(resolve(parse_config(args + ["--max_iters=4", "--resume=true"])))
