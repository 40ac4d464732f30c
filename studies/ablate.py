"""Controlled ablations of the three flags: every variant x position kind x seed, then verdicts, a report
and figures.

    python -m studies.ablate configs/ablate_cpu.toml               # the first study, stage 1: 2 cores, ~100 min
    python -m studies.ablate configs/ablate_cpu.toml --seeds=5 --max_iters=400 --n_layer=6
    python -m studies.ablate configs/import_leak_cpu.toml          # the import-leak study, 2-core CPU

The config file holds train.py keys plus an [ablate] table (the study's settings, listed by --help); any
key of either can be overridden after it as --key=value. Every run of a study uses the same data and
number of real (non-padding) training tokens; only the variant's settings differ. A run's seed sets its
init and data order, so each effect is a paired difference to the reference run of the same seed.

Endpoints are fixed in the config before the study runs (pre-registered) and printed in the report:
  primary     the loss at within-document positions `early_band` (0-15) of every validation document
              alone, for doc_mask, reset_position_ids and naive packing: where those flags act;
              val_doc_loss (every token of every validation document alone) for mask_boundary_loss and
              the pad arms, whose effect is not tied to positions
  secondary   the other of the two, the `middle_band` (16-63), the offset and contamination probes, the
              import leak (with import_leak = true): a bound |effect| < X each
  invariant   what theory says cannot change (RoPE scores depend only on i - j, so with the document
              mask RoPE needs no position reset; with the mask and reset, what precedes a document in its
              row changes nothing): checked seed by seed, outside the family of tests
The statistics are stats.py's (paired by seed, Holm over the primary family, TOST for "negligible").

Seeds are allocated per cell: `seeds`, or `seeds_by_variant`, or `invariance_seeds` for a cell predicted
invariant; the reference runs every seed that any cell of its position kind uses. Within each seed the
runs go in a seeded random order, so that the machine's load drifts into no variant's timing.

Finished runs are skipped and an interrupted run resumes from its checkpoint, so re-running the command
continues a stopped study; a run folder made with other settings that decide its result is refused. The same
command started again while one runs shares the work: each run is trained by the first process to reach it
(with threads = 1, two processes use two cores), and each process writes the report once every run is done.

Written to the study's out_dir: results.md (the report), results.json (every number, per run too),
effects.png, loss_by_position.png, offset_probe.png, and import_leak.png with the leak probe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import sys
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

import data
import train
from cli import Progress, help_text, run_main
from config import NOT_DECIDING, Config, eval_token_budget, resolve_device
from errors import ConfigError, DataError, SaveFailed, Stopped, TrainingDiverged, interrupted_exit_code
from prepare import prepare_for
from reports import packing_statistics
from resolve import resolve
from run.folder import check_writable_folder, exclusive_lock, read_metrics, write_atomically
from shards import Shards, content_digests, digest_of, leading_documents, load_shards, load_tokenizer
from studies import import_leak
from studies.plan import Study, check_against, empty_bands, parse_args, run_config, run_order, seeds_of_cells
from studies.probes import marker_id, probe_inputs, run_probes
from studies.report import code_commit, result_problem, write_report


def pad_steps_factor(shards: Shards, seq_len: int, bos_id: int | None = None) -> float:
    """How many more steps a pad run needs to see as many real tokens as a packed run."""
    rows = data.pad_rows(data.Documents(shards.train, shards.eot_id, bos_id), seq_len)
    return seq_len / float(np.minimum(rows.length, seq_len).mean())


def packing_regime(shards: Shards, seq_len: int, bos_id: int | None = None) -> dict:
    """How much packing matters at this seq_len: documents per concat row (counting a document cut by the
    row's start or end) and the fraction of tokens that can see another document without the mask."""
    documents = data.Documents(shards.train, shards.eot_id, bos_id)
    stats = packing_statistics(documents, data.concat_rows(documents, seq_len), seq_len, max_rows=4096)
    return {
        "documents_per_row": stats["documents_per_row"],
        "tokens_seeing_another_document": stats["tokens_seeing_another_document_without_the_mask"],
        "median_document_tokens": float(np.median(documents.lengths)),
        "mean_document_tokens": float(documents.lengths.mean()),
    }


def scored_positions(shards: Shards, base: Config, bos_id: int | None) -> int:
    """Within-document positions below this one are scored in the evaluation: the validation documents it
    reads (eval_tokens' leading ones) reach no further, nor does a row's text (seq_len, less the marker)."""
    val = leading_documents(shards.val, shards.eot_id, eval_token_budget(base))
    longest = int(data.Documents(val, shards.eot_id).lengths.max()) - 1  # its text: the EOT is not scored from
    return min(longest, base.seq_len - (bos_id is not None))


def decided_by(cfg: Config, study: Study, offsets: list[int], shard_folder: str, data_digest: str) -> dict:
    """What decides a run's result: its training settings, the data (the shard folder's name holds a hash
    of the corpus content and the data settings; the digest, of the prepared bytes), the thread count and
    the probes' settings."""
    return {
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_DECIDING},  # config.py's roles
        "shards": shard_folder,
        "data_digest": data_digest,
        "threads": study.threads,
        "probes": {
            "probe_docs": study.probe_docs,
            "probe_offsets": offsets,
            "import_leak": study.import_leak,
            "leak_pairs": study.leak_pairs,
        },
    }


