"""Does packing care matter on your data? One command, minutes on a 2-core CPU:

    python -m studies.compare --dataset=stdlib              # the built-in corpus
    python -m studies.compare --dataset=my_corpus/          # any dataset train.py accepts
    python -m studies.compare --dataset=my_corpus/ --max_iters=4500 --warmup_iters=300   # trained further
    python -m studies.compare configs/compare_gpu.toml --dataset=my_corpus/   # one GPU (never yet run on one)

It trains the reference (document mask, position reset and boundary loss mask on, each document opened by
its start marker) against the document mask off and naive packing (all three off), with learned and RoPE
positions, on 3 seeds (configs/compare.toml; any train.py or [ablate] key can be given as --key=value).
Each effect is paired by seed: the variant's loss minus the reference's, positive where the fix helps.

It prints how far the models trained (tokens a parameter, their loss against a unigram model's), a short
table (the loss at positions 0-15 of each validation document, and over whole documents from their second
token; each effect with its 95% interval and whether the study decided it, Holm over the 8 tests), and
draws the loss by position in the document for each arm (by_position.png). The full report, with every
endpoint, is results.md beside it. Barely trained models decide nothing about small effects: the table then
calls no effect negligible. Finished runs are kept: the same command continues or re-reports.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

import sample
from cli import run_main
from errors import ConfigError, DataError, SaveFailed
from prepare import prepare_for
from run.checkpoint import read_checkpoint
from shards import load_shards
from studies import ablate, stats
from studies.plan import check_against, parse_args
from studies.report import band_loss, save_figure

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "compare.toml"
ARMS = {"no_doc_mask": "mask off", "naive": "naive"}
LABELS = {"reference": "reference (every fix on)", "no_doc_mask": "document mask off", "naive": "naive (all three off)"}
ENDPOINTS = {"early": "positions 0-15", "from_second": "whole documents"}
# Below these the models are barely trained (an effect of the mask grew 10x from 0.6 to 5.8 tokens a
# parameter in the ladder, results/ladder/): half of Chinchilla's 20 tokens a parameter (Hoffmann et al.
# 2022, arXiv 2203.15556), and a loss at least 1 nat under a unigram model's
WELL_TRAINED_TOKENS_PER_PARAMETER = 10
WELL_TRAINED_NATS_UNDER_UNIGRAM = 1.0
# a variant that raises the loss ("hurts", in stats.py's words) means the fix it turns off helps
DECIDED = {"hurts": "decided: the fix helps", "helps": "decided: the fix hurts", "negligible": "decided: negligible"}


def unigram_loss(shard_path: Path) -> float:
    """The validation loss of a model that predicts every token by its training frequency (add-one
    smoothed): the loss a language model must get well under to have learned more than token counts."""
    shards = load_shards(shard_path)
    counts = np.bincount(np.asarray(shards.train), minlength=shards.vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[np.asarray(shards.val)].mean())


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
    }


def count_parameters(cell: Path) -> int:
    """Parameters of a cell's model (tied embeddings counted once), from any of its checkpoints."""
    checkpoint = next(cell.glob("seed*/ckpt.pt"), None)
    if checkpoint is None:
        raise ConfigError(f"{cell} holds no run's ckpt.pt to count the model's parameters from")
    state = read_checkpoint(checkpoint)
    return sample.trained_model(state, torch.device("cpu")).num_params()


def verdict_line(effect: dict, extent: dict) -> str:
    """An effect as the table shows it: estimate, 95% interval, and what the study decided."""
    low, high = effect["ci95"]
    verdict = effect.get("verdict", "unresolved")
    if verdict == "negligible" and not extent["well_trained"]:
        verdict = "unresolved"  # equivalence shown on a barely trained model says nothing of a trained one
    return f"{effect['estimate']:+.3f} [{low:+.3f}, {high:+.3f}]{'':10} {DECIDED.get(verdict, 'not decided')}"


def summary_table(saved: dict, extent: dict) -> str:
    """The short table: one line a position kind, arm and endpoint. Arms: the document mask off, and naive
    packing (all three fixes off); whole documents are scored from their second token."""
    tests = sum(e.get("role") == "primary" for cell in saved["summary"].values() for e in cell["endpoints"].values())
    lines = [
        f"{'positions':9} {'arm':8} {'scored on':16} {'effect [95% interval], nats':33} verdict (Holm over {tests})"
    ]
    for pos in saved["runs"]:
        for arm, name in ARMS.items():
            cell = saved["summary"].get(f"{pos}/{arm}")
            for endpoint, where in ENDPOINTS.items() if cell else ():
                lines.append(f"{pos:9} {name:8} {where:16} {verdict_line(cell['endpoints'][endpoint], extent)}")
    return "\n".join(lines)


