"""The CPU speed step of a study: its training step and evaluation, each way torch offers on this CPU, side by
side in one process (rounds interleave the candidates, so a machine's drift falls on all alike).

    python -m bench.cpu_step                                      # the practitioner's study on `packages`
    python -m bench.cpu_step --config=configs/practitioner_docs.toml --steps=10 --rounds=3

Candidates of the training step, each on the study's arms (its reference and naive packing) and position kinds,
every model from the same init and fed the same batches:
  eager            what train.py ran on the CPU before this study: fp32, no compile
  compiled         torch.compile (inductor) of the same model
  bf16             bfloat16 autocast (AVX-512 BF16 where the CPU has it)
  compiled_bf16    both
Reported per cell: the median step time over the rounds (timing: it depends on the load) and its ratio to eager's;
over the study the sum of the cells' times, the mix the study trains; and each candidate's training loss after the
timed steps minus eager's (the same steps: how far rounding has moved it so far). The evaluation is timed once
a way: each validation document alone in a row of its own (pad), and in rows it shares under the document mask
(best fit), with the val_doc_loss each gives. Writes --out (JSON) after every measurement.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

import reports
import shards
import train
from cli import run_main, script_settings
from config import Config, setting
from data import Batch, Flags, PackedBatches
from errors import ConfigError, DataError, SaveFailed
from model import GPT, GPTConfig
from resolve import model_settings
from run.folder import write_atomically
from studies.plan import VARIANTS, parse_args

CANDIDATES = {"eager": (False, False), "compiled": (True, False), "bf16": (False, True), "compiled_bf16": (True, True)}


@dataclass
class CpuStepSettings:
    config: str = setting("configs/practitioner_packages.toml", "a study's config: its recipe, arms and data")
    candidates: list[str] = setting(list(CANDIDATES), f"among {', '.join(CANDIDATES)}")
    steps: int = setting(10, "timed training steps of each cell a round", minimum=1)
    rounds: int = setting(3, "rounds; the median is reported", minimum=1)
    threads: int = setting(1, "CPU threads (the study's runs use 1)", minimum=1)
    out: str = setting("out/bench_cpu_step.json", "where the measurements are written", path=True)


def main(argv: list[str]) -> int:
    args = script_settings(CpuStepSettings, argv, __doc__, "python -m bench.cpu_step")
    unknown = set(args.candidates) - set(CANDIDATES)
    if unknown or not args.candidates:
        print(f"error: --candidates: choose among {', '.join(CANDIDATES)}, got {args.candidates}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        study, base = parse_args([args.config])
        write_atomically(Path(args.out), "{}")  # fails now, not after the benchmark, if it cannot be written
        data = StudyData(base)
        measured = {"config": args.config, "threads": args.threads, "torch": torch.__version__}
        measured["step"] = time_steps(args, study, base, data, measured)
        measured["evaluation"] = time_evaluation(base, data, args.out, measured)
    except (ConfigError, DataError, SaveFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(summary(measured))
    return 0


class StudyData:
    """The study's prepared data: its training rows (rewound for each candidate) and validation documents."""

    def __init__(self, base: Config) -> None:
        from prepare import prepare_for  # preparation only where the data is not prepared yet

        folder = prepare_for(base)
        prepared, enc = shards.load_shards(folder), shards.load_tokenizer(folder)
        self.bos_id = shards.start_marker_id(enc) if base.bos else None
        self.vocab_size, self.eot_id = enc.n_vocab + base.bos, prepared.eot_id
        self.train = prepared.train
        self.val = shards.leading_documents(prepared.val, prepared.eot_id, base.eval_tokens)

    def training_rows(self, cfg: Config) -> PackedBatches:
        shape = dict(eot_id=self.eot_id, seq_len=cfg.seq_len, batch_size=cfg.batch_size, packing=cfg.packing)
        return PackedBatches(self.train, flags=cfg.flags, seed=cfg.seed, bos_id=self.bos_id, **shape)

    def alone(self, cfg: Config, packing: str) -> PackedBatches:
        shape = dict(eot_id=self.eot_id, seq_len=cfg.seq_len, batch_size=cfg.batch_size, bos_id=self.bos_id)
        return PackedBatches(self.val, packing=packing, flags=Flags(), shuffle=False, split="val", **shape)


def fresh_model(cfg: Config, vocab_size: int) -> tuple[GPT, torch.optim.Optimizer]:
    """The model and optimizer a run of `cfg` starts from (the seed's init), on the CPU."""
    torch.manual_seed(cfg.seed)
    model = GPT(model_settings(cfg, vocab_size))
    return model, train.optimizer_for(model, cfg)


