"""Controlled ablations of the three flags: every variant x position kind x seed, then a table and figures.

    python ablate.py configs/ablate_cpu.toml               # a 2-core CPU, under an hour
    python ablate.py configs/ablate_gpu.toml               # one GPU
    python ablate.py configs/ablate_cpu.toml --seeds=5 --max_iters=400 --n_layer=6
    python ablate.py configs/import_leak_cpu.toml          # the import-leak study, 2-core CPU

The config file holds train.py keys plus an [ablate] table (seeds, out_dir, the position kinds and
variants to run, probe settings, and import_leak = true to run the import-leak probe of import_leak.py
on every run); any train.py key or --seeds can be overridden after it. Every run of a study uses the
same data order, model init and number of real (non-padding) training tokens; only the variant's
settings differ, and a run's seed sets both init and data order, so differences are paired by seed.
Finished runs are skipped, so an interrupted study continues where it stopped.

Pad is run twice: `pad` sees as many real tokens as a packed run (more steps), `pad_equal_compute` as
many steps and rows (the same FLOPs, fewer real tokens). Each effect (the paired difference to the
reference, the offset probe's effect, the contamination) gets a 95% confidence interval over seeds and a
verdict: "hurts", "helps", "no effect" (the interval within +-0.01 nats) or "unresolved".

Written to the study's out_dir: results.md (the table), results.json (every number in it, per run
too), val_loss.png, loss_by_position.png, offset_probe.png, and import_leak.png with the leak probe.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import data
import import_leak
import run_infra
import train
from config import RESUMABLE_CHANGES, Config, ConfigError, parse_config, read_config_file, resolve_device
from data import IGNORE_INDEX
from model import GPT
from stats import NO_EFFECT, confidence_interval, mean_spread, verdict

POSITION_KINDS = ("learned", "rope")
VARIANTS = {  # name: the train.py settings it changes from the reference
    "reference": {},
    "no_doc_mask": {"doc_mask": False},
    "no_reset_position_ids": {"reset_position_ids": False},
    "no_mask_boundary_loss": {"mask_boundary_loss": False},
    "naive": {"doc_mask": False, "reset_position_ids": False, "mask_boundary_loss": False},
    "pad": {"packing": "pad"},  # as many real tokens as a packed run: more steps
    "pad_equal_compute": {"packing": "pad"},  # as many steps and rows as a packed run: fewer real tokens
}
# probe_offsets: k values of the offset probe; 0 and seq_len / 2 are always added. import_leak: run the
# import-leak probe (import_leak.py) on every run, with up to leak_pairs pairs; it needs whole Python files.
ABLATE_DEFAULTS = {
    "seeds": 3,
    "out_dir": "out/ablate",
    "pos_embs": list(POSITION_KINDS),
    "variants": list(VARIANTS),
    "probe_docs": 64,
    "probe_offsets": [64],
    "import_leak": False,
    "leak_pairs": 64,
}


# ----------------------------------------------------------------------------------------------
# Configuration


def parse_args(argv: list[str]) -> tuple[dict, list[str]]:
    """(ablate settings, train.py arguments) from a TOML file and --key=value overrides."""
    if not argv or argv[0].startswith("--"):
        raise ConfigError("usage: python ablate.py CONFIG.toml [--seeds=N] [--train_key=value ...]")
    values = read_config_file(Path(argv[0]))
    table = values.pop("ablate", {})
    if not isinstance(table, dict):
        raise ConfigError(f"[ablate] must be a table, got {table!r}")
    settings = {**ABLATE_DEFAULTS, **table}
    unknown = set(settings) - set(ABLATE_DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown [ablate] key(s) {', '.join(sorted(unknown))}; valid: {', '.join(ABLATE_DEFAULTS)}")
    train_args = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]
    for arg in argv[1:]:
        key = arg[2:].split("=", 1)[0]
        if key in ("seeds", "out_dir", "probe_docs") and "=" in arg:
            settings[key] = arg.split("=", 1)[1]
        else:
            train_args.append(arg)
    check_settings(settings)
    parse_config(train_args)  # fails early, with train.py's messages, on a bad key or value
    return settings, train_args


def check_settings(settings: dict) -> None:
    """Each [ablate] value of the type it must have (numbers may come as text from the command line)."""

    def whole(value) -> int | None:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return int(value) if isinstance(value, str) and value.strip().lstrip("-").isdigit() else None

    for key, what in (
        ("seeds", "a whole number of seeds"),
        ("probe_docs", "a whole number of documents"),
        ("leak_pairs", "a whole number of pairs"),
    ):
        number = whole(settings[key])
        if number is None:
            raise ConfigError(f"{key}={settings[key]!r}: expected {what}")
        if number < 1:
            raise ConfigError(f"{key}={number}: must be at least 1")
        settings[key] = number
    offsets = settings["probe_offsets"]
    if not isinstance(offsets, list) or not all(whole(k) is not None and whole(k) >= 1 for k in offsets):
        raise ConfigError(f"probe_offsets={offsets!r}: expected a list of token counts, each at least 1")
    if not isinstance(settings["out_dir"], str) or not settings["out_dir"].strip():
        raise ConfigError(f"out_dir={settings['out_dir']!r}: expected a folder name")
    for key, valid in (("pos_embs", POSITION_KINDS), ("variants", tuple(VARIANTS))):
        chosen = settings[key]
        if not isinstance(chosen, list) or not chosen or not set(chosen) <= set(valid):
            raise ConfigError(f"{key}={chosen!r}: expected a list of some of {', '.join(valid)}")
        settings[key] = [v for v in valid if v in chosen]  # in the table's order
    if "reference" not in settings["variants"]:
        raise ConfigError("variants must include reference: every effect is measured against it")
    if not isinstance(settings["import_leak"], bool):
        raise ConfigError(f"import_leak={settings['import_leak']!r}: expected true or false")


def pad_steps_factor(cfg: Config) -> float:
    """How many more steps a pad run needs to see as many real tokens as a packed run."""
    shards = data.load_shards(train.prepare_data(cfg))
    _, n_real, _ = data.pad_rows(shards.train, shards.eot_id, cfg.seq_len)
    return cfg.seq_len / float(np.minimum(n_real, cfg.seq_len).mean())


def run_config(train_args: list[str], pos_emb: str, variant: str, seed: int, out_dir: Path, pad_factor: float):
    overrides = {"pos_emb": pos_emb, "seed": seed, "out_dir": out_dir, "sample_tokens": 0, **VARIANTS[variant]}
    cfg = parse_config(
        train_args + [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()]
    )
    if variant == "pad":  # the same real training tokens: more steps, with the schedule stretched to match
        # (pad_equal_compute keeps the packed run's steps: the same FLOPs, fewer real tokens)
        for key in ("max_iters", "warmup_iters", "eval_interval"):
            setattr(cfg, key, max(1, round(getattr(cfg, key) * pad_factor)))
    return cfg


# ----------------------------------------------------------------------------------------------
# Probes: the same validation documents, placed in a row in different ways, under the run's own settings.


def leading_stream(val: data.TokenStream, eot_id: int, n_docs: int, seq_len: int) -> np.ndarray:
    """The start of the validation split, long enough for the probes: twice n_docs whole documents and
    more (the documents, then filler and unrelated ones), read without scanning the whole split."""
    n = (n_docs + 2) * seq_len
    while True:
        head = val[:n]
        if n >= len(val) or (np.count_nonzero(head == eot_id) > 2 * n_docs + 2 and n >= 4 * (n_docs + 2) * seq_len):
            return head
        n *= 2


def probe_documents(val: np.ndarray, eot_id: int, n_docs: int, window: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The first n_docs validation documents (their first `window` tokens plus one), and a stream of
    later ones to fill rows with."""
    ends = np.flatnonzero(val == eot_id) + 1
    starts = np.concatenate([[0], ends[:-1]])
    docs = [val[s : min(e, s + window + 1)].astype(np.int64) for s, e in zip(starts, ends) if e - s >= 2]
    if len(docs) < n_docs + 2:
        raise data.DataError(
            f"the validation split has {len(docs)} documents where the probes look; they need {n_docs + 2}: "
            "lower probe_docs or raise val_fraction"
        )
    filler = val[starts[n_docs] :].astype(np.int64)
    return docs[:n_docs], filler


