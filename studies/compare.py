"""Does packing care matter on your data? One command, about an hour on a 2-core CPU:

    python -m studies.compare --dataset=my_corpus.jsonl                    # the default: about an hour
    python -m studies.compare configs/compare_smoke.toml --dataset=my_corpus.jsonl   # minutes; decides nothing
    python -m studies.compare --dataset=my_corpus.jsonl --pos_embs=learned,rope      # learned positions too
    python -m studies.compare --dataset=my_corpus.jsonl --variants=reference,no_doc_mask,naive  # one switch too
    python -m studies.compare configs/compare_gpu.toml --dataset=my_corpus.jsonl     # one GPU (never yet run)

It trains the practitioner's two arms: careful packing (the reference: document mask, reset positions,
boundary loss mask, each document opened by its start marker) against standard concatenation (the naive
arm: the same rows and tokens, the three fixes off), with RoPE positions, on 6 seeds (configs/compare.toml;
any train.py or [ablate] key can be given as --key=value: python train.py --help and python -m
studies.ablate --help list them). Each effect is paired by seed: the naive arm's
loss minus the reference's, positive where careful packing helps.

Before training it prints what the comparison can decide (the smallest effect it finds with power 0.8 at
the spreads the studies measured) and refuses data that cannot support it. It then trains the runs
`--workers` at a time (default: one a CPU core, each run on one thread, so the losses do not depend on
the core count), and prints how far the models trained (tokens a parameter, their loss against a unigram
model's) and a short table: the loss at positions 0-15 of each validation document scored alone, and over
whole documents from their second token, scored alone (as the model is used) and in context (after the
documents before it in its row, as the arm trained), in nats a token and bits a byte, each with its 95%
interval and whether it is decided (Holm over the tests). by_position.png draws the loss by position in
the document for each arm; results.md is the full report. Finished runs are kept: the same command
continues or re-reports.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import sample
from cli import format_duration, run_main, settings_from
from config import Config, eval_token_budget, resolve_device
from errors import ConfigError, DataError, SaveFailed
from prepare import prepare_for
from resolve import model_settings, parameter_count
from run.checkpoint import read_checkpoint
from run.folder import check_writable_folder
from shards import Shards, leading_documents, load_shards
from studies import ablate, stats
from studies.plan import Study, check_against, parse_args, primary_endpoints, seeds_of_cells
from studies.report import band_loss, endpoint_label, save_figure

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "compare.toml"
LABELS = {
    "reference": "careful (every fix, the marker)",
    "naive": "standard concatenation",
    "no_doc_mask": "document mask off",
    "no_reset_position_ids": "position reset off",
    "no_mask_boundary_loss": "boundary loss mask off",
}
ARM_NAMES = {"naive": "naive", "no_doc_mask": "mask off", "no_reset_position_ids": "reset off"}
# the table's endpoints, each with its bits-per-byte twin
ENDPOINTS = {"early": None, "from_second": "bpb", "in_context": "bpb_in_context"}
# The paired spread (sd over seeds of an arm's loss minus the reference's) that sizes a comparison: the
# confirmatory study's, measured at 9.2M tokens on `packages` with the document mask off (8 seeds,
# results/decided/confirm_rung3/); in context as alone until the practitioner's study measures it
STUDY_SPREADS = {
    ("learned", "early"): 0.091,
    ("learned", "whole"): 0.052,
    ("rope", "early"): 0.050,
    ("rope", "whole"): 0.012,
}
POWER = 0.8
# Below these the models are barely trained (an effect of the mask grew 10x from 0.6 to 5.8 tokens a
# parameter in the ladder, results/history/ladder/): half of Chinchilla's 20 tokens a parameter (Hoffmann et al.
# 2022, arXiv 2203.15556), and a loss at least 1 nat under a unigram model's
WELL_TRAINED_TOKENS_PER_PARAMETER = 10
WELL_TRAINED_NATS_UNDER_UNIGRAM = 1.0
SMOKE_TOKENS_PER_PARAMETER = 1  # below this a comparison is a smoke test: it decides nothing, by design
MOST_EPOCHS = 2  # the practitioner's study's bound on its prose corpus
FEWEST_VALIDATION_DOCUMENTS = 50  # an effect on fewer documents speaks for those documents, not the corpus
# a variant that raises the loss ("hurts", in stats.py's words) means the fix it turns off helps
DECIDED = {"hurts": "decided: careful helps", "helps": "decided: careful hurts", "negligible": "decided: negligible"}


def unigram_loss(shard_path: Path) -> float:
    """The validation loss of a model that predicts every token by its training frequency (add-one
    smoothed): the loss a language model must get well under to have learned more than token counts."""
    shards = load_shards(shard_path)
    counts = np.bincount(np.asarray(shards.train), minlength=shards.vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[np.asarray(shards.val)].mean())


# ----------------------------------------------------------------------------------------------
# Before training: what the comparison can decide, and whether the data can support it


def tokens_per_run(base: Config) -> int:
    return base.max_iters * base.batch_size * base.grad_accum * base.seq_len


def smallest_effects(study: Study, pos: str, seeds: int) -> dict[str, float]:
    """The smallest effect (nats) on the early band and on whole documents that `seeds` paired seeds find with
    power 0.8 at Holm's strictest level, at the studies' spreads."""
    tests = sum(len(primary_endpoints(study, v)) for v in study.variants if v != "reference") * len(study.pos_embs)
    level = 0.05 / max(tests, 1)
    return {
        kind: stats.smallest_detectable(functools.partial(stats.paired_power, sd=sd, n=seeds, alpha=level), POWER, sd)
        for (p, kind), sd in STUDY_SPREADS.items()
        if p == pos
    }


def plan_lines(study: Study, base: Config, shards: Shards) -> list[str]:
    """What the comparison will run and can decide; a smoke test says so first."""
    ids = shards.vocab_size + int(base.bos)  # the start marker is the first id past the vocabulary
    parameters = {
        pos: parameter_count(model_settings(dataclasses.replace(base, pos_emb=pos), ids)) for pos in study.pos_embs
    }
    per_parameter = tokens_per_run(base) / max(parameters.values())
    runs = sum(len(seeds) for seeds in seeds_of_cells(study).values())
    lines = []
    if per_parameter < SMOKE_TOKENS_PER_PARAMETER:
        lines.append(
            f"smoke test: {per_parameter:.2f} tokens a parameter decide nothing; this checks that the comparison "
            "runs on your data (drop the smoke config for one that decides)"
        )
    lines.append(
        f"plan: {runs} runs of {base.max_iters:,} steps ({tokens_per_run(base) / 1e6:.2f}M tokens, "
        f"{per_parameter:.1f} tokens a parameter; {', '.join(f'{p} {n / 1e6:.2f}M' for p, n in parameters.items())} "
        f"parameters), {study.seeds} seeds, arms {', '.join(v for v in study.variants)}"
    )
    epochs = tokens_per_run(base) / max(len(shards.train), 1)
    if epochs > MOST_EPOCHS:
        lines.append(
            f"note: a run reads the training split {epochs:.1f} times ({len(shards.train) / 1e6:.2f}M tokens); beyond "
            f"{MOST_EPOCHS} epochs the effects include what repetition does (the studies stayed under 2)"
        )
    for pos in study.pos_embs:
        smallest = smallest_effects(study, pos, study.seeds)
        lines.append(
            f"power: with {study.seeds} seeds this comparison can decide effects of at least {smallest['early']:.3f} "
            f"nats on {endpoint_label('early', study).removesuffix(', alone')} and {smallest['whole']:.3f} on whole "
            f"documents ({pos}; power {POWER}, Holm; "
            "at the paired spreads measured on `packages`, results/decided/confirm_rung3/), if the models train as far"
        )
    return lines


def check_supports(base: Config, shards: Shards) -> None:
    """Refuse data too small to decide anything before any run trains."""
    val = leading_documents(shards.val, shards.eot_id, eval_token_budget(base))
    documents = int(np.count_nonzero(np.asarray(val) == shards.eot_id))
    if documents < FEWEST_VALIDATION_DOCUMENTS:
        raise DataError(
            f"the evaluation scores {documents} validation documents (eval_tokens and val_fraction decide it); a "
            f"comparison needs at least {FEWEST_VALIDATION_DOCUMENTS}: raise --val_fraction or --eval_tokens, or "
            "give more documents"
        )


# ----------------------------------------------------------------------------------------------
# Training: the runs, `workers` at a time


def train_runs(config: str, rest: list[str], command: list[str], workers: int, out: Path) -> int:
    """ablate.main in this process, and the same study in workers - 1 background processes that share its
    runs (a run is trained by the first process to reach it). A stop or a failure here stops them too, each
    with its checkpoint saved."""
    helpers = []
    for n in range(2, workers + 1):
        with (out / f"worker{n}.log").open("a") as log:  # the child holds its own copy of the file
            helpers.append(
                subprocess.Popen([sys.executable, "-m", "studies.ablate", config, *rest], stdout=log, stderr=log)
            )
        print(f"worker {n} trains in the background: {out / f'worker{n}.log'}", flush=True)
    code = 1
    try:
        code = ablate.main([config, *rest], command=command, echo_report=False)
    finally:
        for helper in helpers:
            if code != 0 and helper.poll() is None:
                helper.send_signal(signal.SIGINT)
            helper.wait()
    failed = [h.returncode for h in helpers if h.returncode not in (0, None)]
    return code or (failed[0] if failed else 0)


def default_workers(base: Config, study: Study) -> int:
    """One a CPU core for one-thread runs on the CPU, else one."""
    if study.threads != 1 or resolve_device(base.device).type != "cpu":
        return 1
    return max(1, min(os.cpu_count() or 1, run_count(study)))


def run_count(study: Study) -> int:
    return sum(len(seeds) for seeds in seeds_of_cells(study).values())


# ----------------------------------------------------------------------------------------------
# After training: how far the models trained, the table, the figure


def training_extent(saved: dict, out: Path, unigram: float) -> dict:
    """How far the reference trained: tokens, tokens a parameter, its loss against the unigram loss."""
    cfg = saved["config"]
    tokens = cfg["max_iters"] * cfg["batch_size"] * cfg["grad_accum"] * cfg["seq_len"]
    parameters = {pos: count_parameters(out / pos / "reference") for pos in saved["runs"]}
    reference = [r["val_doc_loss"] for pos in saved["runs"] for r in saved["runs"][pos]["reference"].values()]
    loss = float(np.mean(reference))
    per_parameter = tokens / max(parameters.values())
    well = per_parameter >= WELL_TRAINED_TOKENS_PER_PARAMETER and loss <= unigram - WELL_TRAINED_NATS_UNDER_UNIGRAM
    return {
        "tokens": tokens,
        "parameters": parameters,
        "tokens_per_parameter": per_parameter,
        "reference_loss": loss,
        "unigram_loss": unigram,
        "well_trained": well,
        "smoke": per_parameter < SMOKE_TOKENS_PER_PARAMETER,
    }


def count_parameters(cell: Path) -> int:
    """Parameters of a cell's model (tied embeddings counted once), from any of its checkpoints."""
    checkpoint = next(cell.glob("seed*/ckpt.pt"), None)
    if checkpoint is None:
        raise ConfigError(f"{cell} holds no run's ckpt.pt to count the model's parameters from")
    state = read_checkpoint(checkpoint)
    return sample.trained_model(state, torch.device("cpu")).num_params()


