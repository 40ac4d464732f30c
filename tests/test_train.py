"""The training recipe (train.py) on a tiny corpus: the flags, the learning-rate schedule and its warmup,
evaluation (its packing, flags, sums by document and position, budget and progress), a short run that
learns, each flag and variant running, the smallest shapes, sampling and wandb offline logging. The run's
guarantees are tested by what they pin: test_run_folder, test_checkpoint, test_resume, test_processes,
test_cli and test_prepared_data."""

import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, metrics, tiny_args, tried

import export_hf
import sample
import train
from cli import parse_config
from config import Config
from data import Flags
from model import GPT, GPTConfig
from resolve import resolve, warmup_budget


def run_cli(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


# ---- the flags, the learning-rate schedule and evaluation


@pytest.mark.parametrize("flag", ["doc_mask", "reset_position_ids", "mask_boundary_loss"])
def test_each_flag_reaches_its_own_field_of_flags(flag):
    assert parse_config([]).flags == Flags()
    assert parse_config([f"--{flag}=false"]).flags == Flags(**{flag: False})
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(Flags(), flag, False)


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    cfg = Config(lr=1.0, min_lr=0.1, warmup_iters=10, max_iters=110)
    assert train.lr_at(0, cfg) == pytest.approx(0.1) and train.lr_at(9, cfg) == pytest.approx(1.0)
    assert train.lr_at(10, cfg) == 1.0  # the cosine's first step is the peak, never above it
    assert train.lr_at(60, cfg) == pytest.approx(0.55) and train.lr_at(110, cfg) == pytest.approx(0.1)


def test_the_default_warmup_is_a_tenth_of_the_steps_and_grows_with_them():
    assert Config().warmup_iters == -1 and train.warmup_steps(Config(max_iters=600)) == 60
    longer = Config(lr=1.0, min_lr=0.0, max_iters=4500)
    assert train.lr_at(449, longer) == pytest.approx(1.0) and train.lr_at(224, longer) == pytest.approx(0.5)
    assert train.warmup_steps(Config(max_iters=4500, warmup_iters=0)) == 0  # given, it is kept, 0 included


def test_the_default_warmup_is_fixed_when_the_run_starts_and_a_longer_resumed_run_keeps_it():
    """-1 resolves once: a run resumed with ten times its max_iters would otherwise fall back from its peak
    learning rate into a ten times longer warmup. The kept value is the checkpoint's, or where an older
    checkpoint kept -1, a tenth of the max_iters it kept."""
    assert warmup_budget(Config(max_iters=600), None) == 60
    kept = {"config": {"warmup_iters": 60, "max_iters": 600}}
    kept_minus_one = {"config": {"warmup_iters": -1, "max_iters": 600}}
    assert warmup_budget(Config(max_iters=6000), kept) == warmup_budget(Config(max_iters=6000), kept_minus_one) == 60
    assert warmup_budget(Config(max_iters=6000, warmup_iters=7), kept) == 7  # given on resume: taken
    resumed = Config(lr=1.0, min_lr=0.0, max_iters=6000, warmup_iters=warmup_budget(Config(max_iters=6000), kept))
    assert train.lr_at(99, resumed) == pytest.approx(0.5 * (1 + math.cos(math.pi * 39 / 5940)))  # not 100 / 600


@pytest.mark.slow
def test_each_step_trains_at_the_learning_rate_of_the_schedule(tiny_corpus, tmp_path):
    """Step s (counted from 1) uses the schedule's value at s - 1: written out by hand, not with lr_at."""
    import math

    args = tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "run", max_iters=7, warmup_iters=3, eval_interval=7)
    train.train(resolve(parse_config(args + ["--lr=0.01", "--min_lr=0.001"])))
    logged = {r["step"]: r["lr"] for r in metrics(tmp_path / "run") if "lr" in r}
    expected = {s: 0.01 * s / 3 for s in (1, 2, 3)}
    expected |= {s: 0.001 + 0.5 * (1 + math.cos(math.pi * (s - 4) / 4)) * 0.009 for s in (4, 5, 6, 7)}
    assert logged == pytest.approx(expected, rel=1e-12)


