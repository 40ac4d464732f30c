"""Benchmark data preparation at scale: a synthetic corpus of Python code, prepared by `python prepare.py`
as JSONL and as parquet, side by side with raw tiktoken encoding the same text on the same machine.

    python -m bench.preparation              # 2 GB of text (about 30 minutes on 2 cores)
    python -m bench.preparation --gb=0.1     # a quick look

The corpus: the top-level definitions of the Python files of the installed packages (site-packages),
repeated until the size is reached, each repetition with a header comment and a few identifiers renamed,
so that no two documents are the same. Each measurement runs in its own process; peak memory is that
process's maximum resident set size, as the OS reports it.

  raw tiktoken     encode_ordinary_batch on all cores over every document, timing only the encoding
  prepare (bpe)    python prepare.py corpus.jsonl: a BPE trained on a bounded sample, then everything
  prepare jsonl    the same corpus with that tokenizer (so only preparation is timed)
  prepare parquet  the same documents as parquet
  prepare half     the first half of the documents, as JSONL and as parquet: peak memory must not grow
                   with the corpus
"""

from __future__ import annotations

import json
import os
import platform
import random
import re
import site
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from config import setting
from studies.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]  # the repository root: scripts run from there
RENAMES = [("self", "this"), ("value", "val"), ("data", "payload"), ("result", "out"), ("name", "label")]


def definitions(source: str) -> list[str]:
    """Split a module at its top-level def/class lines (no parsing: fast, and any file will do)."""
    starts = [m.start() for m in re.finditer(r"^(?:def |class |async def |@)", source, re.MULTILINE)]
    return [source[a:b] for a, b in zip([0] + starts, starts + [len(source)]) if source[a:b].strip()]


def generate(folder: Path, target_chars: int) -> dict:
    """corpus.jsonl and corpus.parquet, and half.jsonl and half.parquet (the first half of the documents),
    written as they are generated."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    files = sorted(p for d in site.getsitepackages() for p in Path(d).rglob("*.py"))
    schema = pa.schema([("text", pa.string())])
    chars = docs = 0
    pending: dict[str, list[str]] = {"corpus": [], "half": []}
    with (
        open(folder / "corpus.jsonl", "w") as full,
        open(folder / "half.jsonl", "w") as half,
        pq.ParquetWriter(folder / "corpus.parquet", schema, compression="zstd") as full_parquet,
        pq.ParquetWriter(folder / "half.parquet", schema, compression="zstd") as half_parquet,
    ):
        parquets = {"corpus": full_parquet, "half": half_parquet}

        def write_rows(which: str, at_least: int) -> None:
            if len(pending[which]) >= at_least:
                parquets[which].write_table(pa.table({"text": pending[which]}, schema=schema))
                pending[which] = []

        for repetition in range(1000):
            rng = random.Random(repetition)
            renames = rng.sample(RENAMES, k=repetition % len(RENAMES))
            for path in files:
                try:
                    source = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                for piece in definitions(source):
                    for old, new in renames:
                        piece = re.sub(rf"\b{old}\b", new, piece)
                    doc = f"# {path.name}, variant {repetition}\n{piece}"
                    line = json.dumps({"text": doc}) + "\n"
                    full.write(line)
                    pending["corpus"].append(doc)
                    write_rows("corpus", 20_000)
                    if chars < target_chars // 2:
                        half.write(line)
                        pending["half"].append(doc)
                        write_rows("half", 20_000)
                    chars += len(doc)
                    docs += 1
                    if chars >= target_chars:
                        write_rows("corpus", 1)
                        write_rows("half", 1)
                        return {"documents": docs, "characters": chars}
    raise RuntimeError("the installed packages hold too little Python to reach the size")


def measure(command: list[str]) -> dict:
    """Run a command; its wall time and peak resident memory (os.wait4 reports the child's own)."""
    t0 = time.time()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output[-3000:]}")
    return {"seconds": time.time() - t0, "peak_rss_gb": usage.ru_maxrss / 2**20, "output": output}


def raw_tiktoken(corpus: str, tokenizer: str) -> None:
    """Child process: encode every document of a JSONL file with tiktoken, timing only the encoding."""
    from prepare import load_named_tokenizer

    enc = load_named_tokenizer(tokenizer)
    seconds = tokens = documents = 0

    def encode(batch: list[str]) -> None:
        nonlocal seconds, tokens, documents
        t0 = time.perf_counter()
        encoded = enc.encode_ordinary_batch(batch, num_threads=os.cpu_count() or 1)
        seconds += time.perf_counter() - t0
        tokens += sum(map(len, encoded))
        documents += len(batch)

    batch, chars = [], 0
    with open(corpus, "rb") as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            chars += len(batch[-1])
            if chars > 64_000_000:
                encode(batch)
                batch, chars = [], 0
    encode(batch)
    print(json.dumps({"encode_seconds": seconds, "tokens": tokens, "documents": documents}))


def measure_preparation(dataset: Path, data_dir: Path, tokenizer: str = "bpe") -> dict:
    result = measure([sys.executable, "prepare.py", str(dataset), f"--data_dir={data_dir}", f"--tokenizer={tokenizer}"])
    folder = Path(next(line for line in result["output"].splitlines() if line.startswith("ready: "))[7:])
    meta = json.loads((folder / "meta.json").read_text())
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    print(result["output"], flush=True)
    return {
        "seconds": result["seconds"],
        "phases": json.loads((folder / "timings.json").read_text())["seconds"],
        "peak_rss_gb": result["peak_rss_gb"],
        "tokens": tokens,
        "documents": sum(s["documents"] for s in meta["splits"].values()),
        "skipped": meta["skipped"],
        "folder": str(folder),
    }