def verdict_words(effect: dict, extent: dict) -> str:
    """What the study decided about an effect, as the table says it."""
    if extent.get("smoke"):
        return "not decided (smoke test)"
    if effect.get("role") != "primary":
        return "not tested (secondary)"
    verdict = effect.get("verdict", "unresolved")
    if verdict == "negligible" and not extent["well_trained"]:
        verdict = "unresolved"  # equivalence shown on a barely trained model says nothing of a trained one
    return DECIDED.get(verdict, "not decided")


def effect_text(effect: dict | None) -> str:
    if effect is None:
        return ""
    low, high = effect["ci95"]
    return f"{effect['estimate']:+.3f} [{low:+.3f}, {high:+.3f}]"


def summary_table(saved: dict, extent: dict) -> str:
    """The short table: one line a position kind, arm and endpoint, nats a token and bits a byte, in the
    words of the figures (report.endpoint_label)."""
    study = settings_from(Study, saved["study"], "python -m studies.ablate --help")
    tests = sum(e.get("role") == "primary" for cell in saved["summary"].values() for e in cell["endpoints"].values())
    lines = [
        f"{'positions':9} {'arm':9} {'scored on':28} {'nats a token [95% interval]':29} "
        f"{'bits a byte [95% interval]':29} verdict (Holm over {tests})"
    ]
    for pos in saved["runs"]:
        for variant in (v for v in saved["runs"][pos] if v != "reference"):
            found = saved["summary"].get(f"{pos}/{variant}", {}).get("endpoints", {})
            for endpoint, bpb in ENDPOINTS.items():
                if endpoint in found:
                    where = endpoint_label(endpoint, study)
                    nats, bits = effect_text(found[endpoint]), effect_text(found.get(bpb))
                    arm = ARM_NAMES.get(variant, variant)
                    verdict = verdict_words(found[endpoint], extent)
                    lines.append(f"{pos:9} {arm:9} {where:28} {nats:29} {bits:29} {verdict}")
    return "\n".join(lines)


