"""Controlled ablations of the three flags: every variant x position kind x seed, then verdicts, a report
and figures.

    python -m studies.ablate configs/ablate_cpu.toml               # the confirmatory CPU study, 2 cores, ~100 min
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
continues a stopped study; a run folder made with other settings that decide its result is refused.

Written to the study's out_dir: results.md (the report), results.json (every number, per run too),
effects.png, loss_by_position.png, offset_probe.png, and import_leak.png with the leak probe.
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import data
import run_folder
import train
from config import (
    Config,
    ConfigError,
    command_line_values,
    help_text,
    interrupted_exit_code,
    parse_config,
    read_config_file,
    resolve_device,
    run_main,
    setting,
    settings_from,
)
from model import GPT
from prepare import prepare_for
from studies import import_leak, stats
from studies.scoring import score_rows, target_losses

POSITION_KINDS = ("learned", "rope")
VARIANTS = {  # name: the train.py settings it changes from the study's own settings (the reference)
    "reference": {},
    "no_doc_mask": {"doc_mask": False},
    "no_reset_position_ids": {"reset_position_ids": False},
    "no_mask_boundary_loss": {"mask_boundary_loss": False},
    "naive": {"doc_mask": False, "reset_position_ids": False, "mask_boundary_loss": False},
    "pad": {"packing": "pad"},  # as many real tokens as a packed run: more steps
    "pad_equal_compute": {"packing": "pad"},  # as many steps and rows as a packed run: fewer real tokens
    "bestfit": {"packing": "bestfit"},
    "no_bos": {"bos": False},  # the start convention: no start marker
    "no_bos_no_mask_boundary_loss": {"bos": False, "mask_boundary_loss": False},
}
# What each variant is compared with, seed by seed (the reference unless named here)
BASELINES = {"no_bos_no_mask_boundary_loss": "no_bos"}
# Each variant's primary endpoint unless the study names others: where its flag acts
PRIMARY_ENDPOINTS = {
    "no_doc_mask": ["early"],
    "no_reset_position_ids": ["early"],
    "naive": ["early"],
    "no_mask_boundary_loss": ["val_doc_loss"],
    "pad": ["val_doc_loss"],
    "pad_equal_compute": ["val_doc_loss"],
}
# compared with the baseline of the same seed; the others (offset effect, contamination, the import leak)
# are contrasts within each run
DIFFERENCE_ENDPOINTS = (
    "early",
    "middle",
    "late",
    "val_doc_loss",
    "from_second",
    "doc_weighted",
    "first_token",
    "early_own_start",
)
WHOLE_DOCUMENT_ENDPOINTS = ("val_doc_loss", "from_second", "doc_weighted")  # their margin: margin_doc_loss


@dataclass
class Study:
    """The [ablate] table: what a study runs and how it decides."""

    out_dir: str = setting(
        "out/ablate", "the study's folder: one run folder per cell and seed, and the report", path=True
    )
    pos_embs: list[str] = setting(list(POSITION_KINDS), "position kinds to run", choices=POSITION_KINDS)
    variants: list[str] = setting(
        [
            "reference",
            "no_doc_mask",
            "no_reset_position_ids",
            "no_mask_boundary_loss",
            "naive",
            "pad",
            "pad_equal_compute",
        ],
        "variants to run (the reference is required)",
        choices=tuple(VARIANTS),
    )
    seeds: int = setting(3, "seeds of each cell, unless seeds_by_variant names its variant", minimum=1)
    seeds_by_variant: dict[str, int] = setting({}, "seeds of these variants, e.g. no_mask_boundary_loss=12")
    invariance_seeds: int = setting(
        2,
        "seeds of a cell predicted equal to the reference (RoPE without position reset): enough to check it",
        minimum=1,
    )
    first_seed: int = setting(0, "seeds run first_seed, first_seed + 1, ...; new seeds make a new study", minimum=0)
    early_band: list[int] = setting(
        [0, 16], "[first, last + 1) within-document positions of the primary band", minimum=0
    )
    middle_band: list[int] = setting([16, 64], "[first, last + 1) positions of the secondary band", minimum=0)
    late_band: list[int] = setting([], "[first, last + 1) positions of the late band ([]: none)", minimum=0)
    primary: dict[str, list[str]] = setting(
        {},
        "primary endpoints of these variants (others: their flag's default, e.g. no_doc_mask = early); "
        f"endpoints: {', '.join(DIFFERENCE_ENDPOINTS)}",
    )
    margin_band: float = setting(
        0.02, "negligible: the Holm-widened 90% interval within +-this (nats), bands", minimum=0.0
    )
    margin_doc_loss: float = setting(
        0.02, "the same margin for whole-document losses (val_doc_loss, from_second, doc_weighted)", minimum=0.0
    )
    invariance_tolerance: float = setting(
        1e-4, "largest |difference| (nats) that still counts as invariant: float rounding", minimum=0.0
    )
    probe_docs: int = setting(64, "validation documents in the offset and contamination probes", minimum=1)
    probe_offsets: list[int] = setting(
        [64],
        "tokens of other documents before each probe document (1, the EOT alone, and seq_len / 2 are added)",
        minimum=1,
    )
    import_leak: bool = setting(False, "also run import_leak.py's probe on every run (needs whole Python files)")
    leak_pairs: int = setting(64, "pairs of the import-leak probe at most", minimum=1)

    def validate(self) -> None:
        if not self.out_dir.strip():
            raise ConfigError("out_dir is empty: give the study's folder")
        if not self.pos_embs:
            raise ConfigError("pos_embs is empty: name at least one position kind")
        if "reference" not in self.variants:
            raise ConfigError("variants must include reference: every effect is measured against it")
        if len(set(self.variants)) < 2:
            raise ConfigError("variants names only the reference: name at least one variant to compare with it")
        for variant in self.variants:
            if BASELINES.get(variant, "reference") not in self.variants:
                raise ConfigError(f"variant {variant} is compared with {BASELINES[variant]}: add it to variants")
        for variant, names in self.primary.items():
            if variant not in self.variants or variant == "reference":
                raise ConfigError(f"primary names {variant!r}, which is not a variant this study runs")
            unknown = [n for n in names if n not in DIFFERENCE_ENDPOINTS]
            if unknown or not names:
                raise ConfigError(
                    f"primary.{variant}={names}: choose endpoints among {', '.join(DIFFERENCE_ENDPOINTS)}"
                )
        unknown = set(self.seeds_by_variant) - set(VARIANTS)
        if unknown:
            raise ConfigError(f"seeds_by_variant names no variant {', '.join(sorted(unknown))}")
        if any(n < 1 for n in self.seeds_by_variant.values()):
            raise ConfigError("seeds_by_variant: every count must be at least 1")
        for name in ("early_band", "middle_band", "late_band"):
            band = getattr(self, name)
            if name == "late_band" and not band:
                continue
            if len(band) != 2 or band[0] >= band[1]:
                raise ConfigError(f"{name}={band}: expected [first, last + 1] with first < last + 1")
        # in the table's order, each once
        self.pos_embs = [p for p in POSITION_KINDS if p in self.pos_embs]
        self.variants = [v for v in VARIANTS if v in self.variants]


STUDY_KEYS = tuple(f.name for f in dataclasses.fields(Study))


def parse_args(argv: list[str]) -> tuple[Study, list[str]]:
    """(study settings, train.py arguments) from a TOML file and --key=value overrides of either."""
    if not argv or argv[0].startswith("--"):
        raise ConfigError(
            "usage: python -m studies.ablate CONFIG.toml [--key=value ...] (python -m studies.ablate --help)"
        )
    values = read_config_file(Path(argv[0]))
    table = values.pop("ablate", {})
    if not isinstance(table, dict):
        raise ConfigError(f"[ablate] must be a table, got {table!r}")
    overrides = command_line_values(argv[1:])
    table.update({k: v for k, v in overrides.items() if k in STUDY_KEYS})
    values.update({k: v for k, v in overrides.items() if k not in STUDY_KEYS})
    try:
        study = settings_from(Study, table, "python -m studies.ablate --help")
    except ConfigError as e:
        raise ConfigError(f"[ablate] {e}") from None
    study.validate()
    train_args = as_arguments(values)
    parse_config(train_args)  # fails early, with train.py's messages, on a bad key or value
    return study, train_args


def check_against(study: Study, base: Config) -> None:
    """What the study asks is possible with these training settings: every band inside the positions a
    row has, every variant a change from what it is compared with, the first-token endpoint only where
    both sides have the start marker. Checked before any data is prepared or any file written."""
    for name in ("early_band", "middle_band", "late_band"):
        band = getattr(study, name)
        if band and band[1] > base.seq_len:
            raise ConfigError(f"{name}={band} reaches past seq_len={base.seq_len}: no position there is scored")
    settings = {v: {**dataclasses.asdict(base), **VARIANTS[v]} for v in study.variants}
    for variant in study.variants:
        baseline = BASELINES.get(variant, "reference")
        if variant != baseline and settings[variant] == settings[baseline] and variant != "pad_equal_compute":
            raise ConfigError(
                f"variant {variant} changes nothing from {baseline} with these settings "
                f"({', '.join(f'{k}={v}' for k, v in VARIANTS[variant].items())} already): drop it from variants"
            )
    for variant in study.variants:
        wanted = study.primary.get(variant, PRIMARY_ENDPOINTS.get(variant, []))
        both = (settings[variant], settings[BASELINES.get(variant, "reference")])
        if "first_token" in wanted and not all(side["bos"] for side in both):
            raise ConfigError(f"primary.{variant} = first_token needs the start marker (bos) on both sides")


def primary_endpoints(study: Study, variant: str) -> list[str]:
    return study.primary.get(variant, PRIMARY_ENDPOINTS.get(variant, []))


def predicted_invariant(pos: str, variant: str) -> bool:
    """Theory says this cell trains the same model as the reference, to float rounding: with the document
    mask, RoPE's attention scores depend only on i - j, so resetting positions changes nothing."""
    return pos == "rope" and variant == "no_reset_position_ids"


