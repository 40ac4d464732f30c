"""A study's plan: its settings (the [ablate] table), the variants and what each is compared with, the
endpoints that are primary for each, the cells theory predicts invariant, and which seeds run in which order.
studies/ablate.py runs the plan; studies/report.py turns its results into verdicts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cli import check_bounds, command_line_values, read_config_file, settings_from
from config import Config, eval_token_budget, setting, validate, warmup_steps
from errors import ConfigError

POSITION_KINDS = ("learned", "rope")
MOST_SEEDS = 10_000  # a cell's seeds: far beyond any budget, and each a run folder
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
    "in_context",
    "bpb",
    "bpb_in_context",
    "doc_weighted",
    "first_token",
    "early_own_start",
)
WHOLE_DOCUMENT_ENDPOINTS = ("val_doc_loss", "from_second", "in_context", "doc_weighted")  # margin: margin_doc_loss
BANDS = {"early": "early_band", "middle": "middle_band", "late": "late_band", "early_own_start": "early_band"}


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
    seeds: int = setting(
        3, "seeds of each cell, unless seeds_by_variant names its variant", minimum=1, maximum=MOST_SEEDS
    )
    seeds_by_variant: dict[str, int] = setting({}, "seeds of these variants, e.g. no_mask_boundary_loss=12")
    invariance_seeds: int = setting(
        2,
        "seeds of a cell predicted equal to the reference (RoPE without position reset): enough to check it",
        minimum=1,
        maximum=MOST_SEEDS,
    )
    first_seed: int = setting(0, "seeds run first_seed, first_seed + 1, ...; new seeds make a new study", minimum=0)
    early_band: list[int] = setting(
        [0, 16], "[first, last + 1) within-document positions of the primary band", minimum=0
    )
    middle_band: list[int] = setting([16, 64], "[first, last + 1) positions of the secondary band", minimum=0)
    late_band: list[int] = setting([], "[first, last + 1) positions of the late band ([]: none)", minimum=0)
    primary: dict[str, list[str]] = setting(
        {},
        "primary endpoints of these variants ([]: none, a study another one's registration reads; others: their "
        "flag's default, e.g. no_doc_mask = early); "
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
    threads: int = setting(
        0,
        "torch threads of every run (0: torch's default); fixed within a study, since the thread count changes "
        "the order of float sums, which training amplifies",
        minimum=0,
    )
    decided_in: str = setting(
        "",
        "the registration that decides this study's primary tests together with other studies' (python -m "
        "studies.confirm); its own report then gives their effects and intervals, no verdicts",
    )
    import_leak: bool = setting(False, "also run import_leak.py's probe on every run (needs whole Python files)")
    leak_pairs: int = setting(64, "pairs of the import-leak probe at most", minimum=1)

    def validate(self) -> None:
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
            if unknown:
                raise ConfigError(
                    f"primary.{variant}={names}: choose endpoints among {', '.join(DIFFERENCE_ENDPOINTS)}"
                )
        unknown = set(self.seeds_by_variant) - set(VARIANTS)
        if unknown:
            raise ConfigError(f"seeds_by_variant names no variant {', '.join(sorted(unknown))}")
        if any(n < 1 or n > MOST_SEEDS for n in self.seeds_by_variant.values()):
            raise ConfigError(f"seeds_by_variant: every count must be at least 1 and at most {MOST_SEEDS}")
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


def parse_args(argv: list[str]) -> tuple[Study, Config]:
    """(study settings, the reference's training settings) from a TOML file and --key=value overrides of
    either, each checked as train.py checks its own."""
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
    base = settings_from(Config, values, "python train.py --help")
    validate(base)
    return study, base


def check_against(study: Study, base: Config) -> None:
    """What the study asks is possible with these training settings: a reference that packs rows with every
    fix on (the variants turn them off, and the invariance predictions assume it), every band holding a
    scored position, every variant a change from what it is compared with, every cell with a primary test
    run on at least two seeds, the first-token endpoint only where both sides have the start marker.
    Checked before any data is prepared or any file written."""
    fixes = ("doc_mask", "reset_position_ids", "mask_boundary_loss")
    off = [f"{flag}=false" for flag in fixes if not getattr(base, flag)]
    if off:
        raise ConfigError(
            f"{', '.join(off)}: a study's reference trains with every fix on; its variants turn them off one at a time"
        )
    if base.packing == "pad":
        raise ConfigError(
            "packing=pad: a study's reference packs documents into rows (concat or bestfit); pad is a variant"
        )
    scored = base.seq_len - int(base.bos)  # under the marker, a row's last slot holds no document's text position
    for name in ("early_band", "middle_band", "late_band"):
        band = getattr(study, name)
        if band and band[1] > base.seq_len:
            raise ConfigError(f"{name}={band} reaches past seq_len={base.seq_len}: no position there is scored")
        if band and band[0] >= scored:
            raise ConfigError(f"{name}={band}: positions are scored below {scored} only, with these settings")
    for variant in study.variants:
        if "late" in primary_endpoints(study, variant) and not study.late_band:
            raise ConfigError(f"primary.{variant} names late, but late_band is empty: give it a band")
    settings = {v: {**dataclasses.asdict(base), **VARIANTS[v]} for v in study.variants}
    for variant in study.variants:
        baseline = BASELINES.get(variant, "reference")
        if variant != baseline and settings[variant] == settings[baseline]:
            raise ConfigError(
                f"variant {variant} changes nothing from {baseline} with these settings "
                f"({', '.join(f'{k}={v}' for k, v in VARIANTS[variant].items())} already): drop it from variants"
            )
    for (pos, variant), seeds in seeds_of_cells(study).items():
        if primary_endpoints(study, variant) and not predicted_invariant(pos, variant) and len(seeds) < 2:
            raise ConfigError(
                f"{pos}/{variant} has a primary test but runs on {len(seeds)} seed: a paired test needs at least 2"
            )
    for variant in study.variants:
        wanted = study.primary.get(variant, PRIMARY_ENDPOINTS.get(variant, []))
        both = (settings[variant], settings[BASELINES.get(variant, "reference")])
        if "first_token" in wanted and not all(side["bos"] for side in both):
            raise ConfigError(f"primary.{variant} = first_token needs the start marker (bos) on both sides")


def empty_bands(study: Study, scored: int) -> list[str]:
    """The bands that hold no scored target when the validation documents are scored at positions below
    `scored` only (their longest text, at most a row's): reported as empty. A primary endpoint on one could
    never be decided, and is refused before anything trains."""
    bands = {name: getattr(study, name) for name in ("early_band", "middle_band", "late_band")}
    empty = [name for name, band in bands.items() if band and band[0] >= scored]  # late_band may be none: []
    for variant in study.variants:
        for endpoint in (e for e in primary_endpoints(study, variant) if BANDS.get(e) in empty):
            band = getattr(study, BANDS[endpoint])
            raise ConfigError(
                f"primary.{variant} = {endpoint}: {BANDS[endpoint]}={band} holds no scored target, since the "
                f"validation documents end before position {scored} (the longest, at most a row); give a band below "
                f"{scored}, or data with longer documents"
            )
    return empty


def primary_endpoints(study: Study, variant: str) -> list[str]:
    return study.primary.get(variant, PRIMARY_ENDPOINTS.get(variant, []))


def predicted_invariant(pos: str, variant: str) -> bool:
    """Theory says this cell trains the same model as the reference, to float rounding: with the document
    mask (check_against requires it of the reference), RoPE's attention scores depend only on i - j, so
    resetting positions changes nothing."""
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


def run_config(base: Config, pos_emb: str, variant: str, seed: int, out_dir: Path, pad_factor: float) -> Config:
    """One run's settings: the reference's with the variant's changes, checked like any setting."""
    cfg = dataclasses.replace(
        base, pos_emb=pos_emb, seed=seed, out_dir=str(out_dir), sample_tokens=0, **VARIANTS[variant]
    )
    # every run evaluates on the same documents: an automatic budget is fixed before pad's schedule stretches;
    # a default warmup is a tenth of the reference's steps, also for pad
    cfg = dataclasses.replace(cfg, warmup_iters=warmup_steps(cfg), eval_tokens=eval_token_budget(cfg))
    if variant == "pad":  # the same real training tokens: more steps, with the schedule stretched to match
        # (pad_equal_compute keeps the packed run's steps: the same FLOPs, fewer real tokens)
        stretched = {
            key: round(getattr(cfg, key) * pad_factor) for key in ("max_iters", "warmup_iters", "eval_interval")
        }
        cfg = dataclasses.replace(
            cfg, **{key: value if key == "warmup_iters" else max(1, value) for key, value in stretched.items()}
        )  # no warmup stays none
    check_bounds(cfg)
    validate(cfg)
    return cfg