def test_an_evaluation_budget_shorter_than_a_row_scores_its_whole_documents(tiny_corpus, tmp_path):
    """eval_tokens below seq_len (a newcomer's --seq_len=1024 --eval_tokens=512): the whole documents that fit
    are scored (at least the first), in one short row, not refused as a validation split too small for a row."""
    args = tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "run", max_iters=1, warmup_iters=0, eval_interval=1)
    train.train(resolve(parse_config(args + ["--seq_len=256", "--eval_tokens=40"])))
    evaluation = [r for r in metrics(tmp_path / "run") if "val_doc_loss" in r][-1]
    assert len(evaluation["val_doc_count_by_document"]) == 1  # the first document is longer than 40 tokens
    assert 40 < evaluation["val_doc_count_by_document"][0] < 256


def test_evaluation_follows_the_runs_packing_and_flags_only_in_val_loss():
    """val_loss against a hand loop over the concat rows under each setting's rules; val_doc_loss the same
    for every setting (documents alone, every fix on)."""
    import numpy as np
    from conftest import reference_semantics

    from model import GPT, GPTConfig, document_causal_dense

    torch.manual_seed(0)
    T, eot = 16, 63
    model = GPT(GPTConfig(vocab_size=64, seq_len=T, n_layer=1, n_head=2, n_embd=16)).eval()
    rng = np.random.default_rng(3)
    val = np.concatenate([np.append(rng.integers(0, eot, n), eot) for n in (5, 9, 2, 20, 7, 3)])
    cpu, fp32 = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    results = {}
    for name, settings in {
        "reference": {},
        "no_doc_mask": {"doc_mask": False},
        "no_reset": {"reset_position_ids": False},
        "no_boundary": {"mask_boundary_loss": False},
    }.items():
        cfg = Config(seq_len=T, batch_size=2, **settings)
        results[name] = train.evaluate(model, model.config, *train.validation_sets(val, eot, cfg), cpu, fp32)
        total = count = 0.0
        for start in range(0, len(val) - 1, T):  # the concat rows, one at a time, the last one short
            x, y = val[start : min(start + T, len(val) - 1)].tolist(), val[start + 1 : start + T + 1].tolist()
            docs, positions, masked = reference_semantics(x, y, eot)
            targets = torch.tensor([masked if cfg.mask_boundary_loss else y])
            pos = torch.tensor([positions if cfg.reset_position_ids else list(range(len(x)))])
            mask = document_causal_dense(torch.tensor([docs])) if cfg.doc_mask else None
            with torch.no_grad():
                losses = model(torch.tensor([x]), pos, mask, targets)
            total, count = total + losses.sum().item(), count + (targets != -100).sum().item()
        assert results[name]["val_loss"] == pytest.approx(total / count, rel=1e-5), name
    assert len({r["val_loss"] for r in results.values()}) == 4
    assert len({r["val_doc_loss"] for r in results.values()}) == 1


def test_evaluation_keeps_loss_sums_by_document_and_by_position():
    """The per-document sums are each document's own loss alone (chunked at seq_len, every chunk from
    position 0), and the per-position counts count the first chunk's targets at each position."""
    import numpy as np

    from model import GPT, GPTConfig

    torch.manual_seed(0)
    T, eot = 16, 63
    model = GPT(GPTConfig(vocab_size=64, seq_len=T, n_layer=1, n_head=2, n_embd=16)).eval()
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, eot, n), eot) for n in (5, 40, 2)]  # the second spans three chunks
    val = np.concatenate(docs)
    cpu, fp32 = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    result = train.evaluate(
        model, model.config, *train.validation_sets(val, eot, Config(seq_len=T, batch_size=2)), cpu, fp32
    )
    expected_sums = []
    for doc in docs:
        total = 0.0
        for start in range(0, len(doc) - 1, T):  # chunks of T inputs, each from position 0
            chunk = torch.from_numpy(doc[start : start + T + 1]).long()[None]
            positions = torch.arange(chunk.shape[1] - 1)[None]
            with torch.no_grad():
                total += model(chunk[:, :-1], positions, None, chunk[:, 1:]).sum().item()
        expected_sums.append(total)
    assert result["val_doc_count_by_document"] == [5, 40, 2]
    assert result["val_doc_loss_sum_by_document"] == pytest.approx(expected_sums, abs=1e-3)
    assert result["val_doc_count_by_position"] == [3, 3] + [2] * 3 + [1] * (T - 5)
    assert sum(result["val_doc_count_by_position"]) == 2 + 5 + T  # later chunks are not at positions < T
    assert result["val_doc_loss"] == pytest.approx(sum(expected_sums) / 47, rel=1e-5)
    assert result["val_doc_loss_from_second"] == result["val_doc_loss"] and "val_first_token_loss" not in result