def probes_invariant(pos: str, variant: str) -> bool:
    """Theory says nothing before a document in its row changes its loss: the document mask hides it,
    and positions restart at the document (or do not matter, with RoPE). The pad arms run the probes
    with every fix on."""
    flags = {"doc_mask": True, "reset_position_ids": True, **VARIANTS[variant]}
    return flags["doc_mask"] and (flags["reset_position_ids"] or pos == "rope")


def seeds_of_cells(study: Study) -> dict[tuple[str, str], list[int]]:
    """The seeds each (position kind, variant) runs; a baseline (the reference, or another variant that one is
    compared with) runs every seed of what is compared with it."""
    cells = {}
    for pos in study.pos_embs:
        for variant in study.variants:
            if variant == "reference":
                continue
            if predicted_invariant(pos, variant):
                n = study.invariance_seeds
            else:
                n = study.seeds_by_variant.get(variant, study.seeds)
            cells[pos, variant] = n
        for variant in study.variants:  # a baseline runs every seed that what it is compared with runs
            baseline = BASELINES.get(variant, "reference")
            if baseline != "reference":
                cells[pos, baseline] = max(cells[pos, baseline], cells[pos, variant])
        most = max([n for (p, _), n in cells.items() if p == pos] + [study.seeds_by_variant.get("reference", 1)])
        cells[pos, "reference"] = max(most, study.seeds)
    return {cell: list(range(study.first_seed, study.first_seed + n)) for cell, n in cells.items()}


