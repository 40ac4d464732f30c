"""How each packing holds the documents, side by side, and what planning best-fit rows costs.

    python -m bench.packing                                  # stdlib and packages at 256, 1024, 8192
    python -m bench.packing --datasets=stdlib --seq_lens=1024 --bos=true
    python -m bench.packing --plan_documents=2000000         # and best-fit planning at 2M documents

For each dataset (prepared as train.py prepares it, with the default data settings) and seq_len: the training
split's packing statistics under concat, bestfit and pad, as every run logs them at its start
(reports.packing_statistics). With --plan_documents: a synthetic split of that many documents, their lengths
drawn from the first dataset's, written as a shard file and memory-mapped like real shards; its rows are
planned in a child process (finding the documents, then best fit), whose time and memory are reported: its
peak resident memory, how much of it is the memory-mapped split's pages (which the OS can drop, and which
every run maps anyway), and its anonymous memory once the rows are planned. Writes --out (JSON and a
markdown twin) and prints the table.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from config import setting
from reports import describe_packing, packing_statistics
from studies.tables import markdown_table

PACKINGS = ("concat", "bestfit", "pad")
STATISTICS = {  # column: key of packing_statistics
    "documents a row": "documents_per_row",
    "padding": "padding_share",
    "documents split or cut": "documents_split_or_cut",
    "tokens with their document's start in the row": "tokens_with_their_document_start_in_the_row",
    "tokens that could see another document": "tokens_seeing_another_document_without_the_mask",
}


def plan_child(path: str, n_tokens: int, seq_len: int, eot_id: int) -> None:
    """Child process: plan best-fit rows over a memory-mapped split; prints the figures as JSON."""
    import data
    from shards import TokenStream

    t0 = time.perf_counter()
    stream = TokenStream([np.memmap(path, dtype=np.uint16, mode="r", shape=(n_tokens,))])
    documents = data.Documents(stream, eot_id)
    found = time.perf_counter() - t0
    rows = data.bestfit_rows(documents, seq_len)
    seconds = time.perf_counter() - t0
    padding = 1 - rows.length.sum() / (len(rows) * (seq_len + 1))
    # from the process's own memory map (getrusage's peak would include its parent's, from before exec);
    # RssFile: pages of the memory-mapped split, which the OS can drop and every run maps anyway
    memory = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    gb = {key: int(memory[key].split()[0]) / 2**20 for key in ("VmHWM", "RssAnon", "RssFile")}
    figures = {
        "documents": len(documents),
        "rows": len(rows),
        "seconds": seconds,
        "finding_documents_seconds": found,
        "padding_share": float(padding),
        "peak_rss_gb": gb["VmHWM"],
        "mapped_split_gb": gb["RssFile"],
        "anonymous_gb": gb["RssAnon"],
    }
    print(json.dumps(figures))


def planning(lengths: np.ndarray, n_documents: int, seq_len: int, work: Path) -> dict:
    """Best-fit planning of n_documents whose lengths are drawn from `lengths`, in a child process."""
    from bench.preparation import measure

    drawn = np.random.default_rng(0).choice(lengths, n_documents)
    eot = 65535
    path = work / "synthetic.bin"
    with open(path, "wb") as f:  # documents of random text tokens, each ending in EOT, written in pieces
        for chunk in np.array_split(drawn, max(1, n_documents // 100_000)):
            tokens = np.random.default_rng(len(chunk)).integers(0, eot, int(chunk.sum()), dtype=np.uint16)
            tokens[np.cumsum(chunk) - 1] = eot
            tokens.tofile(f)
    n_tokens = int(drawn.sum())
    code = f"from bench import packing; packing.plan_child({str(path)!r}, {n_tokens}, {seq_len}, {eot})"
    result = measure([sys.executable, "-c", code])
    path.unlink()
    return {"tokens": n_tokens, "seq_len": seq_len, **json.loads(result["output"]), "wall_seconds": result["seconds"]}


@dataclass
class PackingBenchSettings:
    datasets: list[str] = setting(["stdlib", "packages"], "datasets (train.py's --dataset)")
    seq_lens: list[int] = setting([256, 1024, 8192], "row lengths", minimum=2)
    bos: bool = setting(False, "with the start marker")
    data_dir: str = setting("data", "where prepared shards are kept", path=True)
    plan_documents: int = setting(0, "also time best-fit planning of this many documents (0: not)", minimum=0)
    out: str = setting("bench_packing.json", "results (JSON; and .md)", path=True)


def main(argv: list[str]) -> int:
    from cli import parse_config, script_settings
    from errors import ConfigError, DataError, SaveFailed
    from run.folder import write_atomically

    args = script_settings(PackingBenchSettings, argv, __doc__, "python -m bench.packing")
    seq_lens = args.seq_lens
    if not seq_lens or not args.datasets:
        print("error: give at least one dataset and one seq_len", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        write_atomically(out, "{}")  # fails now, not after the benchmark, if the file cannot be written
        return benchmark(args, seq_lens, out, parse_config)
    except (ConfigError, DataError, SaveFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk or a file-size limit while the synthetic split is written
        print(f"error: could not write the synthetic split ({e.strerror or e}); nothing was kept", file=sys.stderr)
        return 1


def benchmark(args, seq_lens: list[int], out: Path, parse_config) -> int:
    import data
    from prepare import prepare_for
    from run.folder import write_atomically
    from shards import load_shards, load_tokenizer, start_marker_id

    rows, first_lengths = [], None
    for dataset in args.datasets:
        shard_path = prepare_for(parse_config([f"--dataset={dataset}", f"--data_dir={args.data_dir}"]))
        shards = load_shards(shard_path)
        bos_id = start_marker_id(load_tokenizer(shard_path)) if args.bos else None
        documents = data.Documents(shards.train, shards.eot_id, bos_id)
        first_lengths = documents.lengths if first_lengths is None else first_lengths
        for seq_len in seq_lens:
            for packing in PACKINGS:
                t0 = time.perf_counter()
                planned = data.PACKINGS[packing](documents, seq_len)
                seconds = time.perf_counter() - t0
                stats = packing_statistics(documents, planned, seq_len)
                rows.append(
                    {"dataset": dataset, "seq_len": seq_len, "packing": packing, "plan_seconds": seconds, **stats}
                )
                print(f"{dataset} seq_len={seq_len}: {describe_packing(packing, stats)}", flush=True)
    lines = packing_lines(rows, args.bos)
    results: dict = {"bos": args.bos, "packings": rows}
    if args.plan_documents:
        results["planning"] = time_planning(first_lengths, args.plan_documents, seq_lens)
        lines += planning_lines(results["planning"], args.plan_documents, args.datasets[0])
    report = "\n".join(lines) + "\n"
    results["report"] = report
    write_atomically(out, json.dumps(results, indent=1))
    write_atomically(out.with_suffix(".md"), report)
    print(report)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def packing_lines(rows: list[dict], bos: bool) -> list[str]:
    """The machine and the table of each dataset's packing statistics."""
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} cores; python {platform.python_version()}; "
        f"start marker: {str(bos).lower()}",
        "",
    ]
    table = [
        [r["dataset"], f"{r['seq_len']:,}", r["packing"], f"{r['rows']:,}"]
        + [f"{r[key]:.2f}" if key == "documents_per_row" else f"{r[key]:.1%}" for key in STATISTICS.values()]
        for r in rows
    ]
    return lines + markdown_table(["dataset", "seq_len", "packing", "rows", *STATISTICS], table)