def training_step(
    model: torch.nn.Module, optimizer, batch: Batch, precision, config: GPTConfig, doc_mask: bool
) -> float:
    """One step of train.py's loss and AdamW at the optimizer's learning rate; returns the loss."""
    loss = train.accumulate_gradients(model, [batch], precision, config, doc_mask)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def time_steps(args: CpuStepSettings, study, base: Config, data: StudyData, measured: dict) -> dict:
    """Per cell and candidate: the step times of each round and the training loss after the last."""
    models = {}
    for pos in study.pos_embs:
        for arm in study.variants:
            cfg = dataclasses.replace(base, pos_emb=pos, **VARIANTS[arm])
            for name in args.candidates:
                compiled, bf16 = CANDIDATES[name]
                model, optimizer = fresh_model(cfg, data.vocab_size)
                precision = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
                fast = torch.compile(model) if compiled else model
                rows = data.training_rows(cfg)
                models[f"{pos}/{arm}/{name}"] = (fast, model.config, optimizer, precision, rows, cfg.doc_mask)
    results = {key: {"seconds": [], "loss": None} for key in models}
    for round_ in range(args.rounds + 1):  # round 0 warms up (and compiles)
        for key, (model, config, optimizer, precision, rows, doc_mask) in models.items():
            batches = [rows.next() for _ in range(args.steps)]  # each candidate of a cell: the same batches
            start = time.perf_counter()
            for batch in batches:
                loss = training_step(model, optimizer, batch, precision, config, doc_mask)
            elapsed = (time.perf_counter() - start) / args.steps
            results[key]["seconds"] += [elapsed] if round_ else []
            results[key]["loss"] = loss
            print(f"round {round_}/{args.rounds} {key}: {elapsed * 1000:.1f} ms a step", flush=True)
        write_atomically(Path(args.out), json.dumps({**measured, "step": results}, indent=1))
    return results


def time_evaluation(base: Config, data: StudyData, out: str, measured: dict) -> dict:
    """Scoring every validation document alone with one fresh model, eager: a row each (pad), or sharing rows
    under the document mask (best fit)."""
    model, _ = fresh_model(base, data.vocab_size)
    model.eval()
    results = {}
    for packing in ("pad", "bestfit"):
        rows = data.alone(base, packing)
        sums = reports.DocumentLosses(rows, torch.device("cpu"))
        start = time.perf_counter()
        with torch.no_grad():
            for first_row, batch in zip(range(0, len(rows), rows.batch_size), rows.all_batches()):
                sums.add(first_row, *train.token_losses(model, batch, model.config, doc_mask=True), batch)
        seconds = time.perf_counter() - start
        results[packing] = {"seconds": seconds, "rows": len(rows), "val_doc_loss": sums.result()["val_doc_loss"]}
        print(f"evaluation alone, {packing} rows: {seconds:.1f} s", flush=True)
        write_atomically(Path(out), json.dumps({**measured, "evaluation": results}, indent=1))
    return results


def summary(measured: dict) -> str:
    step = measured["step"]
    cells = sorted({key.rsplit("/", 1)[0] for key in step})
    names = [n for n in CANDIDATES if any(k.endswith(f"/{n}") for k in step)]
    lines = [f"threads {measured['threads']}, torch {measured['torch']}; median ms a step (x eager), loss - eager's"]
    for cell in cells:
        eager = statistics.median(step[f"{cell}/eager"]["seconds"]) if f"{cell}/eager" in step else None
        parts = []
        for name in names:
            seconds = statistics.median(step[f"{cell}/{name}"]["seconds"])
            ratio = f" (x{eager / seconds:.2f})" if eager else ""
            loss = step[f"{cell}/{name}"]["loss"] - step[f"{cell}/eager"]["loss"] if eager else 0.0
            parts.append(f"{name} {seconds * 1000:.0f} ms{ratio} {loss:+.1e}")
        lines.append(f"  {cell}: " + "; ".join(parts))
    if "eager" in names:
        total = {n: sum(statistics.median(step[f"{c}/{n}"]["seconds"]) for c in cells) for n in names}
        lines.append("  the study's mix: " + ", ".join(f"{n} x{total['eager'] / total[n]:.2f}" for n in names))
    for packing, e in measured["evaluation"].items():
        seconds, loss = e["seconds"], e["val_doc_loss"]
        lines.append(f"  evaluation alone, {packing}: {e['rows']} rows, {seconds:.1f} s, val_doc_loss {loss:.6f}")
    return "\n".join(lines)


if __name__ == "__main__":
    run_main(main)