def test_with_the_start_marker_evaluation_scores_each_document_from_its_bos():
    """Each document alone is [BOS, text, EOT]: its first text token is predicted from the BOS and counts;
    val_doc_loss_from_second leaves those out, so it scores what a run without the marker scores."""
    import numpy as np

    from model import GPT, GPTConfig

    torch.manual_seed(0)
    T, eot, bos = 16, 62, 63
    model = GPT(GPTConfig(vocab_size=64, seq_len=T, n_layer=1, n_head=2, n_embd=16)).eval()
    rng = np.random.default_rng(1)
    docs = [np.append(rng.integers(0, eot, n), eot) for n in (5, 30, 2)]
    cfg = Config(seq_len=T, batch_size=2)
    cpu, fp32 = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    result = train.evaluate(model, model.config, *train.validation_sets(np.concatenate(docs), eot, cfg, bos), cpu, fp32)
    sums, firsts, by_document = [], [], []
    for doc in docs:
        marked = np.insert(doc, 0, bos)
        losses = []
        for start in range(0, len(marked) - 1, T):  # chunks of T inputs, each from position 0
            chunk = torch.from_numpy(marked[start : start + T + 1]).long()[None]
            with torch.no_grad():
                losses += model(chunk[:, :-1], torch.arange(chunk.shape[1] - 1)[None], None, chunk[:, 1:])[0].tolist()
        sums.append(sum(losses))
        firsts.append(losses[0])
        by_document.append(losses)
    assert result["val_doc_count_by_document"] == [6, 31, 3]  # every text token and the EOT
    assert result["val_doc_loss_sum_by_document"] == pytest.approx(sums, abs=1e-3)
    assert result["val_doc_first_token_loss_by_document"] == pytest.approx(firsts, abs=1e-3)
    assert result["val_first_token_loss"] == pytest.approx(np.mean(firsts), rel=1e-4)
    assert result["val_doc_loss"] == pytest.approx(sum(sums) / 40, rel=1e-5)
    assert result["val_doc_loss_from_second"] == pytest.approx((sum(sums) - sum(firsts)) / 37, rel=1e-5)
    # position p predicts the token after the p-th text token, in both conventions: the BOS is not at 0
    # (texts of 5, 30 and 2 tokens: positions 0-4, 0-29 and 0-1). The first row of the 30-token text holds
    # its positions 0 to T - 2; its second chunk starts at T - 1 with nothing before it and is left out.
    counts = result["val_doc_count_by_position"]
    assert counts[:3] == [3, 3, 2] and counts[5:] == [1] * (T - 6) and sum(counts) == 5 + (T - 1) + 2
    # from position 5 on only the 30-token text is there: its first row's losses (1 + p: after its BOS's)
    assert result["val_doc_loss_sum_by_position"][5:] == pytest.approx(by_document[1][6:T], abs=1e-3)