def run_order(seeds: dict[tuple[str, str], list[int]]) -> list[tuple[str, str, int]]:
    """Seed by seed; within a seed, the cells in an order drawn from that seed."""
    order = []
    for seed in sorted({s for cell_seeds in seeds.values() for s in cell_seeds}):
        cells = [cell for cell, cell_seeds in seeds.items() if seed in cell_seeds]
        for i in np.random.default_rng(seed).permutation(len(cells)):
            order.append((*cells[i], seed))
    return order


def pad_steps_factor(shards: data.Shards, seq_len: int, bos_id: int | None = None) -> float:
    """How many more steps a pad run needs to see as many real tokens as a packed run."""
    rows = data.pad_rows(data.Documents(shards.train, shards.eot_id, bos_id), seq_len)
    return seq_len / float(np.minimum(rows.length, seq_len).mean())


def packing_regime(shards: data.Shards, seq_len: int, bos_id: int | None = None) -> dict:
    """How much packing matters at this seq_len: documents per concat row (counting a document cut by the
    row's start or end) and the fraction of tokens that can see another document without the mask."""
    documents = data.Documents(shards.train, shards.eot_id, bos_id)
    stats = data.packing_statistics(documents, data.concat_rows(documents, seq_len), seq_len, max_rows=4096)
    return {
        "documents_per_row": stats["documents_per_row"],
        "tokens_seeing_another_document": stats["tokens_seeing_another_document_without_the_mask"],
        "median_document_tokens": float(np.median(documents.lengths)),
        "mean_document_tokens": float(documents.lengths.mean()),
    }


def as_arguments(values: dict) -> list[str]:
    """--key=value arguments, booleans as true/false."""
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]


def run_config(train_args: list[str], pos_emb: str, variant: str, seed: int, out_dir: Path, pad_factor: float):
    overrides = {"pos_emb": pos_emb, "seed": seed, "out_dir": out_dir, "sample_tokens": 0, **VARIANTS[variant]}
    cfg = parse_config(train_args + as_arguments(overrides))
    # every run evaluates on the same documents: an automatic budget is fixed before pad's schedule stretches
    cfg.eval_tokens = train.eval_token_budget(cfg)
    if variant == "pad":  # the same real training tokens: more steps, with the schedule stretched to match
        # (pad_equal_compute keeps the packed run's steps: the same FLOPs, fewer real tokens)
        for key in ("max_iters", "warmup_iters", "eval_interval"):
            stretched = round(getattr(cfg, key) * pad_factor)
            setattr(cfg, key, stretched if key == "warmup_iters" else max(1, stretched))  # no warmup stays none
    return cfg


# ----------------------------------------------------------------------------------------------
# Probes: the same validation documents, placed in a row in different ways, under the run's own settings.
# The baseline is each document right after an EOT, as it sits in a packed row after another document
# ended: against it, "k tokens of other documents first" and "one foreign document first" add only what
# precedes, not the EOT that any packed document follows.


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
    starts, ends = data.document_bounds(val, eot_id)
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
    """Mean loss over the documents' own targets, each document after its prefix in one row, under the
    run's flags."""
    rows = [np.concatenate([p, d]) for p, d in zip(prefixes, docs)]
    own = [(len(p), len(p) + len(d) - 1) for p, d in zip(prefixes, docs)]  # targets inside the document
    sums, counts = score_rows(model, cfg.flags, eot_id, rows, own, device, cfg.dtype)
    return float(sums.sum() / counts.sum())