@dataclass
class DataBenchSettings:
    gb: float = setting(2.0, "size of the corpus in GB of text (characters)", minimum=1e-6)
    work_dir: str = setting("bench_data_work", "where the corpora and shards are written", path=True)
    out: str = setting("bench_data.json", "where the results are written (JSON)", path=True)


def main(argv: list[str]) -> int:
    from cli import script_settings
    from errors import SaveFailed
    from run.folder import write_atomically

    args = script_settings(DataBenchSettings, argv, __doc__, "python -m bench.preparation")
    work, out = Path(args.work_dir), Path(args.out)
    if out.is_dir():
        print(f"error: out={out} is a folder; give a file name", file=sys.stderr)
        return 2
    try:
        write_atomically(out, "{}")  # fails now, not after the benchmark, if the file cannot be written
        return benchmark(args, work, out)
    except SaveFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk or a file-size limit while the corpus is generated
        print(f"error: could not write in {work} ({e.strerror or e}); run again once there is room", file=sys.stderr)
        return 1


def benchmark(args, work: Path, out: Path) -> int:
    from run.folder import write_atomically

    corpus = work / f"corpus_{args.gb:g}gb"
    info, sizes = generated_corpus(corpus, args.gb)
    results: dict = {"corpus": {**info, "file_bytes": sizes}}
    shards = work / "data"
    results["prepare_bpe"] = measure_preparation(corpus / "corpus.jsonl", shards / "bpe")
    tokenizer = str(Path(results["prepare_bpe"]["folder"]).resolve() / "tokenizer.tiktoken")
    results["raw_tiktoken"] = measure_raw_tiktoken(corpus / "corpus.jsonl", tokenizer)
    runs = {"jsonl": "corpus.jsonl", "parquet": "corpus.parquet", "half_jsonl": "half.jsonl"}
    runs["half_parquet"] = "half.parquet"
    for name, dataset in runs.items():
        results[f"prepare_{name}"] = measure_preparation(corpus / dataset, shards / name, tokenizer)

    report = "\n".join(report_lines(info, results, ("bpe", *runs)))
    results["report"] = report
    write_atomically(out, json.dumps(results, indent=1))
    print(report)
    print(f"wrote {out}")
    return 0


def generated_corpus(corpus: Path, gb: float) -> tuple[dict, dict[str, int]]:
    """The corpus of `gb` GB of text in its folder, generated unless an earlier run finished it: its
    documents and characters, and the size of each of its files."""
    if not (corpus / "done.json").exists():
        print(f"generating {gb:g} GB of text in {corpus} ...", flush=True)
        t0 = time.time()
        info = generate(corpus, int(gb * 1e9))
        (corpus / "done.json").write_text(json.dumps({**info, "seconds": time.time() - t0}))
    info = json.loads((corpus / "done.json").read_text())
    sizes = {p.name: p.stat().st_size for p in corpus.iterdir()}
    print(f"corpus: {info['documents']:,} documents, {info['characters'] / 1e9:.2f} G characters; {sizes}", flush=True)
    return info, sizes


def measure_raw_tiktoken(corpus: Path, tokenizer: str) -> dict:
    """raw_tiktoken over a JSONL corpus in a process of its own: its figures and peak memory."""
    raw = measure(
        [
            sys.executable,
            "-c",
            f"from bench import preparation; preparation.raw_tiktoken({str(corpus)!r}, {tokenizer!r})",
        ]
    )
    return {**json.loads(raw["output"]), "peak_rss_gb": raw["peak_rss_gb"]}


def report_lines(info: dict, results: dict, names: tuple[str, ...]) -> list[str]:
    """The machine, the corpus and the table of every run: raw tiktoken, then `prepare {name}` for each name."""
    raw = results["raw_tiktoken"]
    raw_rate = raw["tokens"] / raw["encode_seconds"]
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} cores; python {platform.python_version()}",
        f"corpus: {info['documents']:,} documents, {info['characters'] / 1e9:.2f} G characters",
        "",
    ]
    table = [
        [
            "raw tiktoken (encoding only)",
            f"{raw['encode_seconds']:.1f}",
            f"{raw['tokens']:,}",
            f"{raw_rate:,.0f}",
            "1.00x",
            f"{raw['peak_rss_gb']:.2f}",
        ]
    ]
    for name in names:
        r = results[f"prepare_{name}"]
        # the same text as raw tiktoken encoded (the half corpus aside): compare the times
        ratio = "-" if name.startswith("half") else f"{raw['encode_seconds'] / r['seconds']:.2f}x"
        table.append(
            [
                f"prepare {name}",
                f"{r['seconds']:.1f}",
                f"{r['tokens']:,}",
                f"{r['tokens'] / r['seconds']:,.0f}",
                ratio,
                f"{r['peak_rss_gb']:.2f}",
            ]
        )
    header = ["run", "wall s", "tokens written", "tokens/s", "speed vs raw tiktoken", "peak RSS GB"]
    return lines + markdown_table(header, table)


if __name__ == "__main__":
    from cli import run_main

    run_main(main)