def flat(settings: dict, prefix: str = "") -> dict:
    """{"config.max_iters": 150, ...}: nested settings as one level, to name the ones that differ."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_reusable(out: Path, decided: dict) -> None:
    """Refuse a run folder that a study with other deciding settings started or finished, or whose files are
    not what this code writes (a finished run's result is read back into the report as it is)."""
    for path in (out / "result.json", out / "study_run.json"):
        if not path.exists():
            continue
        try:
            saved = json.loads(path.read_text())
            recorded = saved["decided_by"]
            problem = result_problem(saved["result"]) if path.name == "result.json" else None
        except (ValueError, KeyError, TypeError):
            problem = "not what this code writes"
        if problem:
            raise ConfigError(f"{path} is damaged ({problem}): delete {out} to run it again")
        if recorded != decided:
            before, now = flat(recorded), flat(decided)
            changed = ", ".join(k for k in before | now if before.get(k) != now.get(k))
            raise ConfigError(
                f"{out} was run with other settings than this study's ({changed}): give the study another "
                f"out_dir, or delete {out} to run it again"
            )


def check_data(out: Path, shard_path: Path) -> str:
    """The prepared data's digest. The study's first start writes each file's SHA-256 to out/data.sha256 (the
    format of `sha256sum -c`); every later start, on this machine or another, compares the data with it and
    names the files that differ."""
    digests = content_digests(shard_path)
    record = out / "data.sha256"
    lines = [f"{digest}  {shard_path.name}/{name}" for name, digest in digests.items()]
    if not record.exists():
        out.mkdir(parents=True, exist_ok=True)
        write_atomically(record, "\n".join(lines) + "\n")
        return digest_of(digests)
    try:
        recorded = dict(line.split(maxsplit=1)[::-1] for line in record.read_text().splitlines() if line.strip())
    except (ValueError, UnicodeDecodeError):
        raise DataError(
            f"{record} is damaged (not 'digest  file' lines): restore it from the study's results"
        ) from None
    now = dict(line.split(maxsplit=1)[::-1] for line in lines)
    differing = sorted(name for name in recorded.keys() | now.keys() if recorded.get(name) != now.get(name))
    if differing:
        raise DataError(
            f"the prepared data differ from what this study recorded in {record}: {', '.join(differing)}; "
            "prepare it as the study's README says, or give the study another out_dir"
        )
    return digest_of(digests)


def study_data(base: Config, out: Path, threads: int) -> tuple[Path, Shards, str]:
    """The study's prepared data, checked against what the study recorded; the thread count fixed (0: torch's
    default) before any run."""
    shard_path = prepare_for(base)
    shards = load_shards(shard_path)
    data_digest = check_data(out, shard_path)
    if threads:
        torch.set_num_threads(threads)
    return shard_path, shards, data_digest


def run_one(cfg: Config, study: Study, decided: dict, offsets: list[int], wait: bool = True) -> dict | None:
    """The run's result: read back when it finished before (check_reusable has vouched for it), else trained
    (or resumed) and probed. Another process of the same study training it: None without `wait`, else its
    result once it is done (or this process resumes the run, if that one stopped)."""
    out = Path(cfg.out_dir)
    done = out / "result.json"
    if done.exists():
        return json.loads(done.read_text())["result"]
    out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as held:  # the run's lock, through its probes: one process of a study takes each run
        on_busy = (lambda holder: print(f"waiting for {holder}, which trains {out}", flush=True)) if wait else None
        try:
            held.enter_context(exclusive_lock(out / "study.lock", on_busy))
        except BlockingIOError:
            return None
        if done.exists():  # the process waited for finished it
            return json.loads(done.read_text())["result"]
        return train_and_probe(cfg, study, decided, offsets)


def train_and_probe(cfg: Config, study: Study, decided: dict, offsets: list[int]) -> dict:
    """Train the run (or resume it from its checkpoint), probe it, and write its result.json last."""
    out = Path(cfg.out_dir)
    done, started = out / "result.json", out / "study_run.json"
    write_atomically(started, json.dumps({"decided_by": decided}))
    resume = (out / "ckpt.pt").exists()  # a run interrupted earlier continues from its checkpoint
    train.train(resolve(dataclasses.replace(cfg, resume=resume)))  # a stop signal: Stopped, checkpoint saved
    records = [record for _, record in read_metrics(out / "metrics.jsonl")]
    train_records = [r for r in records if "train_loss" in r]
    evals = [r for r in records if "val_doc_loss" in r]
    result = {
        **{k: v for k, v in evals[-1].items() if k != "step"},
        "curve": [(r["step"], r["val_doc_loss"]) for r in evals],
        "wall_seconds": training_seconds(train_records, cfg.batch_size * cfg.grad_accum * cfg.seq_len),
        "useful_tokens_per_sec": float(np.mean([r["counted_tokens_per_sec"] for r in train_records])),
        "steps": cfg.max_iters,
        "trained_at_commit": code_commit(),
        "trained_on": hardware(),
        "threads": torch.get_num_threads(),
        **run_probes(out, cfg, study.probe_docs, offsets),
    }
    if study.import_leak:
        result["import_leak"] = import_leak.probe_run(out, resolve_device(cfg.device), study.leak_pairs)
    # a run counts as finished only once its probes are written
    write_atomically(done, json.dumps({"result": result, "decided_by": decided}))
    return result


def training_seconds(train_records: list[dict], tokens_per_step: int) -> float:
    """Time spent in training steps (evaluations excluded), from the logged rates, so that a run
    resumed after an interruption is timed like one that was not."""
    steps = np.diff([0] + [r["step"] for r in train_records])
    return float(sum(n * tokens_per_step / r["tokens_per_sec"] for n, r in zip(steps, train_records)))


# ----------------------------------------------------------------------------------------------
# Endpoints and verdicts


def hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    model = names[0] if names else platform.processor() or platform.machine()
    # the kernel level too (AVX2, AVX512, ...): float rounding differs between kernels, and VMs reported alike
    # ("AMD EPYC, 2 cores") ended the quickstart 0.010 apart
    return f"CPU: {model}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()} kernels"


def environment(command: list[str]) -> dict:
    return {
        "hardware": hardware(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "commit": code_commit(),
        "command": " ".join(command),
    }


# ----------------------------------------------------------------------------------------------
# The report


def usage() -> str:  # the ablate docstring, then the [ablate] keys
    return help_text(__doc__, cls=Study) + "\n\n...and any train.py setting (python train.py --help)."


def main(argv: list[str], command: list[str] | None = None, echo_report: bool = True) -> int:
    """`command`: the words that run the study again, when another module (studies.compare) runs it;
    `echo_report`: print the report at the end (compare prints its own table)."""
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    command = command or ["python", "-m", "studies.ablate", *argv]
    again = shlex.join(command)
    try:
        study, base = parse_args(argv)
        check_against(study, base)
        offsets = sorted(set(study.probe_offsets) | {1, base.seq_len // 2})
        if max(offsets) >= base.seq_len - 1:
            raise ConfigError(f"probe_offsets must be below seq_len - 1 = {base.seq_len - 1}")
        if base.max_iters < 1:
            raise ConfigError("max_iters must be at least 1 for a study")
        out = Path(study.out_dir)
        check_writable_folder(out, "out_dir")  # before any work: the study ends by writing its report here
        shard_path, shards, data_digest = study_data(base, out, study.threads)
        bos_id = marker_id(shards, base)
        pad_factor = pad_steps_factor(shards, base.seq_len, bos_id)
        regime = packing_regime(shards, base.seq_len, bos_id)
        for name in empty_bands(study, scored_positions(shards, base, bos_id)):  # a primary one is refused
            print(
                f"note: {name}={getattr(study, name)} holds no scored target in the validation documents (they "
                "end before it): reported as empty",
                flush=True,
            )
        # the probes run after each training run: a validation split too small for them fails here, first
        probe_inputs(shards, study.probe_docs, base.seq_len, offsets, bos_id)
        if study.import_leak:
            leak_pairs = import_leak.validation_pairs(shards, load_tokenizer(shard_path), study.leak_pairs)
            import_leak.fitting_pairs(leak_pairs, base.seq_len)
        seeds = seeds_of_cells(study)
        planned = []
        for pos, variant, seed in run_order(seeds):
            cfg = run_config(base, pos, variant, seed, out / pos / variant / f"seed{seed}", pad_factor)
            decided = decided_by(cfg, study, offsets, shard_path.name, data_digest)
            check_reusable(Path(cfg.out_dir), decided)  # every run before the first trains
            planned.append((pos, variant, seed, cfg, decided))
        runs = train_planned(planned, study, offsets)
        write_report(runs, study, offsets, base, regime, pad_factor, out, environment(command), echo_report)
    except (ConfigError, DataError, TrainingDiverged, SaveFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Stopped as e:  # the first stop signal: the run in training saved its checkpoint
        print(
            f"interrupted: {e} stopped {e.out_dir} after step {e.step} with its checkpoint saved; exit "
            f"{interrupted_exit_code(e)} (the study is unfinished); continue it with: {again}",
            file=sys.stderr,
        )
        return interrupted_exit_code(e)
    except KeyboardInterrupt as e:  # a second stop signal, or one outside training (the probes)
        print(f"\ninterrupted: continue the study with: {again}", file=sys.stderr)
        return interrupted_exit_code(e)
    return 0


def train_planned(planned: list[tuple], study: Study, offsets: list[int]) -> dict:
    """Every planned run's result, by position kind, variant and seed: trained, or read back when it finished
    before. A run that another process of the same study is training is left to it until the end, then waited
    for: the same command started twice shares the runs between two processes. A line after each run trained
    gives the study's progress, and its ETA from the rate at which runs finish, whichever process trains them."""
    runs: dict = {pos: {v: {} for v in study.variants} for pos in study.pos_embs}
    finished_before = finished_runs(planned)
    # printed here once after every run, so the Progress itself prints nothing: it only keeps the counts and ETA
    progress = Progress(
        len(planned) - finished_before,
        lambda p: (
            f"=== study: {finished_before + p.done:.0f}/{len(planned)} runs finished, "
            f"{p.counts['trained']:.0f} by this process; ETA {p.eta()}"
        ),
        lambda line: None,
    )
    elsewhere = []
    for i, (pos, variant, seed, cfg, decided) in enumerate(planned):
        fresh = not (Path(cfg.out_dir) / "result.json").exists()
        print(
            f"\n=== run {i + 1}/{len(planned)}: pos_emb={pos} {variant} seed={seed}"
            + ("" if fresh else " (finished before: skipped)"),
            flush=True,
        )
        result = run_one(cfg, study, decided, offsets, wait=False)
        if result is None:
            print("another process of this study is training it: on to the next run", flush=True)
            elsewhere.append((pos, variant, seed, cfg, decided))
            continue
        runs[pos][variant][seed] = result
        if fresh:
            progress.advance(finished_runs(planned) - finished_before - progress.done, trained=1)
            print(progress.show(progress), flush=True)
    for pos, variant, seed, cfg, decided in elsewhere:
        runs[pos][variant][seed] = run_one(cfg, study, decided, offsets, wait=True)
    return runs


def finished_runs(planned: list[tuple]) -> int:
    return sum((Path(cfg.out_dir) / "result.json").exists() for *_, cfg, _ in planned)


if __name__ == "__main__":
    run_main(main)