def probe_inputs(
    shards: data.Shards, n_docs: int, seq_len: int, offsets: list[int]
) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]:
    """The probe documents, the filler stream, and one unrelated document for each probe document (cut to
    the space the offsets leave, keeping its EOT); a DataError when the validation split is too small."""
    head = leading_stream(shards.val, shards.eot_id, n_docs, seq_len)
    docs, filler = probe_documents(head, shards.eot_id, n_docs, seq_len - max(offsets))
    if len(filler) < len(docs) * max(offsets):  # each document's own k tokens of other documents
        raise data.DataError(
            f"the validation split has {len(filler):,} tokens after the probe documents; the offset probe needs "
            f"{len(docs) * max(offsets):,}: lower probe_docs or probe_offsets, or raise val_fraction"
        )
    other_docs, _ = probe_documents(filler, shards.eot_id, len(docs), max(offsets) - 1)
    unrelated = [d if d[-1] == shards.eot_id else np.append(d[:-1], shards.eot_id) for d in other_docs]
    return docs, filler, unrelated


def run_probes(out_dir: Path, cfg: Config, n_docs: int, offsets: list[int]) -> dict:
    """The probe documents' loss after k tokens of other documents (the last of them an EOT; k = 1 is the
    EOT alone), and after one unrelated document and its EOT."""
    device = resolve_device(cfg.device)
    model, _, checkpoint = run_folder.load_run(out_dir, device)
    shards = data.load_shards(Path(checkpoint["shards"]))
    docs, filler, unrelated = probe_inputs(shards, n_docs, cfg.seq_len, offsets)
    offset_loss = {}
    for k in offsets:
        prefixes = [np.append(filler[i * k : i * k + k - 1], shards.eot_id) for i in range(len(docs))]
        offset_loss[str(k)] = doc_loss_in_rows(model, cfg, shards.eot_id, prefixes, docs, device)
    after_other = doc_loss_in_rows(model, cfg, shards.eot_id, unrelated, docs, device)
    result = {"offset_loss": offset_loss, "after_other": after_other}
    if not cfg.bos:
        result["start_after_eot"] = start_after_eot(model, cfg, shards, device)
    return result


def start_after_eot(model: GPT, cfg: Config, shards: data.Shards, device: torch.device) -> dict:
    """Every validation document of the evaluation (its first seq_len tokens) after one EOT, under the run's
    attention and positions: the start a packed run without the marker trains on (with the document mask,
    the same as alone). By position as the evaluation's `val_doc_*_by_position`, and the first text token,
    predicted from the EOT and scored here although the boundary loss mask ignores it in training."""
    val = np.asarray(data.leading_documents(shards.val, shards.eot_id, cfg.eval_tokens))
    starts, ends = data.document_bounds(val, shards.eot_id)
    rows = [np.append(shards.eot_id, val[s : min(e, s + cfg.seq_len)]) for s, e in zip(starts, ends)]
    flags = dataclasses.replace(cfg.flags, mask_boundary_loss=False)  # score the first text token too
    sums, counts = np.zeros(cfg.seq_len), np.zeros(cfg.seq_len, dtype=np.int64)
    first = []
    for losses in target_losses(model, flags, shards.eot_id, rows, device, cfg.dtype):
        first.append(losses[0])  # target j is text token j: j = 0 from the EOT, j = p + 1 from position p
        sums[: len(losses) - 1] += losses[1:]
        counts[: len(losses) - 1] += 1
    n = int((counts > 0).sum())
    return {
        "sum_by_position": [round(x, 4) for x in sums[:n].tolist()],
        "count_by_position": counts[:n].tolist(),
        "first_token_sum": float(np.sum(first)),
        "first_token_count": len(first),
    }


# ----------------------------------------------------------------------------------------------
# Running the grid


# Settings that cannot change a run's numbers; every other one decides whether a finished run is reused.
NOT_DECIDING = {"out_dir", "data_dir", "resume", "overwrite", "log_interval", "sample_prompt", "sample_tokens"} | {
    "wandb",
    "wandb_project",
    "wandb_run_name",
}