def in_context_by_hand(model, stream, place, lengths, T, eot, flags, token_bytes):
    """Per document: the losses and the bytes of its targets from the second text token, scored in the concat
    rows of `stream` one at a time by the rules in data.py's docstring (the last row short)."""
    import numpy as np

    owner = np.repeat(np.arange(len(lengths)), np.add(lengths, 2))
    sums, n_bytes = np.zeros(len(lengths)), np.zeros(len(lengths))
    for start in range(0, len(stream) - 1, T):
        x, y = stream[start : start + T], stream[start + 1 : start + T + 1]
        x = x[: len(y)]
        starts = np.r_[True, x[:-1] == eot]
        docs_of_row = np.cumsum(np.r_[0, x[:-1] == eot])
        position = np.arange(len(x)) - np.maximum.accumulate(np.where(starts, np.arange(len(x)), 0))
        mask = torch.from_numpy(docs_of_row[:, None] == docs_of_row[None, :]).tril()[None, None]
        with torch.no_grad():
            losses = model(
                torch.from_numpy(x).long()[None],
                torch.from_numpy(position if flags.reset_position_ids else np.arange(len(x)))[None],
                mask if flags.doc_mask else None,
                torch.from_numpy(y).long()[None],
            )[0].numpy()
        for slot, target in enumerate(range(start + 1, start + 1 + len(y))):
            if place[target] >= 1:
                sums[owner[target]] += losses[slot]
                n_bytes[owner[target]] += token_bytes[stream[target]].item()
    return sums, n_bytes


