"""The ladder's combined report: every cell's effects at each rung, against the tokens it trained on.

    python -m studies.ladder configs/ladder_rung1.toml configs/ladder_rung2.toml configs/ladder_rung3.toml
    python -m studies.ladder configs/ladder_rung{1,2,3}.toml --studies_dir=results/history --out_dir=DIR
                                                          # the committed rungs (--out_dir=results/history/ladder:
                                                          # into the committed ladder)

Each rung is a study of its own (`python -m studies.ablate <config>`), decided by its own pre-registered
family; its results.json, in the study's out_dir (or in --studies_dir=DIR, under the last part of that
out_dir's name: results/history/ladder_rung1 for out/ladder_rung1), holds every run. This decides each rung's family
again from its runs, with the statistics of this code (as `python -m studies.report` does), and puts them
side by side: ladder.md (a table per position kind, a column per rung), ladder.json (each rung's tokens,
tokens a parameter and summary) and effects.png (each variant's effects against training tokens, with 95%
intervals), written to --out_dir (out/ladder unless given). A rung whose runs have not finished is left out,
with a line saying so. Timing is not read: it depends on what else the machine ran. Under the marker each
rung also gets a line: how far its late band effects move without the position an older evaluation filled
from later chunks (late_band_shift).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from cli import run_main
from errors import ConfigError, SaveFailed
from resolve import model_settings, parameter_count
from run.folder import check_writable_folder, write_atomically
from studies.plan import VARIANTS, Study, parse_args
from studies.report import ENDPOINT_NAMES, describe_effect, save_figure, saved_runs, settings_changed, summarise
from studies.tables import markdown_table

# the rows of the tables, in this order, where a rung measured them
BY_POSITION = ("val_doc_loss_sum_by_position", "val_doc_count_by_position")
ENDPOINTS = ("early", "late", "val_doc_loss", "from_second", "doc_weighted", "early_own_start", "first_token")


@dataclass
class Rung:
    config: str
    tokens: int  # trained per run of the reference
    parameters: int
    summary: dict  # "pos/variant" -> seeds and endpoints, decided again from the rung's runs
    late_shift: float | None = None  # see late_band_shift

    @property
    def label(self) -> str:
        per_parameter = self.tokens / self.parameters
        return f"{Path(self.config).stem}: {self.tokens / 1e6:.2f}M tokens ({per_parameter:.1f} a parameter)"


def read_rung(config: str, studies_dir: Path | None) -> Rung | None:
    """A rung from its config and its study's results.json (in the study's out_dir, or in studies_dir under
    the out_dir's last part); None when the study has not finished."""
    study, base = parse_args([config])
    if base.tokenizer != "bpe":  # a named or file tokenizer's size is known only once it is loaded
        raise ConfigError(f"{config}: tokenizer={base.tokenizer!r}; the ladder counts parameters for a 'bpe' one")
    folder = Path(study.out_dir) if studies_dir is None else studies_dir / Path(study.out_dir).name
    results = folder / "results.json"
    if not results.is_file():
        run = shlex.join(["python", "-m", "studies.ablate", config])
        how = f"run: {run}, or read the committed rungs with --studies_dir=results/history"
        print(f"{config}: no {results} yet ({how}); left out", file=sys.stderr)
        return None
    try:
        saved = json.loads(results.read_text())
        runs, offsets = saved_runs(saved), saved["probe_offsets"]
        changed = settings_changed(saved, study, base)
        summary = summarise(runs, study, offsets)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise ConfigError(f"{results} cannot be read as a study's results ({type(e).__name__}: {e})") from None
    if changed:
        raise ConfigError(
            f"{results} was written by a study with other settings than {config} ({', '.join(changed)}): "
            "give the config it ran with, or run the study again"
        )
    vocab = base.tokenizer_vocab_size + base.bos
    parameters = parameter_count(model_settings(base, vocab))
    tokens = base.max_iters * base.batch_size * base.grad_accum * base.seq_len
    shift = late_band_shift(runs, summary, study, offsets, base.seq_len) if base.bos and study.late_band else None
    return Rung(config, tokens, parameters, summary, shift)


def late_band_shift(runs: dict, summary: dict, study: Study, offsets: list[int], seq_len: int) -> float:
    """Under the marker, evaluations before 2026-12-02 also counted, at text position seq_len - 1, the first
    token of a long document's second chunk, predicted with nothing before it. The largest change of a late
    band effect when that position is left out, as evaluation has done since."""
    first_rows = {
        pos: {
            variant: {seed: {**r, **{k: r[k][: seq_len - 1] for k in BY_POSITION}} for seed, r in cell.items()}
            for variant, cell in kinds.items()
        }
        for pos, kinds in runs.items()
    }
    again = summarise(first_rows, study, offsets)
    return max(
        (
            abs(again[key]["endpoints"]["late"]["estimate"] - cell["endpoints"]["late"]["estimate"])
            for key, cell in summary.items()
            if "estimate" in cell["endpoints"].get("late", {})
        ),
        default=0.0,
    )