def decided_by(cfg: Config, study: Study, offsets: list[int], shard_folder: str) -> dict:
    """What decides a run's result: its training settings, the data (the shard folder's name holds a hash
    of the corpus content and the data settings) and the probes' settings."""
    return {
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_DECIDING},
        "shards": shard_folder,
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
    """Refuse a run folder that a study with other deciding settings started or finished."""
    for path in (out / "result.json", out / "study_run.json"):
        if not path.exists():
            continue
        try:
            recorded = json.loads(path.read_text())["decided_by"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{path} is damaged: delete {out} to run it again") from None
        if recorded != decided:
            before, now = flat(recorded), flat(decided)
            changed = ", ".join(k for k in before | now if before.get(k) != now.get(k))
            raise ConfigError(
                f"{out} was run with other settings than this study's ({changed}): give the study another "
                f"out_dir, or delete {out} to run it again"
            )


def run_one(cfg: Config, study: Study, decided: dict, offsets: list[int]) -> dict:
    """The run's result: read back when it finished before (check_reusable has vouched for it), else
    trained (or resumed) and probed."""
    out = Path(cfg.out_dir)
    done, started = out / "result.json", out / "study_run.json"
    if done.exists():
        return json.loads(done.read_text())["result"]
    out.mkdir(parents=True, exist_ok=True)
    run_folder.write_atomically(started, json.dumps({"decided_by": decided}))
    cfg.resume = (out / "ckpt.pt").exists()  # a run interrupted earlier continues from its checkpoint
    train.train(cfg)
    if run_folder.read_checkpoint(out / "ckpt.pt")["step"] != cfg.max_iters:
        raise StudyStopped(f"stopped during {out}; run the same command again to continue the study")
    records = [record for _, record in run_folder.read_metrics(out / "metrics.jsonl")]
    train_records = [r for r in records if "train_loss" in r]
    evals = [r for r in records if "val_doc_loss" in r]
    result = {
        **{k: v for k, v in evals[-1].items() if k != "step"},
        "curve": [(r["step"], r["val_doc_loss"]) for r in evals],
        "wall_seconds": training_seconds(train_records, cfg.batch_size * cfg.grad_accum * cfg.seq_len),
        "useful_tokens_per_sec": float(np.mean([r["counted_tokens_per_sec"] for r in train_records])),
        "steps": cfg.max_iters,
        "trained_at_commit": code_commit(),
        **run_probes(out, cfg, study.probe_docs, offsets),
    }
    if study.import_leak:
        result["import_leak"] = import_leak.probe_run(out, resolve_device(cfg.device), study.leak_pairs)
    # a run counts as finished only once its probes are written
    run_folder.write_atomically(done, json.dumps({"result": result, "decided_by": decided}))
    return result


def training_seconds(train_records: list[dict], tokens_per_step: int) -> float:
    """Time spent in training steps (evaluations excluded), from the logged rates, so that a run
    resumed after an interruption is timed like one that was not."""
    steps = np.diff([0] + [r["step"] for r in train_records])
    return float(sum(n * tokens_per_step / r["tokens_per_sec"] for n, r in zip(steps, train_records)))


class StudyStopped(Exception):
    pass


# ----------------------------------------------------------------------------------------------
# Endpoints and verdicts


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
        values = {
            v: {seed: endpoints(r, study, offsets) for seed, r in by_seed.items()} for v, by_seed in runs[pos].items()
        }
        for variant, by_seed in runs[pos].items():
            seeds = sorted(by_seed)
            baseline = BASELINES.get(variant, "reference")
            cell = {"seeds": seeds, "baseline": baseline, "endpoints": {}}
            shared = set.intersection(*(set(values[variant][s]) for s in seeds))
            for name in primary_endpoints(study, variant):
                if name not in shared or any(name not in values[baseline][s] for s in seeds):
                    raise ConfigError(
                        f"{pos}/{variant}: its primary endpoint {name} has no scored targets in every run"
                    )
            for name in [n for n in values[variant][seeds[0]] if n in shared]:
                own = [values[variant][s][name] for s in seeds]
                entry = {"values": own, "mean_sd": stats.mean_spread(own)}
                paired = name in DIFFERENCE_ENDPOINTS
                if paired and (variant == "reference" or any(name not in values[baseline][s] for s in seeds)):
                    cell["endpoints"][name] = entry  # nothing to compare with
                    continue
                reference = [values[baseline][s][name] for s in seeds] if paired else None
                if (paired and predicted_invariant(pos, variant)) or (not paired and probes_invariant(pos, variant)):
                    verdict, worst, bitwise = stats.invariance(own, reference, study.invariance_tolerance)
                    bound = stats.paired_effect(own, reference).bound()  # how far from 0, if not within tolerance
                    entry.update(
                        role="invariant", verdict=verdict, max_abs_difference=worst, bitwise=bitwise, bound=bound
                    )
                else:
                    effect = stats.paired_effect(own, reference)
                    primary = name in primary_endpoints(study, variant)
                    entry.update(
                        role="primary" if primary else "secondary",
                        estimate=effect.estimate,
                        se=effect.se,
                        df=effect.df,
                        ci90=list(effect.interval(0.90)),
                        ci95=list(effect.interval(0.95)),
                        bound=effect.bound(),
                        p_difference=effect.p_difference(),
                        p_equivalence=effect.p_equivalence(margin(study, name)) if primary else None,
                        p_wilcoxon=stats.signed_rank_p(own, reference) if primary else None,
                    )
                cell["endpoints"][name] = entry
            for name in ("val_loss", "wall_seconds", "useful_tokens_per_sec"):
                own = [by_seed[s][name] for s in seeds]
                cell["endpoints"][name] = {"values": own, "mean_sd": stats.mean_spread(own)}
            if "import_leak" in by_seed[seeds[0]]:
                cell["leak_growth"] = leak_growth([by_seed[s]["import_leak"] for s in seeds])
            cells[f"{pos}/{variant}"] = cell
    decide_primary(cells)
    return cells


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
    for key, entry in family.items():
        effect = stats.Effect(entry["estimate"], entry["se"], entry["df"])
        entry["p_difference_holm"], entry["p_equivalence_holm"] = difference[key], equivalence[key]
        entry["verdict"] = stats.primary_verdict(effect, difference[key], equivalence[key])
        # the robustness check for heavy tails: a difference verdict that the signed-rank test, Holm over the
        # same family, also reaches
        entry["p_wilcoxon_holm"] = signed_rank[key]
        if entry["verdict"] in ("hurts", "helps"):
            entry["robust"] = bool(signed_rank[key] < stats.ALPHA)


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


def environment() -> dict:
    commit = code_commit()
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
        "command": " ".join(["python -m studies.ablate", *sys.argv[1:]]),
    }