def extent_lines(extent: dict) -> list[str]:
    words = "trained enough to call an effect negligible" if extent["well_trained"] else "barely trained"
    return [
        f"trained: {extent['tokens'] / 1e6:.2f}M tokens a run, {extent['tokens_per_parameter']:.1f} tokens a parameter "
        f"({', '.join(f'{pos} {n / 1e6:.2f}M' for pos, n in extent['parameters'].items())} parameters)",
        f"the reference's loss {extent['reference_loss']:.3f} against {extent['unigram_loss']:.3f} for a unigram "
        f"model: {words} (at least {WELL_TRAINED_TOKENS_PER_PARAMETER} tokens a parameter and "
        f"{WELL_TRAINED_NATS_UNDER_UNIGRAM:.0f} nat under the unigram loss)",
        "effects: an arm's loss minus careful packing's, paired by seed; intervals are unadjusted, verdicts "
        "Holm-adjusted (an interval clear of 0 can still be 'not decided')",
    ]


FEWEST_DOCUMENTS_A_BIN = 30  # bins resting on fewer documents are drawn dotted and faded


def plot_by_position(saved: dict, path: Path) -> None:
    """Loss by position in the document (validation documents alone, in bins that double: 0, 1, 2-3,
    4-7, ...), mean over seeds with its 95% interval, one panel a position kind; under each bin, how many
    documents reach it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(saved["runs"])
    figure, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False, sharey=True)
    for ax, pos in zip(axes[0], kinds):
        for variant, runs in saved["runs"][pos].items():
            counts = next(iter(runs.values()))["val_doc_count_by_position"]
            edges = position_bins(len(counts))
            documents = np.array([counts[first] for first in edges[:-1]])
            curves = np.array([binned_loss(r, edges) for r in runs.values()])
            mean, x = np.nanmean(curves, axis=0), np.array(edges[:-1]) + 1
            few = documents < FEWEST_DOCUMENTS_A_BIN
            line = ax.plot(x, np.where(few, np.nan, mean), marker="o", markersize=3, linewidth=1.2)[0]
            line.set_label(LABELS.get(variant, variant))
            last = np.flatnonzero(~few)[-1:]  # the dotted tail starts at the last solid point
            tail = few.copy()
            tail[last] = True
            ax.plot(x[tail], mean[tail], linestyle=":", color=line.get_color(), alpha=0.45, marker="o", markersize=2)
            if len(curves) > 1:
                sem = np.nanstd(curves, axis=0, ddof=1) / math.sqrt(len(curves))
                half = stats.t_quantile(0.975, len(curves) - 1) * sem
                ax.fill_between(x, mean - half, mean + half, alpha=0.2, color=line.get_color())
        ax.set_xscale("log")
        ax.set_xticks(x, [f"{e + 1}\n{n}" for e, n in zip(edges, documents)], fontsize=7)
        ax.minorticks_off()
        ax.set_title(f"{pos} positions")
        ax.set_xlabel(f"position in the document + 1 / documents reaching it (dotted: under {FEWEST_DOCUMENTS_A_BIN})")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss, alone (nats a token)")
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)


def binned_loss(result: dict, edges: list[int]) -> list[float]:
    """A run's token-weighted loss in each bin [edges[i], edges[i + 1]); NaN where nothing was scored."""
    losses = [band_loss(result, [first, stop]) for first, stop in zip(edges, edges[1:])]
    return [np.nan if loss is None else loss for loss in losses]