def time_planning(lengths: np.ndarray, n_documents: int, seq_lens: list[int]) -> list[dict]:
    """planning() at each seq_len, its synthetic split written in a temporary folder of the current one."""
    with tempfile.TemporaryDirectory(dir=".") as work:
        return [planning(lengths, n_documents, seq_len, Path(work)) for seq_len in seq_lens]


def planning_lines(plans: list[dict], n_documents: int, dataset: str) -> list[str]:
    """The table of best-fit planning at each seq_len, under a line that says what was planned."""
    lines = [
        "",
        f"Best-fit planning of {n_documents:,} documents (lengths drawn from "
        f"{dataset}'s), memory-mapped, in one process:",
        "",
    ]
    header = ["seq_len", "tokens", "rows", "padding", "finding the documents s", "planning in all s", "peak RSS GB"]
    header += ["of which the mapped split GB", "anonymous memory at the end GB"]
    table = [
        [
            f"{p['seq_len']:,}",
            f"{p['tokens']:,}",
            f"{p['rows']:,}",
            f"{p['padding_share']:.3%}",
            f"{p['finding_documents_seconds']:.1f}",
            f"{p['seconds']:.1f}",
            f"{p['peak_rss_gb']:.2f}",
            f"{p['mapped_split_gb']:.2f}",
            f"{p['anonymous_gb']:.2f}",
        ]
        for p in plans
    ]
    return lines + markdown_table(header, table)


if __name__ == "__main__":
    from cli import run_main

    run_main(main)