@pytest.mark.parametrize("flags", [Flags(), Flags(False, False, False)], ids=["reference", "naive"])
def test_in_context_scores_each_documents_targets_from_the_second_after_the_documents_before_it(flags):
    """Scored in context: the concat rows of the validation stream under the run's flags, the last short row
    included, each target from a document's second text token on (and its EOT) credited to that document; the
    same targets as val_doc_loss_from_second. Under the reference's flags the two scorings agree (a document in
    a row is a document alone); without the fixes they do not. Bits per byte divide by the targets' bytes."""
    import math

    import numpy as np

    torch.manual_seed(0)
    T, eot, bos = 16, 62, 63
    model = GPT(GPTConfig(vocab_size=64, seq_len=T, n_layer=1, n_head=2, n_embd=16)).eval()
    rng = np.random.default_rng(4)
    docs = [rng.integers(0, eot, n) for n in (5, 30, 1, 9, 4)]
    val = np.concatenate([np.append(d, eot) for d in docs])
    token_bytes = torch.arange(64) % 3  # 0, 1 or 2 bytes a token; EOT (62 % 3 = 2) made 0 below
    token_bytes[eot] = token_bytes[bos] = 0
    cfg = Config(
        seq_len=T,
        batch_size=2,
        doc_mask=flags.doc_mask,
        reset_position_ids=flags.reset_position_ids,
        mask_boundary_loss=flags.mask_boundary_loss,
    )
    cpu, fp32 = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    sets = train.validation_sets(val, eot, cfg, bos)
    result = train.evaluate(model, model.config, *sets, cpu, fp32, token_bytes=token_bytes)
    stream = np.concatenate([np.concatenate([[bos], d, [eot]]) for d in docs])
    place = np.concatenate([np.arange(-1, len(d) + 1) for d in docs])  # -1 the BOS, 0 the first text token
    sums, n_bytes = in_context_by_hand(model, stream, place, [len(d) for d in docs], T, eot, flags, token_bytes)
    assert result["val_doc_loss_in_context_sum_by_document"] == pytest.approx(sums.tolist(), abs=1e-3)
    assert result["val_doc_loss_in_context"] == pytest.approx(sums.sum() / sum(len(d) for d in docs), rel=1e-5)
    assert result["val_doc_bytes_from_second_by_document"] == n_bytes.tolist()
    assert result["val_doc_bpb_in_context"] == pytest.approx(sums.sum() / math.log(2) / n_bytes.sum(), rel=1e-5)
    alone = result["val_doc_loss_from_second"]
    assert result["val_doc_bpb_from_second"] == pytest.approx(
        alone * sum(len(d) for d in docs) / math.log(2) / n_bytes.sum(), rel=1e-5
    )
    alone_by_document = np.subtract(
        result["val_doc_loss_sum_by_document"], result["val_doc_first_token_loss_by_document"]
    )
    starts = np.flatnonzero(place == -1)
    uncut = [i for i, s in enumerate(starts) if s // T == (s + len(docs[i])) // T]  # its targets in the BOS's row
    assert uncut and len(uncut) < len(docs)  # a row edge cuts a document: there the two scorings differ anyway
    in_context = np.array(result["val_doc_loss_in_context_sum_by_document"])
    if flags == Flags():  # a document in a row is a document alone
        assert in_context[uncut] == pytest.approx(alone_by_document[uncut], abs=1e-4)
    else:
        assert np.abs(in_context[uncut] - alone_by_document[uncut]).max() > 1e-2


def test_scoring_alone_is_the_same_in_shared_rows_as_one_document_a_row():
    """Under the document mask and reset positions a document's losses do not depend on its neighbours: the
    best-fit rows that evaluation shares between documents give what one document a row (pad) gives."""
    import numpy as np

    import reports
    from data import PackedBatches

    torch.manual_seed(0)
    T, eot, bos = 32, 62, 63
    model = GPT(GPTConfig(vocab_size=64, seq_len=T, n_layer=2, n_head=2, n_embd=16, pos_emb="rope")).eval()
    rng = np.random.default_rng(5)
    val = np.concatenate([np.append(rng.integers(0, eot, n), eot) for n in rng.integers(1, 50, 40)])
    cpu = torch.device("cpu")
    results = {}
    for packing in ("pad", "bestfit"):
        rows = PackedBatches(val, eot, T, 4, packing, bos_id=bos, shuffle=False)
        sums = reports.DocumentLosses(rows, cpu)
        for first_row, batch in zip(range(0, len(rows), 4), rows.all_batches()):
            with torch.no_grad():
                sums.add(first_row, *train.token_losses(model, batch, model.config, doc_mask=True), batch)
        results[packing] = (len(rows), sums.result())
    (n_pad, pad), (n_shared, shared) = results["pad"], results["bestfit"]
    assert n_shared < 0.7 * n_pad
    for key in ("val_doc_loss_sum_by_document", "val_doc_loss_sum_by_position", "val_doc_first_token_loss_by_document"):
        assert shared[key] == pytest.approx(pad[key], abs=2e-4), key
    assert shared["val_doc_count_by_document"] == pad["val_doc_count_by_document"]
    assert shared["val_doc_count_by_position"] == pad["val_doc_count_by_position"]


def test_a_run_with_the_start_marker_evaluates_each_document_from_its_bos(tmp_path):
    """The fast guard of the marker in evaluation: the validation sets that load_data hands `evaluate` carry
    the run's BOS, so each document alone has its first text token predicted (and counted) from it."""
    import numpy as np
    from conftest import make_documents

    import prepare
    import shards
    from model import GPT

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_documents(60)))
    folder = prepare.prepare(str(corpus), str(tmp_path / "data"), Config(tokenizer_vocab_size=300), log=print)
    cfg = Config(dataset=str(folder), bos=True, seq_len=16, batch_size=2, eval_tokens=0, n_layer=1, n_embd=16)
    cpu, fp32 = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    plan = resolve(dataclasses.replace(cfg, out_dir=str(tmp_path / "out"), device="cpu"))
    run = train.load_data(plan)
    bos = shards.start_marker_id(shards.load_tokenizer(folder))
    for rows in (run.val_packed, run.val_alone):  # the split's first row opens its first document
        assert next(rows.all_batches()).inputs[0, 0] == bos
    model = GPT(plan.model)
    result = train.evaluate(model, model.config, run.val_packed, run.val_alone, cpu, fp32)
    prepared = shards.load_shards(folder)
    ends = np.flatnonzero(np.asarray(prepared.val) == prepared.eot_id)
    # BOS, text, EOT: every text token and the EOT is a target (without the marker, the first is not)
    assert result["val_doc_count_by_document"] == np.diff(ends, prepend=-1).tolist()
    assert len(result["val_doc_first_token_loss_by_document"]) == len(ends)


