"""A study's verdicts, report and figures, from its runs' results: each endpoint per run, the paired effects
with their intervals, Holm over the primary family, the tables and the plots. A saved results.json is
enough to write them again, without running anything:

    python -m studies.report out/ablate/results.json      # writes results.md and the figures beside it
    python -m studies.report RESULTS.json CONFIG.toml     # a study from before 2026-12-02, which did not record
                                                          # its training settings: they come from its config
    python -m studies.report results/history/ablate_cpu/results.json configs/ablate_cpu.toml --out_dir=out/ablate_cpu
                                                          # a committed study's report, written elsewhere

Without --out_dir=DIR the report goes beside its results.json, unless git tracks a file in that folder (a
committed study under results/): a committed report is rewritten only where --out_dir names its folder.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np

from cli import run_main, settings_from
from config import NOT_DECIDING, Config
from errors import ConfigError, SaveFailed
from run.folder import check_writable_folder, replace_atomically, write_atomically
from studies import import_leak, stats
from studies.plan import (
    BASELINES,
    DIFFERENCE_ENDPOINTS,
    WHOLE_DOCUMENT_ENDPOINTS,
    Study,
    parse_args,
    predicted_invariant,
    primary_endpoints,
    probes_invariant,
)
from studies.tables import markdown_table


def save_figure(figure, path: Path) -> None:
    """A matplotlib figure, written atomically (in the format its name's suffix says)."""
    replace_atomically(path, functools.partial(figure.savefig, format=path.suffix[1:], dpi=110, bbox_inches="tight"))


def band_loss(
    result: dict, band: list[int], sums: str = "val_doc_loss_sum_by_position", counts: str = "val_doc_count_by_position"
) -> float | None:
    """Token-weighted loss of the validation documents alone at within-document positions [first, stop);
    None where no target there was scored (never a made-up 0)."""
    first, stop = band
    counted = sum(result[counts][first:stop])
    return sum(result[sums][first:stop]) / counted if counted else None


def endpoints(result: dict, study: Study, offsets: list[int]) -> dict[str, float]:
    """One run's value of every endpoint it has (a run without the start marker has no first_token)."""
    by_document = zip(result.get("val_doc_loss_sum_by_document", []), result.get("val_doc_count_by_document", []))
    per_document = [total / n for total, n in by_document if n]
    values = {
        "early": band_loss(result, study.early_band),
        "middle": band_loss(result, study.middle_band),
        "late": band_loss(result, study.late_band) if study.late_band else None,
        "val_doc_loss": result["val_doc_loss"],
        # runs from before the marker scored only these targets: their val_doc_loss is this
        "from_second": result.get("val_doc_loss_from_second", result["val_doc_loss"]),
        "doc_weighted": float(np.mean(per_document)) if per_document else None,
        "in_context": result.get("val_doc_loss_in_context"),  # the same targets, after the documents before
        "bpb": result.get("val_doc_bpb_from_second"),
        "bpb_in_context": result.get("val_doc_bpb_in_context"),
        "first_token": result.get("val_first_token_loss"),
        "offset_effect": result["offset_loss"][str(max(offsets))] - result["offset_loss"]["1"],
        "contamination": result["after_other"] - result["offset_loss"]["1"],
    }
    if "start_after_eot" in result:  # its own start, for a run without the marker: after the previous EOT
        after = result["start_after_eot"]
        values["early_own_start"] = band_loss(after, study.early_band, "sum_by_position", "count_by_position")
    elif "val_first_token_loss" in result:  # with the marker: from the BOS, as evaluated
        values["early_own_start"] = values["early"]
    if "import_leak" in result:
        values["leak_logprob"] = result["import_leak"]["logprob"]["k=1,extra=0"]["delta_logprob"]
        values["leak_rate"] = result["import_leak"]["sampling"]["difference"]
        if "k=1,extra=0 vs neutral" in result["import_leak"]["logprob"]:  # probes from before it was measured lack it
            values["leak_vs_neutral"] = result["import_leak"]["logprob"]["k=1,extra=0 vs neutral"]["delta_logprob"]
    return {name: value for name, value in values.items() if value is not None}


def margin(study: Study, endpoint: str) -> float:
    return study.margin_doc_loss if endpoint in WHOLE_DOCUMENT_ENDPOINTS else study.margin_band


def summarise(runs: dict, study: Study, offsets: list[int]) -> dict:
    """Per cell and endpoint: its per-seed values, the effect (paired difference to its baseline's run of the
    same seed, or the contrast within each run) with its 90% and 95% intervals, its role and verdict."""
    cells: dict = {}
    for pos in runs:
        # every variant's endpoints first: a cell is compared with its baseline's runs, in any order
        values = {
            v: {seed: endpoints(r, study, offsets) for seed, r in by_seed.items()} for v, by_seed in runs[pos].items()
        }
        for variant, by_seed in runs[pos].items():
            cells[f"{pos}/{variant}"] = summarise_cell(pos, variant, by_seed, values, study)
    decide_primary(cells)
    defer_verdicts(cells, study.decided_in)
    return cells


RUN_MEASURES = ("val_loss", "wall_seconds", "useful_tokens_per_sec")  # reported per cell, never compared


def summarise_cell(pos: str, variant: str, by_seed: dict, values: dict, study: Study) -> dict:
    """One cell of summarise. `values`: its position kind's endpoints, variant -> seed -> name -> value. An
    endpoint that some seed's run did not score is left out, so that every entry rests on the same seeds."""
    seeds = sorted(by_seed)
    baseline = BASELINES.get(variant, "reference")
    cell = {"seeds": seeds, "baseline": baseline, "endpoints": {}}
    shared = set.intersection(*(set(values[variant][s]) for s in seeds))
    check_cell_is_complete(pos, variant, seeds, shared, values, study)
    for name in [n for n in values[variant][seeds[0]] if n in shared]:
        cell["endpoints"][name] = endpoint_entry(pos, variant, name, seeds, values, study)
    for name in RUN_MEASURES:
        cell["endpoints"][name] = spread_entry([by_seed[s][name] for s in seeds])
    if "import_leak" in by_seed[seeds[0]]:
        cell["leak_growth"] = leak_growth([by_seed[s]["import_leak"] for s in seeds])
    return cell


def check_cell_is_complete(
    pos: str, variant: str, seeds: list[int], shared: set[str], values: dict, study: Study
) -> None:
    """A ConfigError where the cell's verdicts would rest on fewer runs than planned: a seed that its
    baseline has not run, or a primary endpoint without scored targets in some run of either."""
    baseline = BASELINES.get(variant, "reference")
    if baseline in values and not set(seeds) <= set(values[baseline]):
        missing = sorted(set(seeds) - set(values[baseline]))
        raise ConfigError(f"{pos}/{variant} has seeds {missing} that its baseline {pos}/{baseline} has not run")
    for name in primary_endpoints(study, variant):
        if name not in shared or any(name not in values[baseline][s] for s in seeds):
            raise ConfigError(f"{pos}/{variant}: its primary endpoint {name} has no scored targets in every run")


def spread_entry(own: list[float]) -> dict:
    """An endpoint's per-seed values with their mean and sd: all there is where nothing is compared."""
    return {"values": own, "mean_sd": stats.mean_spread(own)}


def endpoint_entry(pos: str, variant: str, name: str, seeds: list[int], values: dict, study: Study) -> dict:
    """One endpoint of a cell (values: as summarise_cell takes them). A difference endpoint is paired with the
    baseline's run of the same seed; any other is already a contrast within each run."""
    baseline = BASELINES.get(variant, "reference")
    own = [values[variant][s][name] for s in seeds]
    entry = spread_entry(own)
    paired = name in DIFFERENCE_ENDPOINTS
    if paired and (variant == "reference" or any(name not in values[baseline][s] for s in seeds)):
        return entry  # nothing to compare with
    reference = [values[baseline][s][name] for s in seeds] if paired else None
    if (paired and predicted_invariant(pos, variant)) or (not paired and probes_invariant(pos, variant)):
        return entry | invariance_fields(own, reference, study.invariance_tolerance)
    primary = name in primary_endpoints(study, variant)
    return entry | effect_fields(own, reference, primary, margin(study, name))


def invariance_fields(own: list[float], reference: list[float] | None, tolerance: float) -> dict:
    """An endpoint the design predicts unchanged: whether it is, within the tolerance."""
    verdict, worst, bitwise = stats.invariance(own, reference, tolerance)
    bound = stats.paired_effect(own, reference).bound()  # how far from 0, if not within tolerance
    return {"role": "invariant", "verdict": verdict, "max_abs_difference": worst, "bitwise": bitwise, "bound": bound}


def effect_fields(own: list[float], reference: list[float] | None, primary: bool, equivalence_margin: float) -> dict:
    """An endpoint's effect with its intervals; a primary one also gets the p values that decide_primary
    corrects over the family."""
    effect = stats.paired_effect(own, reference)
    return {
        "role": "primary" if primary else "secondary",
        "estimate": effect.estimate,
        "se": effect.se,
        "df": effect.df,
        "ci90": list(effect.interval(0.90)),
        "ci95": list(effect.interval(0.95)),
        "bound": effect.bound(),
        "p_difference": effect.p_difference(),
        "p_equivalence": effect.p_equivalence(equivalence_margin) if primary else None,
        "p_wilcoxon": stats.signed_rank_p(own, reference) if primary else None,
    }


def defer_verdicts(cells: dict, decided_in: str) -> None:
    """A study that one registration decides together with others (decided_in) gives its primary effects and
    predicted invariances without verdicts: its own family would decide them another way."""
    for cell in cells.values() if decided_in else []:
        for name, entry in cell["endpoints"].items():
            if entry.get("role") == "primary" or (entry.get("role") == "invariant" and name in DIFFERENCE_ENDPOINTS):
                entry["verdict"], entry["robust"] = f"decided in {decided_in}", True


def leak_growth(probes: list[dict]) -> dict:
    """Per (files before B, tokens kept after each import): Δ log P(import m), mean and sd over seeds; and
    the sampled leak rates with the file before and alone."""
    growth = {}
    for key in probes[0]["logprob"]:
        deltas = [p["logprob"][key]["delta_logprob"] for p in probes]
        growth[key] = None if None in deltas else stats.mean_spread(deltas)
    for when in ("after", "alone"):
        growth[f"sampled_{when}"] = stats.mean_spread([p["sampling"][f"leak_rate_{when}"] for p in probes])
    return growth


def decide_primary(cells: dict) -> None:
    """Holm over the primary family, once for the difference tests and once for the equivalence tests."""
    family = {
        (key, name): entry
        for key, cell in cells.items()
        for name, entry in cell["endpoints"].items()
        if entry.get("role") == "primary"
    }
    difference = stats.holm({k: e["p_difference"] for k, e in family.items()})
    equivalence = stats.holm({k: e["p_equivalence"] for k, e in family.items()})
    signed_rank = stats.holm({k: e["p_wilcoxon"] for k, e in family.items()})
    # Holm's adjusted p never falls when any p rises, so the check's best case is Holm over the smallest p each
    # cell's seeds allow: with too few seeds it cannot pass, whatever the data
    best_case = stats.holm({k: stats.smallest_signed_rank_p(e["df"] + 1) for k, e in family.items()})
    for key, entry in family.items():
        effect = stats.Effect(entry["estimate"], entry["se"], entry["df"])
        entry["p_difference_holm"], entry["p_equivalence_holm"] = difference[key], equivalence[key]
        entry["verdict"] = stats.primary_verdict(effect, difference[key], equivalence[key])
        # the robustness check for heavy tails: a difference verdict that the signed-rank test, Holm over the
        # same family, also reaches
        entry["p_wilcoxon_holm"] = signed_rank[key]
        if entry["verdict"] in ("hurts", "helps"):
            reachable = best_case[key] < stats.ALPHA
            entry["robust"] = bool(signed_rank[key] < stats.ALPHA) if reachable else None


ENDPOINT_NAMES = {
    "early": "early band",
    "middle": "middle band",
    "late": "late band",
    "val_doc_loss": "val_doc_loss",
    "from_second": "val_doc_loss from the second token",
    "doc_weighted": "document-weighted loss",
    "in_context": "val_doc_loss from the second token, in context",
    "bpb": "bits per byte from the second token",
    "bpb_in_context": "bits per byte from the second token, in context",
    "first_token": "first token (from the BOS)",
    "early_own_start": "early band, own start",
    "offset_effect": "offset effect",
    "contamination": "contamination",
    "leak_logprob": "Δ log P(import m)",
    "leak_vs_neutral": "Δ log P(import m) vs a neutral file",
    "leak_rate": "Δ sampled leak rate",
}


def endpoint_label(name: str, study: Study) -> str:
    """An endpoint as the figures and studies.compare's table say it: where it is scored, and how."""
    bands = {"early": study.early_band, "middle": study.middle_band, "late": study.late_band}
    if name in bands:
        return f"positions {bands[name][0]}-{bands[name][1] - 1}, alone"
    words = {
        "from_second": "whole documents, alone",
        "in_context": "whole documents, in context",
        "bpb": "whole documents, alone, bits a byte",
        "bpb_in_context": "whole documents, in context, bits a byte",
    }
    return words.get(name, ENDPOINT_NAMES[name])


def describe_effect(entry: dict) -> str:
    """One cell of a table: the effect, its interval and what it says."""
    if entry["role"] == "invariant":
        how = "bitwise" if entry["bitwise"] else f"max \\|Δ\\| {entry['max_abs_difference']:.1e}"
        if entry["verdict"] == "invariant":
            return f"invariant ({how})"
        if entry["verdict"].startswith("decided in"):
            return f"{entry['verdict']} ({how})"
        return f"not invariant within the tolerance ({how}; \\|Δ\\| < {entry['bound']:.4f})"
    low, high = entry["ci95"] if entry["role"] == "primary" else entry["ci90"]
    interval = "" if not math.isfinite(low) else f" [{low:+.3f}, {high:+.3f}]"
    if entry["role"] == "primary":
        robust = {False: " (not robust)", None: " (too few seeds to check)"}.get(entry.get("robust", True), "")
        return f"**{entry['verdict']}**{robust}: {entry['estimate']:+.3f}{interval}"
    return f"{entry['estimate']:+.3f}{interval}, \\|Δ\\| < {entry['bound']:.3f}"


def format_report(summary: dict, env: dict, study: Study, offsets: list[int], cfg: Config, extra: dict) -> str:
    lines = [
        *setup_lines(summary, env, study, cfg, extra),
        *decision_rule_lines(summary, study, offsets),
        *primary_lines(summary, study),
        *secondary_lines(summary),
        *cell_lines(summary),
        *import_leak_lines(summary),
    ]
    return "\n".join(lines) + "\n"


EMPTY_BAND = "empty: no validation document reaches it"


def mean_sd(pair: tuple[float, float]) -> str:
    """A (mean, sd) pair, as every table shows it."""
    return f"{pair[0]:.3f} ± {pair[1]:.3f}"


def band_mean_sd(entry: dict | None) -> str:
    """A band's mean ± sd, or what a band that holds no scored target in the validation documents is."""
    return EMPTY_BAND if entry is None else mean_sd(entry["mean_sd"])


def empty_band_note(summary: dict, endpoint: str) -> str:
    """What the rules say of a band that no cell could score (the validation documents end before it)."""
    return "" if any(endpoint in cell["endpoints"] for cell in summary.values()) else f"; {EMPTY_BAND}"


def setup_lines(summary: dict, env: dict, study: Study, cfg: Config, extra: dict) -> list[str]:
    """The title and what was run: the command, the machine, the commits, the model, data and regime, seeds."""
    regime = extra["regime"]
    pad_factor = extra["pad_steps_factor"]
    seeds = {key: len(cell["seeds"]) for key, cell in summary.items()}
    return [
        "# Ablation results",
        "",
        f"- command: `{env['command']}`",
        f"- hardware: {env['hardware']}, torch {env['torch']}; runs trained at commit "
        f"{extra['trained_at']}, this report written at commit {env['commit']}"
        + (f" and rebuilt from its runs at commit {extra['rebuilt_at']}" if "rebuilt_at" in extra else ""),
        f"- model: {cfg.n_layer} layers, {cfg.n_embd} wide, {cfg.n_head} heads; data: {cfg.dataset}, tokenizer "
        f"{cfg.tokenizer} {cfg.tokenizer_vocab_size}; each packed run {cfg.max_iters} steps of "
        f"{cfg.batch_size * cfg.grad_accum} x {cfg.seq_len} tokens"
        + (
            f"; `pad` {pad_factor:.2f}x the steps for as many real tokens (pad rows are {1 - 1 / pad_factor:.0%} "
            "padding), `pad_equal_compute` as many steps and rows"
            if {"pad", "pad_equal_compute"} & set(study.variants)
            else ""
        ),
        f"- regime: {regime['documents_per_row']:.2f} documents per training row, "
        f"{regime['tokens_seeing_another_document']:.0%} of tokens can see another document without the mask "
        f"(documents: median {regime['median_document_tokens']:.0f}, mean {regime['mean_document_tokens']:.0f} tokens)",
        f"- seeds {study.first_seed} onwards; per cell: " + ", ".join(f"{key} {n}" for key, n in seeds.items()),
        f"- wall time of the study (timing: it depends on the machine's load, and decides nothing): {extra['wall']}",
    ]


def decision_rule_lines(summary: dict, study: Study, offsets: list[int]) -> list[str]:
    """The pre-registered endpoints of each role and how each is decided."""
    roles = [(key, name, e.get("role")) for key, c in summary.items() for name, e in c["endpoints"].items()]
    n_primary = sum(1 for _, _, role in roles if role == "primary")
    return [
        "",
        "## Pre-registered endpoints and decision rules",
        "",
        *(
            [
                f"- decided in {study.decided_in}, with other studies' tests: the verdicts and the invariance rule "
                "below are what this study would apply alone, and its tables give effects and intervals only."
            ]
            if study.decided_in
            else []
        ),
        primary_rule(study),
        f"- verdicts at family-wise α = {stats.ALPHA} (Holm, over the {n_primary} primary tests, once for "
        "difference and once for equivalence): `negligible` when the equivalence test (TOST) rejects "
        f"|effect| ≥ {study.margin_band} nats (bands) or {study.margin_doc_loss} (val_doc_loss); else `hurts` / "
        "`helps` when the difference test rejects 0; else `unresolved`. The interval shown is the "
        "unadjusted 95% one. Together the two families can err with probability at most "
        f"{2 * stats.ALPHA:g} (a false difference or a false equivalence, each held to {stats.ALPHA}). Robustness "
        "for heavy tails: Wilcoxon's signed-rank test of the same differences, Holm over the same family; a "
        "`hurts` or `helps` it does not reach is marked `(not robust)`, or `(too few seeds to check)` where "
        "no data could reach it (Holm over the smallest p each cell's seeds allow, 2/2^n, is at least "
        f"{stats.ALPHA} for it).",
        f"- secondary: the middle band (positions {study.middle_band[0]}-{study.middle_band[1] - 1}"
        f"{empty_band_note(summary, 'middle')}), the other "
        "of early band and val_doc_loss, the offset effect (the probe documents' loss after "
        f"{max(offsets)} tokens of other documents minus after an EOT alone) and the contamination (after one "
        "foreign document and its EOT minus after an EOT alone): the estimate, its 90% interval and the bound "
        "|Δ| < X that it gives.",
        "- invariant: where theory predicts no change (RoPE with the document mask needs no position reset; "
        "with the mask, and reset or RoPE, nothing before a document changes it), each seed's value is "
        f"checked against the reference's (or 0): within {study.invariance_tolerance:g} nats, bitwise where "
        "equal.",
    ]


def primary_rule(study: Study) -> str:
    """The primary endpoints of each variant, what the bands and val_doc_loss measure, and what an effect is."""
    return (
        "- primary: "
        + "; ".join(
            f"`{v}`: " + ", ".join(ENDPOINT_NAMES[n] for n in primary_endpoints(study, v))
            for v in study.variants
            if primary_endpoints(study, v)
        )
        + f". Bands are within-document positions (position p predicts the token after the p-th): early "
        f"{study.early_band[0]}-{study.early_band[1] - 1}"
        + (f", late {study.late_band[0]}-{study.late_band[1] - 1}" if study.late_band else "")
        + ", "
        "of every validation document alone; `val_doc_loss` is every token of every validation document alone "
        "(with the start marker, the first one too). Each effect is the mean over seeds of the difference to "
        "the baseline's run of the same seed (the reference, unless "
        + (", ".join(f"`{v}` against `{b}`" for v, b in BASELINES.items() if v in study.variants) or "none differs")
        + "; paired, each cell with its own variance, n - 1 degrees of freedom)."
    )


def primary_lines(summary: dict, study: Study) -> list[str]:
    """Each primary endpoint of each cell: the baseline's and the variant's mean ± sd, the effect and verdict."""
    lines = [
        "",
        "## Primary endpoints",
        "",
        "The reference's mean is over the cell's own seeds. Holm p: the adjusted p-values of the difference "
        "and the equivalence test.",
        "",
    ]
    primary_rows = []
    for key, cell in summary.items():
        pos, variant = key.split("/")
        for name in primary_endpoints(study, variant):
            entry = cell["endpoints"][name]
            baseline = summary[f"{pos}/{cell['baseline']}"]
            ref = [v for s, v in zip(baseline["seeds"], baseline["endpoints"][name]["values"]) if s in cell["seeds"]]
            holm_p = (
                f"{entry['p_difference_holm']:.2g} / {entry['p_equivalence_holm']:.2g}"
                if entry["role"] == "primary"
                else ""
            )
            primary_rows.append(
                [pos, variant, ENDPOINT_NAMES[name], mean_sd(stats.mean_spread(ref)), mean_sd(entry["mean_sd"])]
                + [describe_effect(entry), holm_p, len(cell["seeds"])]
            )
    header = ["position kind", "variant", "endpoint", "baseline", "variant", "effect [95% CI]: verdict", "Holm p"]
    return lines + markdown_table(header + ["seeds"], primary_rows)


def secondary_lines(summary: dict) -> list[str]:
    """Every decided endpoint of every cell: the secondary effects and bounds, and the invariance checks."""
    secondary = [name for name in ENDPOINT_NAMES if any(name in c["endpoints"] for c in summary.values())]
    lines = [
        "",
        "## Secondary endpoints and invariances",
        "",
        "Bounds from the 90% interval (primary cells repeat their verdict).",
        "",
    ]
    secondary_rows = [  # the reference too: its probes are checked for invariance
        [key]
        + [
            describe_effect(cell["endpoints"][name]) if "role" in cell["endpoints"].get(name, {}) else ""
            for name in secondary
        ]
        for key, cell in summary.items()
    ]
    return lines + markdown_table(["cell", *(ENDPOINT_NAMES[n] for n in secondary)], secondary_rows)


def cell_lines(summary: dict) -> list[str]:
    """Each cell's losses and timings, mean ± sd over its seeds."""
    lines = [
        "",
        "## Each cell (mean ± sd over seeds)",
        "",
        "The two timing columns depend on what else the machine ran (losses do not): they are labelled as "
        "such and decide nothing. Runs went in a random order within each seed; train time excludes evaluation.",
        "",
    ]
    cell_rows = []
    for key, cell in summary.items():
        e = cell["endpoints"]
        cell_rows.append(
            [key, len(cell["seeds"]), mean_sd(e["val_doc_loss"]["mean_sd"]), band_mean_sd(e.get("early"))]
            + [band_mean_sd(e.get("middle")), mean_sd(e["val_loss"]["mean_sd"])]
            + [f"{e['wall_seconds']['mean_sd'][0]:.1f}", f"{e['useful_tokens_per_sec']['mean_sd'][0]:,.0f}"]
        )
    header = ["cell", "seeds", "val_doc_loss", "early band", "middle band", "val_loss (own packing)"]
    return lines + markdown_table(header + ["train s (timing, load-dependent)", "useful tok/s (timing)"], cell_rows)


def import_leak_lines(summary: dict) -> list[str]:
    """The import-leak probe's growth with the files before B, per cell; nothing where no cell ran it."""
    leaks = {key: cell["leak_growth"] for key, cell in summary.items() if "leak_growth" in cell}
    if not leaks:
        return []
    settings = [k for k in next(iter(leaks.values())) if k.startswith("k=")]
    lines = [
        "",
        "## Import leak",
        "",
        "Pairs (A, B) of validation files where A imports a module m that B never mentions "
        "(studies/import_leak.py). Δ log P(`import m` or `from m import`) at B's first import with k files "
        "importing m before B (each cut after that import, or with `extra` more of its tokens), minus B alone; "
        "and the share of import lines sampled there that name a module of the file before, with it before "
        "and alone. Mean ± sd over seeds.",
        "",
    ]
    leak_rows = [
        [key, *("" if growth[k] is None else mean_sd(growth[k]) for k in settings)]
        + [f"{growth['sampled_after'][0]:.1%}", f"{growth['sampled_alone'][0]:.1%}"]
        for key, growth in leaks.items()
    ]
    header = ["cell", *(k.replace(",", ", ") for k in settings), "sampled: before", "alone"]
    return lines + markdown_table(header, leak_rows)


def plot(runs: dict, summary: dict, study: Study, offsets: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(runs)

    def panels(rows: int = 1, width: float = 6):
        fig, axes = plt.subplots(
            rows, len(kinds), figsize=(width * len(kinds), 4.5 * rows), sharey="row", squeeze=False
        )
        for ax, pos in zip(axes[0], kinds):
            ax.set_title(f"pos_emb = {pos}")
        for ax in axes.flat:
            ax.grid(alpha=0.3)
        return fig, axes

    fig, (axes,) = panels()
    for ax in axes[1:]:  # one effect scale for every panel, so that panels compare at a glance
        ax.sharex(axes[0])
    draw_effects(axes, runs, summary, study)
    save_figure(fig, out / "effects.png")
    fig, (arms, differences) = panels(rows=2)
    draw_arm_loss_by_position(arms, runs)
    draw_loss_by_position(differences, runs, study)
    save_figure(fig, out / "loss_by_position.png")
    fig, (axes,) = panels()
    draw_offset_probe(axes, runs, offsets)
    save_figure(fig, out / "offset_probe.png")
    if all("import_leak" in r for pos in runs for cell in runs[pos].values() for r in cell.values()):
        fig, (axes,) = panels()
        draw_import_leak(axes, runs)
        save_figure(fig, out / "import_leak.png")
    plt.close("all")


def draw_effects(axes, runs: dict, summary: dict, study: Study) -> None:
    """effects.png: every primary effect with its 95% interval, a panel per position kind."""
    for ax, pos in zip(axes, runs):
        rows = [
            (f"{variant}: {endpoint_label(name, study)}", entry)
            for variant in runs[pos]
            for name, entry in summary[f"{pos}/{variant}"]["endpoints"].items()
            if name in primary_endpoints(study, variant) and "role" in entry
        ]
        for y, (_, entry) in enumerate(rows):
            if entry["role"] == "invariant":
                ax.plot([0], [y], "o", color="gray")
            else:
                low, high = entry["ci95"]
                ax.errorbar(
                    [entry["estimate"]],
                    [y],
                    xerr=[[entry["estimate"] - low], [high - entry["estimate"]]],
                    fmt="o",
                    capsize=3,
                )
        ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_xlabel("the variant's loss minus its baseline's, paired by seed (nats a token; 95% interval)")


def positions_scored(result: dict) -> int:
    """How far into its document a validation target was scored: past it the sums run on as zeros to seq_len."""
    return int(np.flatnonzero(result["val_doc_count_by_position"]).max(initial=0)) + 1


IN_CONTEXT_SUMS = "val_doc_loss_in_context_sum_by_position"  # a run scored in context as well keeps these


def position_bins(cells: dict) -> tuple[list[list[int]], list[float]]:
    """Bins of within-document positions, wider further in (every run scored each), and their centres."""
    n = min(positions_scored(r) for cell in cells.values() for r in cell.values())
    edges = np.unique(np.r_[0, np.geomspace(1, n, 14).astype(int)])
    bins = [[int(a), int(b)] for a, b in zip(edges[:-1], edges[1:])]
    return bins, [(a + b - 1) / 2 for a, b in bins]


def draw_arm_loss_by_position(axes, runs: dict) -> None:
    """loss_by_position.png, top row: each arm's loss by position within the document, the mean over seeds,
    scored alone (solid) and, where every run kept those sums, in context (dashed)."""
    for ax, pos in zip(axes, runs):
        bins, centers = position_bins(runs[pos])
        for variant, cell in runs[pos].items():
            alone = [[band_loss(r, b) for b in bins] for r in cell.values()]
            (line,) = ax.plot(centers, np.mean(alone, axis=0), marker="o", ms=3, label=variant)
            if all(IN_CONTEXT_SUMS in r for r in cell.values()):
                in_context = [[band_loss(r, b, sums=IN_CONTEXT_SUMS) for b in bins] for r in cell.values()]
                ax.plot(
                    centers,
                    np.mean(in_context, axis=0),
                    ls="--",
                    color=line.get_color(),
                    label=f"{variant}, in context",
                )
        ax.set_xscale("symlog")
    axes[0].set_ylabel("loss a token (mean over seeds)")
    axes[0].legend(fontsize=8)


def draw_loss_by_position(axes, runs: dict, study: Study) -> None:
    """loss_by_position.png, bottom row: each variant's difference to its baseline by position within the
    document, scored alone."""
    for ax, pos in zip(axes, runs):
        bins, centers = position_bins(runs[pos])
        for variant, cell in runs[pos].items():
            if variant == "reference":
                continue
            ref = runs[pos][BASELINES.get(variant, "reference")]
            deltas = [[band_loss(cell[s], b) - band_loss(ref[s], b) for b in bins] for s in cell]
            ax.plot(centers, np.mean(deltas, axis=0), marker="o", ms=3, label=variant)
        ax.axhline(0, color="black", lw=0.8)
        ax.axvspan(study.early_band[0], study.early_band[1] - 1, color="gray", alpha=0.15)
        ax.set_xscale("symlog")
        ax.set_xlabel("position within the document (early band shaded)")
    axes[0].set_ylabel("loss minus its baseline's (same seed)")
    axes[0].legend(fontsize=8)


def draw_offset_probe(axes, runs: dict, offsets: list[int]) -> None:
    """offset_probe.png: the probe documents' loss by what precedes them."""
    for ax, pos in zip(axes, runs):
        for variant, cell in runs[pos].items():
            losses = np.array([[r["offset_loss"][str(k)] for k in offsets] for r in cell.values()])
            ax.errorbar(offsets, losses.mean(0), yerr=losses.std(0), marker="o", capsize=3, label=variant)
        ax.set_xscale("log")
        ax.set_xlabel("tokens of other documents before the document (1: the EOT alone)")
    axes[0].set_ylabel("loss on the document")
    axes[0].legend(fontsize=8)


def draw_import_leak(axes, runs: dict) -> None:
    """import_leak.png: Δ log P(import m) by the number of files before B that import m."""
    for ax, pos in zip(axes, runs):
        for variant, cell in runs[pos].items():
            logprob = [r["import_leak"]["logprob"] for r in cell.values()]
            for extra, style in zip(import_leak.EXTRA_TOKENS, ("-", "--")):
                ks = [k for k in import_leak.PRECEDING_FILES if logprob[0][f"k={k},extra={extra}"]["pairs"]]
                deltas = np.array([[lp[f"k={k},extra={extra}"]["delta_logprob"] for k in ks] for lp in logprob])
                label = f"{variant}, {extra} tokens after the import"
                ax.errorbar(ks, deltas.mean(0), yerr=deltas.std(0), ls=style, marker="o", capsize=3, label=label)
        ax.set_xticks(import_leak.PRECEDING_FILES)
        ax.set_xlabel("files before B that import m")
    axes[0].set_ylabel("Δ log P(import m) vs B alone (nats)")
    axes[0].legend(fontsize=8)


def write_report(
    runs: dict,
    study: Study,
    offsets: list[int],
    base: Config,
    regime: dict,
    pad_factor: float,
    out: Path,
    env: dict,
    echo: bool = True,
) -> None:
    """results.json (every run's result, the settings and the verdicts), then the report and figures from it
    (printed too, with `echo`)."""
    runs = {pos: {v: dict(sorted(cell.items())) for v, cell in kinds.items()} for pos, kinds in runs.items()}
    wall = sum(r["wall_seconds"] for kinds in runs.values() for cell in kinds.values() for r in cell.values())
    commits = {
        r.get("trained_at_commit", "not recorded") for k in runs.values() for c in k.values() for r in c.values()
    }
    saved = {
        "environment": env,
        "study": dataclasses.asdict(study),
        "config": dataclasses.asdict(base),
        "probe_offsets": offsets,
        "regime": regime,
        "pad_steps_factor": pad_factor,
        "wall": f"{wall / 60:.0f} min of training steps",
        "trained_at": ", ".join(sorted(commits)),
        "runs": runs,
    }
    saved["summary"] = summarise(runs, study, offsets)
    write_atomically(out / "results.json", json.dumps(saved))
    report_from(saved, out, echo)


def code_commit() -> str:
    """The commit of the code that runs, with a mark when the tracked files differ from it."""
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
        return (commit + ("+uncommitted changes" if dirty else "")) or "unknown"
    except OSError:
        return "unknown"


def finite_number(value: object) -> bool:
    """A JSON number that is not a bool, NaN or infinite (an int of any size is finite; math.isfinite overflows)."""
    return (type(value) is int) or (type(value) is float and math.isfinite(value))


def result_problem(result: object) -> str | None:
    """What makes a run's result unlike the one train_and_probe writes, or None. Every measure is a finite number
    and every list of sums as long as its counts: a list cut short would be read as a run that scored fewer
    positions or documents, and would decide on part of its data without a word."""
    if not isinstance(result, dict):
        return "it is not a run's result"
    for key in ("val_loss", "val_doc_loss", "wall_seconds", "useful_tokens_per_sec", "after_other"):
        if key not in result:
            return f"it has no {key}"
        if not finite_number(result[key]):
            return f"its {key} is {result[key]!r}, not a finite number"
    offsets = result.get("offset_loss")
    if not (isinstance(offsets, dict) and "1" in offsets and all(map(finite_number, offsets.values()))):
        return "its offset_loss is not the probe's losses by offset"
    after_eot = result.get("start_after_eot", {})  # a run without the marker: its documents after each EOT
    if "start_after_eot" in result and not (
        isinstance(after_eot, dict) and {"sum_by_position", "count_by_position"} <= after_eot.keys()
    ):
        return "its start_after_eot is not the losses by position after each EOT"
    listed = {**result, **{f"start_after_eot.{key}": value for key, value in after_eot.items()}}
    lengths: dict[str, int] = {}  # a list's name -> its length
    for key, value in listed.items():
        if key.endswith(("_by_position", "_by_document")):
            if not (isinstance(value, list) and all(map(finite_number, value))):
                return f"its {key} is not a list of finite numbers"
            lengths[key] = len(value)
        elif key.startswith("val_") and not finite_number(value):
            return f"its {key} is {value!r}, not a finite number"
    needed = ["val_doc_loss_sum_by_position", "val_doc_count_by_position"]
    if "val_doc_loss_sum_by_document" in lengths:
        needed.append("val_doc_count_by_document")  # each document's loss is its sum over its count
    if missing := [key for key in needed if key not in lengths]:
        return f"it has no {missing[0]}"
    return lists_of_unequal_length(lengths)


def lists_of_unequal_length(lengths: dict[str, int]) -> str | None:
    """A run's lists that must be as long as each other and are not (after an EOT: the row's positions less one)."""
    groups = (
        [key for key in lengths if key.startswith("val_") and key.endswith("_by_position")],
        [key for key in lengths if key.endswith("_by_document")],
        [key for key in lengths if key.startswith("start_after_eot.")],
    )
    for group in groups:
        if len({lengths[key] for key in group}) > 1:
            return "its lists differ in length (" + ", ".join(f"{key}: {lengths[key]}" for key in group) + ")"
    return None


def saved_runs(saved: dict) -> dict:
    """A results.json's runs as summarise takes them: position kind -> variant -> seed (an int) -> result.
    A run whose result is not one train_and_probe writes is a ValueError that names it."""
    runs = {
        pos: {v: {int(s): r for s, r in cell.items()} for v, cell in kinds.items()}
        for pos, kinds in saved["runs"].items()
    }
    for pos, kinds in runs.items():
        for variant, cell in kinds.items():
            for seed, result in cell.items():
                if problem := result_problem(result):
                    raise ValueError(f"run {pos}/{variant}/seed{seed}: {problem}")
    return runs


def settings_changed(saved: dict, study: Study, base: Config) -> list[str]:
    """The settings in which the study that wrote `saved` differs from the config read now (the ladder decides
    a rung with the config's bands and margins, so they must be the ones the runs were planned with). Its
    training settings are compared where it recorded them; studies before 2026-12-02 recorded only its
    [ablate] table, and each run's own record (decided_by, in its result.json) holds the rest."""
    then_study, then_base = recorded_settings(saved)
    recorded = {"study": (then_study, study)}
    if then_base is not None:
        recorded["config"] = (then_base, base)
    where = {"study": {"out_dir"}, "config": NOT_DECIDING}  # where the files are, and what cannot change a number
    return [
        f"{table}.{key}"
        for table, (then, now) in recorded.items()
        for key, value in dataclasses.asdict(now).items()
        if key not in where[table] and dataclasses.asdict(then)[key] != value
    ]


def recorded_settings(saved: dict) -> tuple[Study, Config | None]:
    """The study settings and training settings (None where not recorded) a results.json records; ValueError,
    which each reader reports with the file's name, where they do not read as settings."""
    try:
        study = settings_from(Study, saved["study"], "python -m studies.ablate --help")
        base = settings_from(Config, saved["config"], "python train.py --help") if "config" in saved else None
    except ConfigError as e:
        raise ValueError(f"its recorded settings do not read: {e}") from None
    return study, base


def report_from(saved: dict, out: Path, echo: bool = True) -> None:
    """results.md and the figures from a study's saved results (the verdicts computed again from its runs);
    `echo`: print the report too (studies.compare prints its own short table instead)."""
    study, base = recorded_settings(saved)
    study.validate()
    offsets = saved["probe_offsets"]
    runs = saved_runs(saved)
    summary = summarise(runs, study, offsets)
    report = format_report(summary, saved["environment"], study, offsets, base, saved)
    plot(runs, summary, study, offsets, out)  # first: a figure that cannot be drawn leaves the old report whole
    write_atomically(out / "results.md", report)
    if not echo:
        return
    print("\n" + report)
    leak_figure = ", import_leak.png" if study.import_leak else ""
    print(f"wrote {out / 'results.md'}, effects.png, loss_by_position.png, offset_probe.png{leak_figure}")


def tracked_by_git(folder: Path) -> bool:
    """Whether git tracks a file in `folder` (False outside a repository, or where git is not installed)."""
    try:
        listed = subprocess.run(["git", "-C", str(folder), "ls-files", "--", "."], capture_output=True, text=True)
    except OSError:
        return False
    return listed.returncode == 0 and bool(listed.stdout.strip())


def output_folder(results: Path, out_dir: str | None) -> Path:
    """Where the report goes: --out_dir, else beside its results.json, unless git tracks that folder: a
    committed report is rewritten only when its folder is named."""
    if out_dir is not None:
        check_writable_folder(Path(out_dir), "out_dir")
        return Path(out_dir)
    if tracked_by_git(results.parent):
        raise ConfigError(
            f"{results.parent} holds files that git tracks: give --out_dir=DIR for the report "
            f"(--out_dir={results.parent} rewrites the committed one)"
        )
    return results.parent


def load_saved(path: Path, config: str | None) -> dict:
    """A study's results.json, with its training settings (from `config` for a study that did not record
    them, checked against the [ablate] table it recorded)."""
    saved = json.loads(path.read_text())
    if not isinstance(saved, dict) or not saved.get("runs"):
        raise ConfigError(f"{path} is not a study's results.json: it holds no runs")
    missing = [k for k in ("study", "runs", "probe_offsets", "environment") if k not in saved]
    if missing:
        raise ConfigError(f"{path} has no {', '.join(missing)}: it was written before reports could be rebuilt")
    if config is not None:
        study, base = parse_args([config])
        if changed := settings_changed(saved, study, base):
            raise ConfigError(f"{path} was written by a study with other settings than {config} ({', '.join(changed)})")
        return {**saved, "config": dataclasses.asdict(base)}
    if "config" not in saved:
        raise ConfigError(
            f"{path} does not record its training settings (studies before 2026-12-02): give the study's "
            f"config as well: {shlex.join(['python', '-m', 'studies.report', str(path)])} CONFIG.toml"
        )
    return saved


def usage_error(words: str) -> int:
    print(f"error: {words} (python -m studies.report --help)", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    paths = [a for a in argv if not a.startswith("-")]
    options = [a for a in argv if a.startswith("-")]
    out_dirs = [a.removeprefix("--out_dir=") for a in options if a.startswith("--out_dir=")]
    if {"-h", "--help"} & set(options):
        print(__doc__.strip())
        return 0
    if "--out_dir" in options:
        return usage_error("--out_dir needs a folder: --out_dir=DIR")
    if unknown := [a for a in options if not a.startswith("--out_dir=")]:
        return usage_error(f"unknown option {unknown[0]}: the only one is --out_dir=DIR")
    if "" in out_dirs:
        return usage_error("--out_dir is empty: give a folder, --out_dir=DIR")
    if len(paths) not in (1, 2):
        return usage_error(
            f"give one results.json (and, for a study before 2026-12-02, its config): {len(paths)} paths given"
        )
    path = Path(paths[0])
    try:
        saved = load_saved(path, paths[1] if len(paths) == 2 else None)
        out = output_folder(path, out_dirs[-1] if out_dirs else None)
        report_from({**saved, "rebuilt_at": code_commit()}, out)
    except (OSError, ValueError) as e:
        print(f"error: {path} cannot be read as a study's results.json ({e})", file=sys.stderr)
        return 1
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # JSON, but not in the shape ablate writes
        print(
            f"error: {path} is not a study's results.json as studies.ablate writes it ({type(e).__name__}: {e})",
            file=sys.stderr,
        )
        return 1
    except (ConfigError, SaveFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_main(main)