def doc_loss_in_rows(
    model: GPT, cfg: Config, eot_id: int, prefixes: list[np.ndarray], docs: list[np.ndarray], device: torch.device
) -> float:
    """Mean loss over the documents' own targets, each document after its prefix in one row, with the
    run's position and loss settings (its doc_mask is in the model)."""
    total, count = 0.0, 0
    for i in range(0, len(docs), 32):
        rows = [np.concatenate([p, d]) for p, d in zip(prefixes[i : i + 32], docs[i : i + 32])]
        b = data.batch_of_rows(rows, cfg.seq_len, eot_id, flags=cfg.flags)
        own = torch.zeros_like(b.targets, dtype=torch.bool)
        for r, (p, d) in enumerate(zip(prefixes[i : i + 32], docs[i : i + 32])):
            own[r, len(p) : len(p) + len(d) - 1] = True  # targets inside the document, predicted from it
        b = b.to(device)
        b.targets = b.targets.masked_fill(~own.to(device), IGNORE_INDEX)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            losses, counted = train.token_losses(model, b, model.config)
        total += losses.sum().item()
        count += int(counted.sum())
    return total / count


def probe_inputs(
    shards: data.Shards, n_docs: int, seq_len: int, offsets: list[int]
) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]:
    """The probe documents, the filler stream, and one unrelated document for each probe document (cut to
    the space the offsets leave, keeping its EOT); a DataError when the validation split is too small."""
    head = leading_stream(shards.val, shards.eot_id, n_docs, seq_len)
    docs, filler = probe_documents(head, shards.eot_id, n_docs, seq_len - max(offsets))
    other_docs, _ = probe_documents(filler, shards.eot_id, len(docs), max(offsets) - 1)
    unrelated = [d if d[-1] == shards.eot_id else np.append(d[:-1], shards.eot_id) for d in other_docs]
    return docs, filler, unrelated