def extent_lines(extent: dict) -> list[str]:
    words = "trained enough to call an effect negligible" if extent["well_trained"] else "barely trained"
    return [
        f"trained: {extent['tokens'] / 1e6:.2f}M tokens a run, {extent['tokens_per_parameter']:.1f} tokens a parameter "
        f"({', '.join(f'{pos} {n / 1e6:.2f}M' for pos, n in extent['parameters'].items())} parameters)",
        f"the reference's loss {extent['reference_loss']:.3f} against {extent['unigram_loss']:.3f} for a unigram "
        f"model: {words} (at least {WELL_TRAINED_TOKENS_PER_PARAMETER} tokens a parameter and "
        f"{WELL_TRAINED_NATS_UNDER_UNIGRAM:.0f} nat under the unigram loss)",
    ]


def plot_by_position(saved: dict, path: Path) -> None:
    """Loss by position in the document (validation documents alone, in bins that double: 0, 1, 2-3,
    4-7, ...), mean over seeds with its 95% interval, one panel a position kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(saved["runs"])
    figure, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 3.8), squeeze=False, sharey=True)
    for ax, pos in zip(axes[0], kinds):
        for variant, runs in saved["runs"][pos].items():
            edges = position_bins(len(next(iter(runs.values()))["val_doc_count_by_position"]))
            curves = np.array([binned_loss(r, edges) for r in runs.values()])
            mean, x = np.nanmean(curves, axis=0), np.array(edges[:-1]) + 1
            ax.plot(x, mean, marker="o", markersize=3, label=LABELS.get(variant, variant), linewidth=1.2)
            if len(curves) > 1:
                sem = np.nanstd(curves, axis=0, ddof=1) / math.sqrt(len(curves))
                half = stats.t_quantile(0.975, len(curves) - 1) * sem
                ax.fill_between(x, mean - half, mean + half, alpha=0.2)
        ax.set_xscale("log")
        ax.set_title(f"{pos} positions")
        ax.set_xlabel("position in the document + 1 (each bin up to the next point)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (nats)")
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
    factor = math.ceil(WELL_TRAINED_TOKENS_PER_PARAMETER / max(extent["tokens_per_parameter"], 1e-9))
    return (
        f"to decide smaller effects, train at least {factor}x longer (e.g. --max_iters=4500 --warmup_iters=300: "
        "9.2M tokens a run, the ladder's longest), or on one GPU: "
        f"python -m studies.compare configs/compare_gpu.toml --dataset=... (never yet run on a GPU)"
    )


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    config, rest = (argv[0], argv[1:]) if argv and not argv[0].startswith("--") else (str(DEFAULT_CONFIG), argv)
    try:
        study, base = parse_args([config, *rest])
        if "reference" not in study.variants:
            raise ConfigError(f"variants={study.variants}: give the reference too, every effect is against it")
        check_against(study, base)  # as the study checks it, but before the data is prepared to name its folder
        if not any(a.startswith("--out_dir=") for a in rest):  # a folder of its own for each prepared dataset
            rest = [*rest, f"--out_dir={Path(study.out_dir) / prepare_for(base).name}"]
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    code = ablate.main([config, *rest], command=["python", "-m", "studies.compare", *argv])
    if code != 0:
        return code
    try:
        study, base = parse_args([config, *rest])
        out = Path(study.out_dir)
        saved = json.loads((out / "results.json").read_text())
        extent = training_extent(saved, out, unigram_loss(prepare_for(base)))
        plot_by_position(saved, out / "by_position.png")
    except (ConfigError, SaveFailed, OSError, ValueError) as e:  # SaveFailed: the figure, on a full disk
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n" + "\n".join(extent_lines(extent)))
    print(summary_table(saved, extent))
    hint = longer_run_hint(extent)
    print(f"\nwrote {out / 'by_position.png'} and {out / 'results.md'}" + (f"\n{hint}" if hint else ""))
    return 0


if __name__ == "__main__":
    run_main(main)