# ----------------------------------------------------------------------------------------------
# The report


ENDPOINT_NAMES = {
    "early": "early band",
    "middle": "middle band",
    "late": "late band",
    "val_doc_loss": "val_doc_loss",
    "from_second": "val_doc_loss from the second token",
    "doc_weighted": "document-weighted loss",
    "first_token": "first token (from the BOS)",
    "early_own_start": "early band, own start",
    "offset_effect": "offset effect",
    "contamination": "contamination",
    "leak_logprob": "Δ log P(import m)",
    "leak_vs_neutral": "Δ log P(import m) vs a neutral file",
    "leak_rate": "Δ sampled leak rate",
}


def describe_effect(entry: dict) -> str:
    """One cell of a table: the effect, its interval and what it says."""
    if entry["role"] == "invariant":
        how = "bitwise" if entry["bitwise"] else f"max \\|Δ\\| {entry['max_abs_difference']:.1e}"
        if entry["verdict"] == "invariant":
            return f"invariant ({how})"
        return f"not invariant within the tolerance ({how}; \\|Δ\\| < {entry['bound']:.4f})"
    low, high = entry["ci95"] if entry["role"] == "primary" else entry["ci90"]
    interval = "" if not math.isfinite(low) else f" [{low:+.3f}, {high:+.3f}]"
    if entry["role"] == "primary":
        robust = " (not robust)" if entry.get("robust") is False else ""
        return f"**{entry['verdict']}**{robust}: {entry['estimate']:+.3f}{interval}"
    return f"{entry['estimate']:+.3f}{interval}, \\|Δ\\| < {entry['bound']:.3f}"