def run_probes(out_dir: Path, cfg: Config, n_docs: int, offsets: list[int]) -> dict:
    device = resolve_device(cfg.device)
    model, _, checkpoint = run_infra.load_run(out_dir, device)
    shards = data.load_shards(Path(checkpoint["shards"]))
    docs, filler, unrelated = probe_inputs(shards, n_docs, cfg.seq_len, offsets)
    offset_loss = {}
    for k in offsets:  # k tokens of other documents first, the last of them an EOT
        prefixes = [
            np.append(filler[i * k : i * k + k - 1], shards.eot_id) if k else filler[:0] for i in range(len(docs))
        ]
        offset_loss[str(k)] = doc_loss_in_rows(model, cfg, shards.eot_id, prefixes, docs, device)
    after_other = doc_loss_in_rows(model, cfg, shards.eot_id, unrelated, docs, device)
    return {"offset_loss": offset_loss, "contamination": after_other - offset_loss["0"]}


# ----------------------------------------------------------------------------------------------
# Running the grid


def run_one(cfg: Config, settings: dict) -> dict:
    out = Path(cfg.out_dir)
    done = out / "result.json"
    # what decides a run's result: the training settings a resume may not change, and the probes
    decided_by = {
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUMABLE_CHANGES},
        "probes": {k: settings[k] for k in ("probe_docs", "probe_offsets", "import_leak", "leak_pairs")},
    }
    if done.exists():
        result = json.loads(done.read_text())
        if result.pop("decided_by", None) != decided_by:
            raise ConfigError(
                f"{done} was computed with other settings than this study's: give the study another out_dir, "
                f"or delete {settings['out_dir']} to run it again"
            )
        return result
    cfg.resume = (out / "ckpt.pt").exists()  # a run interrupted earlier continues from its checkpoint
    train.train(cfg)
    if run_infra.read_checkpoint(out / "ckpt.pt")["step"] != cfg.max_iters:
        raise StudyStopped(f"stopped during {out}; run the same command again to continue the study")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "train_loss" in r]
    evals = [r for r in records if "val_doc_loss" in r]
    result = {
        "val_doc_loss": evals[-1]["val_doc_loss"],
        "val_loss": evals[-1]["val_loss"],
        "val_doc_loss_by_position": evals[-1]["val_doc_loss_by_position"],
        "curve": [(r["step"], r["val_doc_loss"]) for r in evals],
        "wall_seconds": training_seconds(train_records, cfg.batch_size * cfg.grad_accum * cfg.seq_len),
        "useful_tokens_per_sec": float(np.mean([r["counted_tokens_per_sec"] for r in train_records])),
        "steps": cfg.max_iters,
        **run_probes(out, cfg, settings["probe_docs"], settings["probe_offsets"]),
    }
    if settings["import_leak"]:
        result["import_leak"] = import_leak.probe_run(out, resolve_device(cfg.device), settings["leak_pairs"])
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps({**result, "decided_by": decided_by}))
    os.replace(tmp, done)  # a run counts as finished only once its probes are written
    return result