def test_evaluation_suits_the_run_and_shows_progress(monkeypatch, capsys):
    from config import Config, eval_token_budget

    assert eval_token_budget(Config()) == 8 * 256 * 300 // 4  # the quickstart: a quarter between evals
    assert eval_token_budget(Config(max_iters=10)) == 32_768  # a tiny run: the floor
    assert eval_token_budget(Config(batch_size=64, seq_len=1024, eval_interval=1000)) == 1_000_000
    assert eval_token_budget(Config(eval_tokens=0)) == 0 and eval_token_budget(Config(eval_tokens=5)) == 5
    # every row of every micro-batch and process counts: 2 x 2 x 8 x 256 tokens a step, 300 steps, a quarter
    assert eval_token_budget(Config(grad_accum=2), world_size=2) == 614_400
    clock = itertools.count(0, 4)  # every call 4 "seconds" later
    monkeypatch.setattr(train.time, "time", lambda: next(clock))
    progress = train.evaluation_progress(10, print)
    for _ in range(10):
        progress.advance(1)
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.startswith("eval: ") and "/10 batches, ETA" in line for line in lines)


def test_a_run_that_ends_before_its_warmup_does_says_so(tiny_corpus, tmp_path, capsys):
    args = dict(max_iters=2, eval_interval=2)
    train.train(
        resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "o", warmup_iters=2, **args)))
    )
    assert capsys.readouterr().err.count("warning: max_iters=2 is not past warmup_iters=2") == 1  # once a run
    train.train(
        resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "p", warmup_iters=1, **args)))
    )
    assert "warmup_iters" not in capsys.readouterr().err


# ---- training runs


@pytest.mark.slow
def test_short_run_learns_writes_metrics_and_checkpoint(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = parse_config(
        tiny_args(
            tiny_corpus,
            tmp_path / "data",
            out,
            max_iters=40,
            eval_interval=20,
            log_interval=10,
            lr=1e-2,
            warmup_iters=5,
        )
    )
    result = train.train(resolve(cfg))
    records = metrics(out)
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert losses[-1] < losses[0] - 1.0
    assert [e["step"] for e in evals] == [20, 40] and evals[1]["val_doc_loss"] < evals[0]["val_doc_loss"]
    assert result["val_doc_loss"] == evals[-1]["val_doc_loss"]
    assert len(evals[-1]["val_doc_count_by_position"]) > 10
    assert all({"step", "train_loss", "lr", "tokens_per_sec"} <= r.keys() for r in records if "train_loss" in r)
    assert json.loads((out / "config.json").read_text())["max_iters"] == 40
    packing = records[0]["packing_statistics"]  # logged once, before the first step
    assert records[0]["step"] == 0 and packing["padding_share"] == 0 and packing["documents_per_row"] > 1
    epochs = 40 * cfg.batch_size * cfg.grad_accum / packing["rows"]  # every step reads batch_size rows
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epochs: ")]
    assert len(printed) == 1 and printed[0].startswith(
        f"epochs: the 40 steps read the training rows {epochs:.2f} times"
    )
    assert ("more than two" in printed[0]) == (epochs > 2)
    state = torch.load(out / "ckpt.pt", weights_only=False)
    assert state["step"] == 40 and state["config"]["lr"] == 1e-2


VARIANTS = [
    "--bos=true",
    "--packing=bestfit",
    "--doc_mask=false",
    "--reset_position_ids=false",
    "--mask_boundary_loss=false",
    "--pos_emb=rope",
    "--packing=pad",
]


@pytest.fixture(scope="module")
def reference_run(tiny_corpus, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("reference")
    return train.train(
        resolve(parse_config(tiny_args(tiny_corpus, tmp / "data", tmp / "run", max_iters=2, eval_interval=2)))
    )


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_trains_and_differs_from_the_reference(tiny_corpus, tmp_path, variant, reference_run):
    # The same seed, data order and init as the reference, so a setting that training ignored (a flag not
    # passed on to the batches or the model) would give the reference's numbers to the last bit.
    out = tmp_path / "run"
    result = train.train(
        resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2) + [variant]))
    )
    key, value = variant[2:].split("=")
    assert str(json.loads((out / "config.json").read_text())[key]).lower() == value
    assert result["val_loss"] != reference_run["val_loss"]  # under the run's own packing and flags
    assert result["val_doc_loss"] != reference_run["val_doc_loss"]  # the same evaluation: the weights differ