def position_bins(positions: int) -> list[int]:
    """Edges 0, 1, 2, 4, 8, ... up to `positions`."""
    edges = [0, 1]
    while edges[-1] < positions:
        edges.append(min(2 * edges[-1], positions))
    return edges


def longer_run_hint(extent: dict) -> str:
    if extent["well_trained"]:
        return ""
    if extent["smoke"]:
        return (
            "the smoke test ran; the comparison that decides: python -m studies.compare --dataset=... (about an "
            "hour on 2 CPU cores)"
        )
    factor = math.ceil(WELL_TRAINED_TOKENS_PER_PARAMETER / max(extent["tokens_per_parameter"], 1e-9))
    return (
        f"to decide smaller effects, train at least {factor}x longer (--max_iters=...; the default config trains "
        f"{WELL_TRAINED_TOKENS_PER_PARAMETER}+ tokens a parameter), or on one GPU: "
        "python -m studies.compare configs/compare_gpu.toml --dataset=... (never yet run on a GPU)"
    )


# ----------------------------------------------------------------------------------------------
# The command


def prepared(config: str, rest: list[str]) -> tuple[Study, Config, list[str], Shards, Path]:
    """The checked settings, the study's own folder (one a prepared dataset) and its prepared data."""
    study, base = parse_args([config, *rest])
    if "reference" not in study.variants:
        raise ConfigError(f"variants={study.variants}: give the reference too, every effect is against it")
    check_against(study, base)  # as the study checks it, but before the data is prepared to name its folder
    shard_path = prepare_for(base)
    if not any(a.startswith("--out_dir=") for a in rest):  # a folder of its own for each prepared dataset
        rest = [*rest, f"--out_dir={Path(study.out_dir) / shard_path.name}"]
        study, base = parse_args([config, *rest])
    shards = load_shards(shard_path)
    check_supports(base, shards)
    return study, base, rest, shards, shard_path