def training_seconds(train_records: list[dict], tokens_per_step: int) -> float:
    """Time spent in training steps (evaluations excluded), from the logged rates, so that a run
    resumed after an interruption is timed like one that was not."""
    steps = np.diff([0] + [r["step"] for r in train_records])
    return float(sum(n * tokens_per_step / r["tokens_per_sec"] for n, r in zip(steps, train_records)))


class StudyStopped(Exception):
    pass


# The loss verdicts in the words of the leak: a positive change is more leak.
LEAK_VERDICTS = {"hurts": "leaks", "helps": "below alone", "no effect": "no leak"}


def summarise(runs: dict, offsets: list[int]) -> dict:
    """Per (position kind, variant): mean and spread of each metric; and, each with its 95% confidence
    interval and verdict, the paired (same seed) difference to the reference, the offset effect (the
    probe documents' loss after the longest offset minus alone), the contamination and, where it ran,
    the import leak (log-prob change of "import m" with one file before, sampled leak rate change)."""
    summary = {}
    for pos in runs:
        for variant in runs[pos]:
            cell = runs[pos][variant]
            ref = runs[pos]["reference"]
            seeds = sorted(cell)
            metrics = {
                "val_doc_loss": [cell[s]["val_doc_loss"] for s in seeds],
                "val_loss": [cell[s]["val_loss"] for s in seeds],
                "contamination": [cell[s]["contamination"] for s in seeds],
                "wall_seconds": [cell[s]["wall_seconds"] for s in seeds],
                "useful_tokens_per_sec": [cell[s]["useful_tokens_per_sec"] for s in seeds],
                **{f"offset_{k}": [cell[s]["offset_loss"][str(k)] for s in seeds] for k in offsets},
            }
            entry = {name: mean_spread(values) for name, values in metrics.items()}
            effects = {
                "delta_val_doc_loss": [cell[s]["val_doc_loss"] - ref[s]["val_doc_loss"] for s in seeds],
                "offset_effect": [
                    cell[s]["offset_loss"][str(max(offsets))] - cell[s]["offset_loss"]["0"] for s in seeds
                ],
                "contamination": metrics["contamination"],
            }
            if all("import_leak" in cell[s] for s in seeds):
                effects["leak_logprob"] = [
                    cell[s]["import_leak"]["logprob"]["k=1,extra=0"]["delta_logprob"] for s in seeds
                ]
                effects["leak_rate"] = [cell[s]["import_leak"]["sampling"]["difference"] for s in seeds]
                for key in cell[seeds[0]]["import_leak"]["logprob"]:
                    deltas = [cell[s]["import_leak"]["logprob"][key]["delta_logprob"] for s in seeds]
                    entry[f"leak_logprob_{key}"] = mean_spread(deltas) if None not in deltas else None
            for name, values in effects.items():
                interval = confidence_interval(values)
                entry[name] = mean_spread(values)
                entry[f"{name}_ci95"] = [x if math.isfinite(x) else None for x in interval]
                entry[f"{name}_verdict"] = (LEAK_VERDICTS if name.startswith("leak") else {}).get(
                    verdict(interval), verdict(interval)
                )
            if variant == "reference":
                entry["delta_val_doc_loss_verdict"] = "-"  # the reference against itself
            entry["seeds"] = len(seeds)
            summary[f"{pos}/{variant}"] = entry
    return summary