@pytest.mark.slow
def test_sample_script_generates_from_the_checkpoint(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    train.train(resolve(parse_config(tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2))))
    result = run_cli("sample.py", f"--out_dir={out}", "--prompt=def f1(", "--max_new_tokens=10", "--num_samples=2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--- sample") == 2 and result.stdout.count("def f1(") == 2
    missing = run_cli("sample.py", f"--out_dir={tmp_path / 'none'}")
    assert missing.returncode == 1 and missing.stderr.startswith("error:") and "Traceback" not in missing.stderr


@pytest.mark.slow
def test_wandb_logs_offline(tiny_corpus, tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    args = tiny_args(tiny_corpus, tmp_path / "data", out, max_iters=2, eval_interval=2) + ["--wandb=true"]
    result = run_cli(
        "train.py", *args, env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wb"), "WANDB_SILENT": "true"}
    )
    assert result.returncode == 0, result.stderr
    assert "warning: wandb" not in result.stderr
    runs = list((tmp_path / "wb").rglob("offline-run-*"))
    assert runs and any(p.suffix == ".wandb" and p.stat().st_size > 0 for p in runs[0].rglob("*"))


def test_the_data_parallel_wrapper_makes_no_deprecated_call(tmp_path):
    import warnings

    import torch.distributed as dist

    from model import GPT, GPTConfig

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs gloo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            warnings.simplefilter("error", FutureWarning)
            model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, n_embd=16, pos_emb="rope"))
            wrapped = train.data_parallel(model, torch.device("cpu"))
        assert not wrapped.forward_sync_buffers  # RoPE's tables are the same on every process
    finally:
        dist.destroy_process_group()


def test_a_run_loads_its_prepared_folder_once_also_when_resuming(tiny_corpus, tmp_path, monkeypatch):
    """Loading checks every shard's size and token ids: a run does it once, whether it is given the prepared
    folder, or resumes on the folder its checkpoint names."""
    import prepare
    import shards

    folder = prepare.prepare(str(tiny_corpus), str(tmp_path / "data"), Config(tokenizer_vocab_size=320), log=print)
    loaded, load = [], shards.load_shards
    monkeypatch.setattr(shards, "load_shards", lambda path: loaded.append(path) or load(path))
    args = tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "run", max_iters=2, eval_interval=2, sample_tokens=0)
    train.train(resolve(parse_config([*args, f"--dataset={folder}"])))
    assert loaded == [folder]
    train.train(resolve(parse_config([f"--out_dir={tmp_path / 'run'}", "--resume=true", "--max_iters=4"])))
    assert loaded == [folder, folder]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--bos=true", "--packing=bestfit"], ["--packing=pad", "--pos_emb=rope"]])
def test_the_shortest_rows_train_evaluate_sample_and_export(tiny_corpus, tmp_path, extra):
    args = tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "run", seq_len=2, n_embd=2, n_head=1, batch_size=1)
    train.train(resolve(parse_config(args + ["--max_iters=2", "--eval_interval=1", "--eval_tokens=64", *extra])))
    assert sample.main([f"--out_dir={tmp_path / 'run'}", "--max_new_tokens=3"]) == 0
    export_hf.export(tmp_path / "run", tmp_path / "hf")


@pytest.mark.slow
def test_flags_with_pad_packing_warn(tiny_corpus, tmp_path, capsys):
    train.train(
        resolve(
            parse_config(
                tiny_args(
                    tiny_corpus,
                    tmp_path / "data",
                    tmp_path / "o",
                    packing="pad",
                    doc_mask="false",
                    max_iters=1,
                    eval_interval=1,
                )
            )
        )
    )
    assert "with packing=pad each row holds one document, so the three flags change nothing" in capsys.readouterr().err


def test_sampling_at_extreme_temperatures_gives_tokens():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=1, n_head=2, n_embd=16)).eval()
    prompt = torch.tensor([[1, 2, 3]])
    greedy = model.generate(prompt, 10, temperature=0)
    for temperature in (1e-300, 1e-45, 1e-8, 1e8, 1e300):
        out = model.generate(prompt, 10, temperature=temperature, top_k=None)
        assert out.shape == (1, 13) and int(out.max()) < 64
        if temperature < 1e-6:
            assert torch.equal(out, greedy)
        tried("extreme temperature")