def report(study: Study, shard_path: Path) -> tuple[dict, dict, Path]:
    """The study's saved results, how far its models trained, and its figure drawn."""
    out = Path(study.out_dir)
    saved = json.loads((out / "results.json").read_text())
    extent = training_extent(saved, out, unigram_loss(shard_path))
    plot_by_position(saved, out / "by_position.png")
    return saved, extent, out


def worker_count(given: list[str], base: Config, study: Study) -> int:
    if not given:
        return default_workers(base, study)
    try:
        count = int(given[-1].split("=", 1)[1])
    except ValueError:
        raise ConfigError(f"{given[-1]}: expected a whole number of processes") from None
    if count < 1 or (count > 1 and study.threads != 1):
        raise ConfigError(
            f"workers={count}: give at least 1, and more than 1 only with threads=1 (each run one thread)"
        )
    if count > (runs := run_count(study)):
        raise ConfigError(f"workers={count}: the comparison has {runs} runs, so at most {runs} processes can train")
    return count


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    started = time.time()
    config, rest = (argv[0], argv[1:]) if argv and not argv[0].startswith("--") else (str(DEFAULT_CONFIG), argv)
    given = [a for a in rest if a.startswith("--workers=")]
    rest = [a for a in rest if a not in given]
    try:
        study, base, rest, shards, shard_path = prepared(config, rest)
        workers = worker_count(given, base, study)
        check_writable_folder(Path(study.out_dir), "out_dir")
        print("\n".join(plan_lines(study, base, shards)), flush=True)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    code = train_runs(config, rest, ["python", "-m", "studies.compare", *argv], workers, Path(study.out_dir))
    if code != 0:
        return code
    try:
        saved, extent, out = report(study, shard_path)
    except (ConfigError, SaveFailed, OSError, ValueError) as e:  # SaveFailed: the figure, on a full disk
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n" + "\n".join(extent_lines(extent)))
    print(summary_table(saved, extent))
    hint = longer_run_hint(extent)
    print(
        f"\nthe figure: {out / 'by_position.png'}; every endpoint: {out / 'results.md'}" + (f"\n{hint}" if hint else "")
    )
    print(f"this command took {format_duration(time.time() - started)}, {workers} process(es) training")
    return 0


if __name__ == "__main__":
    run_main(main)