def environment() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        commit = (commit + ("+uncommitted changes" if dirty else "")) or "unknown"
    except OSError:
        commit = "unknown"
    if torch.cuda.is_available():
        hardware = torch.cuda.get_device_name()
    else:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
        hardware = f"CPU: {names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return {
        "hardware": hardware,
        "torch": torch.__version__,
        "commit": commit,
        "command": "python " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def format_report(summary: dict, env: dict, settings: dict, offsets: list[int], cfg: Config) -> str:
    def ms(pair: tuple[float, float], digits: int = 3) -> str:
        return f"{pair[0]:.{digits}f} ± {pair[1]:.{digits}f}"

    def effect(entry: dict, name: str) -> str:
        low, high = entry[f"{name}_ci95"]
        interval = "" if low is None else f" [{low:+.3f}, {high:+.3f}]"
        return f"{entry[name][0]:+.3f}{interval} | {entry[f'{name}_verdict']}"

    offset_cols = " | ".join(f"offset {k}" for k in offsets)
    pad_factor = settings.get("pad_steps_factor")
    pad_text = ""
    if "pad" in settings["variants"] or "pad_equal_compute" in settings["variants"]:
        pad_text = (
            ". `pad`: as many real tokens "
            + (f"({pad_factor:.2f}x the steps; pad rows are {1 - 1 / pad_factor:.0%} padding)" if pad_factor else "")
            + ", `pad_equal_compute`: as many steps and rows, the same FLOPs"
        )
    lines = [
        "# Ablation results",
        "",
        f"- command: `{env['command']}`",
        f"- hardware: {env['hardware']}, torch {env['torch']}, commit {env['commit']}",
        f"- {settings['seeds']} seeds per cell (mean ± sample standard deviation; effects with their 95% "
        f"confidence interval over seeds, Student's t); each packed run {cfg.max_iters} steps of "
        f"{cfg.batch_size * cfg.grad_accum} x {cfg.seq_len} tokens{pad_text}",
        f"- model: {cfg.n_layer} layers, {cfg.n_embd} wide, {cfg.n_head} heads; data: {cfg.dataset}, "
        f"tokenizer {cfg.tokenizer} {cfg.tokenizer_vocab_size}",
        "",
        "`val_doc_loss`: each validation document alone from position 0 (the same for every run). "
        "`Δ ref`: paired by seed. `offset k`: the probe documents' loss after k tokens of other documents, "
        f"under the run's own settings; `offset effect`: offset {max(offsets)} minus offset 0. `contamination`: "
        "loss after one unrelated document minus loss alone. Verdicts: `hurts` / `helps` when the interval "
        f"excludes 0, `no effect` when it lies within ±{NO_EFFECT}, else `unresolved`.",
        "",
        f"| variant | val_doc_loss | Δ ref | verdict | val_loss (own packing) | {offset_cols} | offset effect "
        "| verdict | contamination | verdict | train wall s | useful tok/s |",
        "|" + " --- |" * (11 + len(offsets)),
    ]
    for key, entry in summary.items():
        offsets_text = " | ".join(ms(entry[f"offset_{k}"]) for k in offsets)
        lines.append(
            f"| {key} | {ms(entry['val_doc_loss'])} | {effect(entry, 'delta_val_doc_loss')} "
            f"| {ms(entry['val_loss'])} | {offsets_text} | {effect(entry, 'offset_effect')} "
            f"| {effect(entry, 'contamination')} | {entry['wall_seconds'][0]:.1f} "
            f"| {entry['useful_tokens_per_sec'][0]:,.0f} |"
        )
    leak_keys = [k for k in next(iter(summary.values())) if k.startswith("leak_logprob_k=")]
    if leak_keys:
        lines += [
            "",
            "## Import leak",
            "",
            "Pairs (A, B) of validation files where A imports a module m that B never mentions (import_leak.py). "
            "`Δ log P`: log-prob of `import m` / `from m import` at B's first import with A before B in the row, "
            "minus B alone. `Δ leak rate`: how much more often an import line sampled there names a module of A "
            "that B never uses. Verdicts: `leaks` when the interval (over seeds) lies above 0, `no leak` when "
            f"within ±{NO_EFFECT}, else `unresolved`. Then Δ log P by the number of files before B (each "
            "importing m) and the tokens of each kept after its import of m.",
            "",
            "| variant | Δ log P, 1 file | verdict | Δ leak rate | verdict | "
            + " | ".join(k.removeprefix("leak_logprob_").replace(",", ", ") for k in leak_keys)
            + " |",
            "|" + " --- |" * (5 + len(leak_keys)),
        ]
        for key, entry in summary.items():
            growth = " | ".join("" if entry[k] is None else ms(entry[k]) for k in leak_keys)
            lines.append(f"| {key} | {effect(entry, 'leak_logprob')} | {effect(entry, 'leak_rate')} | {growth} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict, offsets: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def per_variant(fn):
        fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), sharey=True, squeeze=False)
        axes = axes[0]
        for ax, pos in zip(axes, runs):
            for variant in runs[pos]:
                fn(ax, runs[pos][variant], variant)
            ax.set_title(f"pos_emb = {pos}")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        return fig, axes

    def curve(ax, cell, variant):
        steps = [s for s, _ in next(iter(cell.values()))["curve"]]
        losses = np.array([[v for _, v in r["curve"]] for r in cell.values()])
        fraction = np.array(steps) / steps[-1]
        ax.errorbar(fraction, losses.mean(0), yerr=losses.std(0), label=variant, capsize=3)

    fig, axes = per_variant(curve)
    axes[0].set_xlabel("fraction of training (pad runs take more steps)")
    axes[0].set_ylabel("val_doc_loss")
    fig.savefig(out / "val_loss.png", dpi=110, bbox_inches="tight")

    def by_position(ax, cell, variant):
        n = min(len(r["val_doc_loss_by_position"]) for r in cell.values())
        loss = np.mean([r["val_doc_loss_by_position"][:n] for r in cell.values()], axis=0)
        edges = np.unique(np.geomspace(1, n, 16).astype(int))  # log-spaced bins: early positions matter most
        centers = [(a + b - 1) / 2 for a, b in zip(np.r_[0, edges[:-1]], edges)]
        ax.plot(
            centers, [loss[a:b].mean() for a, b in zip(np.r_[0, edges[:-1]], edges)], marker="o", ms=3, label=variant
        )
        ax.set_xscale("symlog")

    fig, axes = per_variant(by_position)
    axes[0].set_xlabel("position within the document")
    axes[0].set_ylabel("val_doc_loss")
    fig.savefig(out / "loss_by_position.png", dpi=110, bbox_inches="tight")

    def offset_probe(ax, cell, variant):
        losses = np.array([[r["offset_loss"][str(k)] for k in offsets] for r in cell.values()])
        ax.errorbar(offsets, losses.mean(0), yerr=losses.std(0), marker="o", capsize=3, label=variant)

    fig, axes = per_variant(offset_probe)
    axes[0].set_xlabel("tokens of other documents before the document (k)")
    axes[0].set_ylabel("loss on the document")
    fig.savefig(out / "offset_probe.png", dpi=110, bbox_inches="tight")

    def leak_growth(ax, cell, variant):
        logprob = [r["import_leak"]["logprob"] for r in cell.values()]
        for extra, style in zip(import_leak.EXTRA_TOKENS, ("-", "--")):
            ks = [k for k in import_leak.PRECEDING_FILES if logprob[0][f"k={k},extra={extra}"]["pairs"]]
            deltas = np.array([[lp[f"k={k},extra={extra}"]["delta_logprob"] for k in ks] for lp in logprob])
            label = f"{variant}, {extra} tokens after the import"
            ax.errorbar(ks, deltas.mean(0), yerr=deltas.std(0), ls=style, marker="o", capsize=3, label=label)

    if all("import_leak" in r for pos in runs for cell in runs[pos].values() for r in cell.values()):
        fig, axes = per_variant(leak_growth)
        axes[0].set_xlabel("files before B that import m")
        axes[0].set_xticks(import_leak.PRECEDING_FILES)
        axes[0].set_ylabel("Δ log P(import m) vs B alone (nats)")
        fig.savefig(out / "import_leak.png", dpi=110, bbox_inches="tight")
    plt.close("all")


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        settings, train_args = parse_args(argv)
        base = parse_config(train_args)
        offsets = sorted({int(k) for k in settings["probe_offsets"]} | {0, base.seq_len // 2})
        settings["probe_offsets"] = offsets
        if max(offsets) >= base.seq_len - 1:
            raise ConfigError(f"probe_offsets must be below seq_len - 1 = {base.seq_len - 1}")
        out = Path(settings["out_dir"])
        try:  # before any work: the study ends by writing its report here
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"out_dir {out} cannot be a folder ({e.strerror})") from None
        pad_factor = pad_steps_factor(base)
        # the probes run after each training run: a validation split too small for them fails here, first
        probe_inputs(data.load_shards(train.prepare_data(base)), settings["probe_docs"], base.seq_len, offsets)
        grid = [
            (pos, variant, seed)
            for pos in settings["pos_embs"]
            for variant in settings["variants"]
            for seed in range(settings["seeds"])
        ]
        runs: dict = {pos: {variant: {} for variant in settings["variants"]} for pos in settings["pos_embs"]}
        t0 = time.time()
        trained = 0
        for i, (pos, variant, seed) in enumerate(grid):
            cfg = run_config(train_args, pos, variant, seed, out / pos / variant / f"seed{seed}", pad_factor)
            fresh = not (Path(cfg.out_dir) / "result.json").exists()
            print(
                f"\n=== run {i + 1}/{len(grid)}: pos_emb={pos} {variant} seed={seed}"
                + ("" if fresh else " (finished before: skipped)"),
                flush=True,
            )
            runs[pos][variant][seed] = run_one(cfg, settings)
            trained += fresh
            if fresh:
                remaining = sum(
                    1 for p, v, s in grid[i + 1 :] if not (out / p / v / f"seed{s}" / "result.json").exists()
                )
                eta = data.format_duration((time.time() - t0) / trained * remaining)
                print(f"=== study: {i + 1}/{len(grid)} runs done, ETA {eta}", flush=True)
    except StudyStopped as e:
        print(e)
        return 0
    except (ConfigError, data.DataError, train.TrainingDiverged, run_infra.SaveFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary = summarise(runs, offsets)
    env = environment()
    report = format_report(summary, env, {**settings, "pad_steps_factor": pad_factor}, offsets, base)
    (out / "results.md").write_text(report)
    (out / "results.json").write_text(
        json.dumps(
            {
                "environment": env,
                "settings": settings,
                "pad_steps_factor": pad_factor,
                "summary": summary,
                "runs": runs,
            },
            indent=1,
        )
    )
    plot(runs, offsets, out)
    print("\n" + report)
    leak_figure = ", import_leak.png" if settings["import_leak"] else ""
    print(
        f"wrote {out / 'results.md'}, results.json, val_loss.png, loss_by_position.png, offset_probe.png{leak_figure}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