def format_report(summary: dict, env: dict, study: Study, offsets: list[int], cfg: Config, extra: dict) -> str:
    def ms(pair, digits: int = 3) -> str:
        return f"{pair[0]:.{digits}f} ± {pair[1]:.{digits}f}"

    regime = extra["regime"]
    pad_factor = extra["pad_steps_factor"]
    seeds = {key: len(cell["seeds"]) for key, cell in summary.items()}
    roles = [(key, name, e.get("role")) for key, c in summary.items() for name, e in c["endpoints"].items()]
    n_primary = sum(1 for _, _, role in roles if role == "primary")
    lines = [
        "# Ablation results",
        "",
        f"- command: `{env['command']}`",
        f"- hardware: {env['hardware']}, torch {env['torch']}; runs trained at commit "
        f"{extra['trained_at']}, this report written at commit {env['commit']}",
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
        f"- wall time of the study: {extra['wall']}",
        "",
        "## Pre-registered endpoints and decision rules",
        "",
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
        + "; paired, each cell with its own variance, n - 1 degrees of freedom).",
        f"- verdicts at family-wise α = {stats.ALPHA} (Holm, over the {n_primary} primary tests, once for "
        "difference and once for equivalence): `negligible` when the equivalence test (TOST) rejects "
        f"|effect| ≥ {study.margin_band} nats (bands) or {study.margin_doc_loss} (val_doc_loss); else `hurts` / "
        "`helps` when the difference test rejects 0; else `unresolved`. The interval shown is the "
        "unadjusted 95% one. Together the two families can err with probability at most "
        f"{2 * stats.ALPHA:g} (a false difference or a false equivalence, each held to {stats.ALPHA}). Robustness "
        "for heavy tails: Wilcoxon's signed-rank test of the same differences, Holm over the same family; a "
        "`hurts` or `helps` it does not reach is marked `(not robust)`.",
        f"- secondary: the middle band (positions {study.middle_band[0]}-{study.middle_band[1] - 1}), the other "
        "of early band and val_doc_loss, the offset effect (the probe documents' loss after "
        f"{max(offsets)} tokens of other documents minus after an EOT alone) and the contamination (after one "
        "foreign document and its EOT minus after an EOT alone): the estimate, its 90% interval and the bound "
        "|Δ| < X that it gives.",
        "- invariant: where theory predicts no change (RoPE with the document mask needs no position reset; "
        "with the mask, and reset or RoPE, nothing before a document changes it), each seed's value is "
        f"checked against the reference's (or 0): within {study.invariance_tolerance:g} nats, bitwise where "
        "equal.",
        "",
        "## Primary endpoints",
        "",
        "The reference's mean is over the cell's own seeds. Holm p: the adjusted p-values of the difference "
        "and the equivalence test.",
        "",
        "| position kind | variant | endpoint | baseline | variant | effect [95% CI]: verdict | Holm p | seeds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
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
            lines.append(
                f"| {pos} | {variant} | {ENDPOINT_NAMES[name]} | {ms(stats.mean_spread(ref))} | {ms(entry['mean_sd'])} "
                f"| {describe_effect(entry)} | {holm_p} | {len(cell['seeds'])} |"
            )
    secondary = [name for name in ENDPOINT_NAMES if any(name in c["endpoints"] for c in summary.values())]
    lines += [
        "",
        "## Secondary endpoints and invariances",
        "",
        "Bounds from the 90% interval (primary cells repeat their verdict).",
        "",
        "| cell | " + " | ".join(ENDPOINT_NAMES[n] for n in secondary) + " |",
        "|" + " --- |" * (1 + len(secondary)),
    ]
    for key, cell in summary.items():  # the reference too: its probes are checked for invariance
        row = []
        for name in secondary:
            entry = cell["endpoints"].get(name)
            row.append("" if entry is None or "role" not in entry else describe_effect(entry))
        lines.append(f"| {key} | " + " | ".join(row) + " |")
    lines += [
        "",
        "## Each cell (mean ± sd over seeds)",
        "",
        "Runs went in a random order within each seed, so machine load is spread over the variants; the train "
        "time excludes evaluation.",
        "",
        "| cell | seeds | val_doc_loss | early band | middle band | val_loss (own packing) | train s | useful tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, cell in summary.items():
        e = cell["endpoints"]
        lines.append(
            f"| {key} | {len(cell['seeds'])} | {ms(e['val_doc_loss']['mean_sd'])} | {ms(e['early']['mean_sd'])} "
            f"| {ms(e['middle']['mean_sd'])} | {ms(e['val_loss']['mean_sd'])} | {e['wall_seconds']['mean_sd'][0]:.1f} "
            f"| {e['useful_tokens_per_sec']['mean_sd'][0]:,.0f} |"
        )
    leaks = {key: cell["leak_growth"] for key, cell in summary.items() if "leak_growth" in cell}
    if leaks:
        settings = [k for k in next(iter(leaks.values())) if k.startswith("k=")]
        lines += [
            "",
            "## Import leak",
            "",
            "Pairs (A, B) of validation files where A imports a module m that B never mentions "
            "(studies/import_leak.py). Δ log P(`import m` or `from m import`) at B's first import with k files "
            "importing m before B (each cut after that import, or with `extra` more of its tokens), minus B alone; "
            "and the share of import lines sampled there that name a module of the file before, with it before "
            "and alone. Mean ± sd over seeds.",
            "",
            "| cell | " + " | ".join(k.replace(",", ", ") for k in settings) + " | sampled: before | alone |",
            "|" + " --- |" * (3 + len(settings)),
        ]
        for key, growth in leaks.items():
            cells = ["" if growth[k] is None else ms(growth[k]) for k in settings]
            sampled = f"{growth['sampled_after'][0]:.1%} | {growth['sampled_alone'][0]:.1%}"
            lines.append(f"| {key} | " + " | ".join(cells) + f" | {sampled} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict, summary: dict, study: Study, offsets: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(runs)

    def panels(width: float = 6):
        fig, axes = plt.subplots(1, len(kinds), figsize=(width * len(kinds), 4.5), sharey=True, squeeze=False)
        for ax, pos in zip(axes[0], kinds):
            ax.set_title(f"pos_emb = {pos}")
            ax.grid(alpha=0.3)
        return fig, axes[0]

    # effects.png: every primary effect with its 95% interval
    fig, axes = panels()
    for ax, pos in zip(axes, kinds):
        rows = [
            (f"{variant}: {ENDPOINT_NAMES[name]}", entry)
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
        ax.set_xlabel("effect vs baseline (nats), 95% CI")
    run_folder.save_figure(fig, out / "effects.png")

    # loss_by_position.png: difference to the reference by position within the document
    fig, axes = panels()
    for ax, pos in zip(axes, kinds):
        n = min(len(r["val_doc_count_by_position"]) for cell in runs[pos].values() for r in cell.values())
        edges = np.unique(np.r_[0, np.geomspace(1, n, 14).astype(int)])
        centers = [(a + b - 1) / 2 for a, b in zip(edges[:-1], edges[1:])]
        for variant, cell in runs[pos].items():
            if variant == "reference":
                continue
            ref = runs[pos][BASELINES.get(variant, "reference")]
            deltas = [
                [band_loss(cell[s], [a, b]) - band_loss(ref[s], [a, b]) for a, b in zip(edges[:-1], edges[1:])]
                for s in cell
            ]
            ax.plot(centers, np.mean(deltas, axis=0), marker="o", ms=3, label=variant)
        ax.axhline(0, color="black", lw=0.8)
        ax.axvspan(study.early_band[0], study.early_band[1] - 1, color="gray", alpha=0.15)
        ax.set_xscale("symlog")
        ax.set_xlabel("position within the document (early band shaded)")
    axes[0].set_ylabel("loss minus its baseline's (same seed)")
    axes[0].legend(fontsize=8)
    run_folder.save_figure(fig, out / "loss_by_position.png")

    # offset_probe.png: the probe documents' loss by what precedes them
    fig, axes = panels()
    for ax, pos in zip(axes, kinds):
        for variant, cell in runs[pos].items():
            losses = np.array([[r["offset_loss"][str(k)] for k in offsets] for r in cell.values()])
            ax.errorbar(offsets, losses.mean(0), yerr=losses.std(0), marker="o", capsize=3, label=variant)
        ax.set_xscale("log")
        ax.set_xlabel("tokens of other documents before the document (1: the EOT alone)")
    axes[0].set_ylabel("loss on the document")
    axes[0].legend(fontsize=8)
    run_folder.save_figure(fig, out / "offset_probe.png")

    if all("import_leak" in r for pos in runs for cell in runs[pos].values() for r in cell.values()):
        fig, axes = panels()
        for ax, pos in zip(axes, kinds):
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
        run_folder.save_figure(fig, out / "import_leak.png")
    plt.close("all")


def usage() -> str:
    return help_text(__doc__, cls=Study) + "\n\n...and any train.py setting (python train.py --help)."


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    try:
        study, train_args = parse_args(argv)
        base = parse_config(train_args)
        check_against(study, base)
        offsets = sorted(set(study.probe_offsets) | {1, base.seq_len // 2})
        if max(offsets) >= base.seq_len - 1:
            raise ConfigError(f"probe_offsets must be below seq_len - 1 = {base.seq_len - 1}")
        if base.max_iters < 1:
            raise ConfigError("max_iters must be at least 1 for a study")
        out = Path(study.out_dir)
        run_folder.check_writable_folder(out, "out_dir")  # before any work: the study ends by writing its report here
        shard_path = prepare_for(base)
        shards = data.load_shards(shard_path)
        bos_id = shards.vocab_size if base.bos else None
        pad_factor = pad_steps_factor(shards, base.seq_len, bos_id)
        regime = packing_regime(shards, base.seq_len, bos_id)
        # the probes run after each training run: a validation split too small for them fails here, first
        probe_inputs(shards, study.probe_docs, base.seq_len, offsets)
        if study.import_leak:
            leak_pairs = import_leak.validation_pairs(shards, data.load_tokenizer(shard_path), study.leak_pairs)
            import_leak.fitting_pairs(leak_pairs, base.seq_len)
        seeds = seeds_of_cells(study)
        planned = []
        for pos, variant, seed in run_order(seeds):
            cfg = run_config(train_args, pos, variant, seed, out / pos / variant / f"seed{seed}", pad_factor)
            decided = decided_by(cfg, study, offsets, shard_path.name)
            check_reusable(Path(cfg.out_dir), decided)  # every run before the first trains
            planned.append((pos, variant, seed, cfg, decided))
        runs: dict = {pos: {v: {} for v in study.variants} for pos in study.pos_embs}
        t0, trained = time.time(), 0
        for i, (pos, variant, seed, cfg, decided) in enumerate(planned):
            fresh = not (Path(cfg.out_dir) / "result.json").exists()
            print(
                f"\n=== run {i + 1}/{len(planned)}: pos_emb={pos} {variant} seed={seed}"
                + ("" if fresh else " (finished before: skipped)"),
                flush=True,
            )
            runs[pos][variant][seed] = run_one(cfg, study, decided, offsets)
            trained += fresh
            if fresh:
                remaining = sum(1 for *_, c, _ in planned[i + 1 :] if not (Path(c.out_dir) / "result.json").exists())
                eta = run_folder.format_duration((time.time() - t0) / trained * remaining)
                print(f"=== study: {i + 1}/{len(planned)} runs done, ETA {eta}", flush=True)
    except StudyStopped as e:
        print(e)
        return 0
    except (ConfigError, data.DataError, train.TrainingDiverged, run_folder.SaveFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # a second stop signal, or one outside training (the probes)
        print("\ninterrupted: run the same command to continue the study", file=sys.stderr)
        return interrupted_exit_code(e)
    try:
        write_report(runs, study, offsets, base, regime, pad_factor, out)
    except run_folder.SaveFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def write_report(runs: dict, study: Study, offsets: list[int], base: Config, regime: dict, pad_factor: float, out):
    runs = {pos: {v: dict(sorted(cell.items())) for v, cell in kinds.items()} for pos, kinds in runs.items()}
    summary = summarise(runs, study, offsets)
    env = environment()
    wall = sum(r["wall_seconds"] for kinds in runs.values() for cell in kinds.values() for r in cell.values())
    commits = sorted(
        {r.get("trained_at_commit", "not recorded") for k in runs.values() for c in k.values() for r in c.values()}
    )
    extra = {
        "regime": regime,
        "pad_steps_factor": pad_factor,
        "wall": f"{wall / 60:.0f} min of training steps",
        "trained_at": ", ".join(commits),
    }
    report = format_report(summary, env, study, offsets, base, extra)
    everything = {"environment": env, "study": dataclasses.asdict(study), "probe_offsets": offsets, **extra}
    run_folder.write_atomically(out / "results.json", json.dumps({**everything, "summary": summary, "runs": runs}))
    run_folder.write_atomically(out / "results.md", report)
    plot(runs, summary, study, offsets, out)
    print("\n" + report)
    leak_figure = ", import_leak.png" if study.import_leak else ""
    print(f"wrote {out / 'results.md'}, results.json, effects.png, loss_by_position.png, offset_probe.png{leak_figure}")


if __name__ == "__main__":
    run_main(main)