def ladder_tables(rungs: list[Rung]) -> list[str]:
    """Per position kind, a row per (variant, endpoint) that some rung measured, a column per rung."""
    lines = []
    kinds = sorted({key.split("/")[0] for rung in rungs for key in rung.summary})
    for pos in kinds:
        rows = []
        for variant in VARIANTS:
            for name in ENDPOINTS:
                entries = [rung.summary.get(f"{pos}/{variant}", {}).get("endpoints", {}).get(name) for rung in rungs]
                if any(entry and "role" in entry for entry in entries):
                    cells = [describe_effect(e) if e and "role" in e else "" for e in entries]
                    rows.append([variant, ENDPOINT_NAMES[name], *cells])
        lines += [f"### {pos}", "", *markdown_table(["variant", "endpoint", *(r.label for r in rungs)], rows), ""]
    return lines


def shift_notes(rungs: list[Rung]) -> list[str]:
    return [
        f"- {rung.label}: leaving out the late band's last position (a later chunk's start, under the marker) "
        f"moves its effects by at most {rung.late_shift:.1e} nats."
        for rung in rungs
        if rung.late_shift is not None
    ]


def primary_in_some_rung(rungs: list[Rung], pos: str, variant: str) -> list[str]:
    cells = [rung.summary.get(f"{pos}/{variant}", {}).get("endpoints", {}) for rung in rungs]
    return [name for name in ENDPOINTS if any(cell.get(name, {}).get("role") == "primary" for cell in cells)]


def plot(rungs: list[Rung], out: Path) -> None:
    """A panel per variant: its primary effects for each position kind, against training tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    variants = [v for v in VARIANTS if any(k.endswith(f"/{v}") for rung in rungs for k in rung.summary)]
    variants = [v for v in variants if v != "reference"]
    columns = 3
    ticks = [rung.tokens for rung in rungs]
    fig, axes = plt.subplots(-(-len(variants) // columns), columns, figsize=(15, 4 * -(-len(variants) // columns)))
    for ax, variant in zip(axes.flat, variants):
        series = [(pos, name) for pos in ("learned", "rope") for name in primary_in_some_rung(rungs, pos, variant)]
        for i, (pos, name) in enumerate(series):
            nudge = 1.06 ** (i - (len(series) - 1) / 2)  # side by side, so that the intervals do not hide each other
            points = [
                (rung.tokens, rung.summary[key]["endpoints"][name])
                for rung in rungs
                if (key := f"{pos}/{variant}") in rung.summary
                and "estimate" in rung.summary[key]["endpoints"].get(name, {})
            ]
            if not points:
                continue
            x = [tokens * nudge for tokens, _ in points]
            y = [entry["estimate"] for _, entry in points]
            low = [entry["estimate"] - entry["ci95"][0] for _, entry in points]
            high = [entry["ci95"][1] - entry["estimate"] for _, entry in points]
            ax.errorbar(x, y, yerr=[low, high], marker="o", capsize=3, label=f"{pos}: {ENDPOINT_NAMES[name]}")
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{tokens / 1e6:.2g}M" for tokens in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(min(ticks) / 1.6, max(ticks) * 1.6)
        ax.set_title(f"{variant} (its baseline subtracted)")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("effect on loss (nats)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(variants) :]:
        ax.set_visible(False)
    fig.tight_layout()
    save_figure(fig, out / "effects.png")
    plt.close(fig)


def option(argv: list[str], prefix: str) -> str | None:
    """The value of the last argument that starts with `prefix` ("--name="), or None."""
    values = [a.removeprefix(prefix) for a in argv if a.startswith(prefix)]
    return values[-1] if values else None


def main(argv: list[str]) -> int:
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0 if argv else 2
    configs = [a for a in argv if not a.startswith("--")]
    unknown = [a for a in argv if a.startswith("--") and not a.startswith(("--out_dir=", "--studies_dir="))]
    if unknown or not configs:
        what = f"unknown argument {unknown[0]!r}" if unknown else "no rung config given"
        print(f"error: {what}: give rung configs, --studies_dir=DIR and --out_dir=DIR", file=sys.stderr)
        return 2
    out = Path(option(argv, "--out_dir=") or "out/ladder")  # under out/, which git ignores: never a committed one
    studies_dir = option(argv, "--studies_dir=")
    try:
        read = [read_rung(config, Path(studies_dir) if studies_dir else None) for config in configs]
        rungs = [rung for rung in read if rung is not None]
        if not rungs:
            raise ConfigError("no rung has finished: nothing to report")
        rungs.sort(key=lambda rung: rung.tokens)
        check_writable_folder(out, "out_dir")
        report = "\n".join(["# The ladder: each verdict at each rung", "", *ladder_tables(rungs), *shift_notes(rungs)])
        plot(rungs, out)  # first: a figure that cannot be drawn leaves the old tables whole
        write_atomically(out / "ladder.md", report)
        write_atomically(out / "ladder.json", json.dumps([dataclasses.asdict(r) for r in rungs], indent=1))
    except (ConfigError, SaveFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report)
    print(f"wrote {out / 'ladder.md'}, ladder.json and effects.png")
    return 0


if __name__ == "__main__":
    run_main(main)
