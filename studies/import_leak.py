"""The import-leak probe: completing a Python file, does the model suggest the imports of the files that
came before it in the row? The failure that the document mask exists to prevent, measured directly.

    python -m studies.import_leak --out_dir=out/run              # a run folder trained on whole Python files
    python -m studies.import_leak --out_dir=out/run --pairs=128 --samples=16

From held-out documents of the run's corpus it forms pairs (A, B): A imports a module m that B never
mentions. B is cut just before its first import statement. Under the run's own settings (its attention
mask and position ids):

  log-prob  log P(B goes on with "import m" or "from m import"), with k files that import m before B in
            the row, minus the same with B alone from position 0; for k = 1, 2, 4 and for those files cut
            right after their import of m ("extra 0") or with more of their text after it; and with one file
            before B that does not import m (cut after its first import: "neutral"), so that what the
            importing file adds can be told from what any file before B does;
  sampling  how often the import line sampled for B names a module that the file before it imports and
            B never mentions, with that file before B and with B alone.

With the document mask on (and positions reset) B cannot see A: the log-prob difference is 0 to float
rounding and the two sampling rates differ only by chance. The probe needs documents that are whole
Python files (dataset=stdlib-files, or a corpus of files); the results print as a table and are written
to out_dir/import_leak.json. A run with the start marker has every file begin with its BOS, B too.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tiktoken
import torch

import sample
import shards
import train
from cli import run_main, script_settings
from config import Config, resolve_device, setting
from data import Flags
from errors import ConfigError, DataError, SaveFailed
from model import GPT, attention_mask
from run.folder import write_atomically
from shards import document_bounds
from studies.scoring import batch_of_rows, score_rows
from studies.stats import paired_effect
from studies.tables import markdown_table

IMPORT_LINE = re.compile(r"(?:import|from)[ \t]+([A-Za-z_]\w*)")
PRECEDING_FILES = (1, 2, 4)  # k: files that import m before B
EXTRA_TOKENS = (0, 64)  # tokens of each preceding file kept after its import of m
IMPORT_WITHIN = 48  # a preceding file's import of m ends within its first this many tokens
MAX_CONTEXT = 96  # B's tokens before its first import, at most
VAL_TOKENS = 4_000_000  # the probe reads the validation split's first documents up to this many tokens


@dataclass
class PythonFile:
    text: str
    imports: dict[str, int]  # top-level module -> character offset of the end of the line that first imports it
    first_import: int | None  # character offset of the start of the first module-level import


def parse_file(text: str) -> PythonFile | None:
    """The module-level imports of a Python file (relative imports and __future__ left out), or None if
    the text does not parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    line_starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def offset(line: int) -> int:  # character offset of the start of 1-based line `line` (the end: past the last)
        return line_starts[line - 1] if line <= len(line_starts) else len(text)

    imports, first_import = {}, None
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module.split(".")[0]]
        else:
            continue
        first_import = offset(node.lineno) if first_import is None else first_import
        for name in names:
            if name != "__future__":
                imports.setdefault(name, offset(node.end_lineno + 1))
    return PythonFile(text, imports, first_import)


def mentions(text: str, module: str) -> bool:
    return re.search(rf"\b{re.escape(module)}\b", text) is not None


@dataclass
class LeakPair:
    """B's start, the module m it never mentions, and the files before it that import m."""

    document: int  # B's index among the documents
    sources: list[int]  # the preceding files' indices, in order
    module: str
    leak_modules: set[str]  # the modules imported in the first preceding file's excerpt, that B never mentions
    context: np.ndarray  # B's tokens before its first import
    continuations: list[np.ndarray]  # the tokens of "import m" and "from m import" after the context
    preceding: dict[tuple[int, int], np.ndarray]  # (k, extra) -> the k files' tokens, each ending in EOT
    neutral: np.ndarray  # one file that does not import m, cut after its first import, ending in EOT
    context_rest: str  # what is left of B's text before its import line after the context's tokens


def excerpt(f: PythonFile, module: str, extra: int, enc: tiktoken.Encoding) -> list[int]:
    """A preceding file: its start (after its BOS, with the marker) up to the end of its import of `module`,
    `extra` tokens more, its EOT."""
    end = f.imports[module]
    return shards.document_opening(enc, f.text[:end]) + enc.encode_ordinary(f.text[end:])[:extra] + [enc.eot_token]


def find_pairs(texts: list[str], enc: tiktoken.Encoding, n_pairs: int, seed: int = 0) -> list[LeakPair]:
    """Up to n_pairs pairs from these documents, deterministic given the seed. Each B is used once, with a
    module m that max(PRECEDING_FILES) other documents import near their start and that B never mentions."""
    files = [parse_file(t) for t in texts]
    rng = np.random.default_rng(seed)
    importers = early_importers(files, enc)
    pairs = []
    for b in rng.permutation(len(files)):
        if len(pairs) == n_pairs:
            break
        pair = pair_for(int(b), files, importers, enc, rng)
        if pair is not None:
            pairs.append(pair)
    return pairs


def early_importers(files: list[PythonFile | None], enc: tiktoken.Encoding) -> dict[str, list[int]]:
    """Module -> the files whose import of it ends within IMPORT_WITHIN tokens: cut there, a few of them still
    leave room in the row for B."""
    importers: dict[str, list[int]] = {}
    for i, f in enumerate(files):
        for module, end in f.imports.items() if f else []:
            if len(enc.encode_ordinary(f.text[:end])) <= IMPORT_WITHIN:
                importers.setdefault(module, []).append(i)
    return importers


def pair_for(
    b: int,
    files: list[PythonFile | None],
    importers: dict[str, list[int]],
    enc: tiktoken.Encoding,
    rng: np.random.Generator,
) -> LeakPair | None:
    """B's pair, or None where B has no import to cut before, no module to leak, no neutral file, or no
    context of at most MAX_CONTEXT tokens. The order of the draws from rng decides which pairs a seed gives."""
    f = files[b]
    if f is None or f.first_import is None:
        return None
    module = module_to_leak(b, f, importers, rng)
    if module is None:
        return None
    sources = [i for i in rng.permutation(importers[module]) if i != b][: max(PRECEDING_FILES)]
    neutral = neutral_file(b, files, module, rng)
    if neutral is None:
        return None
    context, continuations = cut_before_import(f.text[: f.first_import], module, enc)
    if not 0 < len(context) <= MAX_CONTEXT:
        return None
    first = files[sources[0]]
    return LeakPair(
        document=b,
        sources=[int(i) for i in sources],
        module=module,
        leak_modules={
            m for m, end in first.imports.items() if end <= first.imports[module] and not mentions(f.text, m)
        },
        context=np.array(shards.document_opening(enc, "") + context, dtype=np.int64),  # after its BOS, if any
        continuations=[np.array(seq, dtype=np.int64) for seq in continuations],
        preceding=preceding_excerpts(files, sources, module, enc),
        neutral=np.array(excerpt(neutral, next(iter(neutral.imports)), 0, enc), dtype=np.int64),
        context_rest=f.text[len(enc.decode(context)) : f.first_import],
    )


def module_to_leak(b: int, f: PythonFile, importers: dict[str, list[int]], rng: np.random.Generator) -> str | None:
    """A random module that enough other files import early and that B never mentions: a model that
    suggests it for B can only have it from the files before B."""
    candidates = sorted(
        m for m, who in importers.items() if len(set(who) - {b}) >= max(PRECEDING_FILES) and not mentions(f.text, m)
    )
    return candidates[rng.integers(len(candidates))] if candidates else None


def neutral_file(b: int, files: list[PythonFile | None], module: str, rng: np.random.Generator) -> PythonFile | None:
    """A random file other than B that imports something but never mentions m: what any file before B does,
    told apart from what importing m does."""
    order = rng.permutation(len(files))  # drawn whole, whichever file is taken
    chosen = next(
        (i for i in order if i != b and files[i] and files[i].imports and not mentions(files[i].text, module)), None
    )
    return None if chosen is None else files[chosen]


def cut_before_import(text: str, module: str, enc: tiktoken.Encoding) -> tuple[list[int], list[list[int]]]:
    """B's tokens before its import, and the tokens of "import m" and "from m import" after them: cut at the
    token boundary that both continuations share with B's own start (BPE may merge across the cut)."""
    joint = [enc.encode_ordinary(text + c) for c in (f"import {module}", f"from {module} import")]
    own = enc.encode_ordinary(text)
    n = min(next((j for j, (x, y) in enumerate(zip(own, seq)) if x != y), min(len(own), len(seq))) for seq in joint)
    return own[:n], [seq[n:] for seq in joint]


def preceding_excerpts(
    files: list[PythonFile | None], sources: list[int], module: str, enc: tiktoken.Encoding
) -> dict[tuple[int, int], np.ndarray]:
    """(k, extra) -> the first k sources, each cut `extra` tokens after its import of m, back to back."""
    return {
        (k, extra): np.array(sum((excerpt(files[i], module, extra, enc) for i in sources[:k]), []), dtype=np.int64)
        for k in PRECEDING_FILES
        for extra in EXTRA_TOKENS
    }


def continuation_logprobs(
    model: GPT,
    flags: Flags,
    eot_id: int,
    rows: list[tuple[np.ndarray, np.ndarray]],
    device: torch.device,
    dtype: str = "auto",
) -> np.ndarray:
    """log P(continuation | row start) for each (row start, continuation), under the run's settings."""
    laid_out = [np.concatenate([start, continuation]) for start, continuation in rows]
    targets = [(len(start) - 1, len(start) + len(continuation) - 1) for start, continuation in rows]
    return -score_rows(model, flags, eot_id, laid_out, targets, device, dtype)[0]


def import_logprob(
    model: GPT, flags: Flags, eot_id: int, pairs: list[LeakPair], device: torch.device, dtype: str = "auto"
) -> dict:
    """For each (k, extra), "neutral" and alone (None): per pair, log P("import m" or "from m import") after
    B's context."""
    T = model.config.seq_len
    conditions = [None, "neutral"] + [(k, e) for k in PRECEDING_FILES for e in EXTRA_TOKENS]
    result = {}
    for condition in conditions:
        rows, owners = [], []
        for p, pair in enumerate(pairs):
            if condition is None:
                before = np.zeros(0, dtype=np.int64)
            else:
                before = pair.neutral if condition == "neutral" else pair.preceding[condition]
            start = np.concatenate([before, pair.context])
            if len(start) + max(len(c) for c in pair.continuations) > T + 1:
                continue  # does not fit in a row
            rows += [(start, c) for c in pair.continuations]
            owners.append(p)
        if not rows:
            result[condition] = {}
            continue
        logp = continuation_logprobs(model, flags, eot_id, rows, device, dtype).reshape(len(owners), -1)
        result[condition] = dict(zip(owners, np.logaddexp.reduce(logp, axis=1).tolist()))
    return result


@torch.no_grad()
def sample_import_lines(
    model: GPT,
    flags: Flags,
    enc: tiktoken.Encoding,
    starts: list[np.ndarray],
    context_rests: list[str],
    generator: torch.Generator,
    device: torch.device,
    dtype: str = "auto",
    max_tokens: int = 8,
) -> list[str | None]:
    """For each row start (ending with B's context), the module of the import line the model samples at
    B's import position (temperature 1), or None when it samples something else there."""
    T, eot = model.config.seq_len, enc.eot_token
    rows = [list(s) for s in starts]
    for _ in range(max_tokens):
        open_rows = [r for r in range(len(rows)) if len(rows[r]) < T]
        if not open_rows:
            break
        length = max(len(rows[r]) for r in open_rows)  # as long as needed: causal, so nothing changes
        batch = batch_of_rows([np.array(rows[r]) for r in open_rows], length, eot, flags=flags).to(device)
        mask = attention_mask(batch.doc_ids, flags.doc_mask, model.config.attn_impl)
        with train.autocast(device, dtype):
            logits = model(batch.inputs, batch.position_ids, mask)
        last = torch.tensor([len(rows[r]) - 1 for r in open_rows], device=device)
        probs = torch.softmax(logits[torch.arange(len(open_rows), device=device), last].float(), dim=-1)
        probs[:, enc.n_vocab :] = 0  # padded vocabulary slots
        for r, token in zip(open_rows, torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].tolist()):
            rows[r].append(token)
    modules = []
    for start, row, rest in zip(starts, rows, context_rests):
        generated = row[len(start) :]
        text = enc.decode(generated[: generated.index(eot)] if eot in generated else generated)
        # an import line only where B's own import line starts: after the rest of B's context, unchanged
        match = IMPORT_LINE.match(text[len(rest) :]) if text.startswith(rest) else None
        modules.append(match.group(1) if match else None)
    return modules


def fitting_pairs(pairs: list[LeakPair], seq_len: int) -> list[LeakPair]:
    """The pairs that fit in a row of seq_len with one file before B; a DataError when fewer than 2 do
    (nothing to measure)."""
    needed = [len(p.preceding[1, 0]) + len(p.context) + max(map(len, p.continuations)) - 1 for p in pairs]
    fitting = [p for p, n in zip(pairs, needed) if n <= seq_len]
    if len(fitting) < 2:
        raise DataError(
            f"{len(fitting)} of the {len(pairs)} import-leak pairs fit in a row of seq_len {seq_len} with one file "
            f"before B (the shortest needs {min(needed, default=0)}): the probe needs a run with a longer seq_len"
        )
    return fitting


def probe(
    model: GPT,
    flags: Flags,
    enc: tiktoken.Encoding,
    pairs: list[LeakPair],
    samples: int,
    device: torch.device,
    dtype: str = "auto",
) -> dict:
    """Both measures on the pairs that fit in a row with one file before B, with 95% confidence intervals
    over pairs, in the compute precision `dtype` (train.autocast)."""
    pairs = fitting_pairs(pairs, model.config.seq_len)
    logp = import_logprob(model, flags, enc.eot_token, pairs, device, dtype)
    return {
        "pairs": len(pairs),
        "logprob": logprob_changes(logp),
        "logprob_alone_mean": float(np.mean(list(logp[None].values()))),
        "sampling": sampled_leaks(model, flags, enc, pairs, samples, device, dtype),
    }


def logprob_changes(logp: dict) -> dict:
    """import_logprob's log-probs as changes: each condition against B alone, and the importing file
    against the neutral one."""
    alone, neutral = logp[None], logp["neutral"]
    by_setting = {
        f"k={k},extra={extra}": logprob_change(logp[k, extra], alone, files=k, extra_tokens=extra)
        for k in PRECEDING_FILES
        for extra in EXTRA_TOKENS
    }
    by_setting["neutral"] = logprob_change(neutral, alone, files="1 not importing m", extra_tokens=0)
    # the importing file against a file that does not import m: what the import itself adds
    by_setting["k=1,extra=0 vs neutral"] = logprob_change(
        logp[1, 0], neutral, files="1 vs 1 not importing m", extra_tokens=0
    )
    return by_setting


def logprob_change(values: dict, baseline: dict, **described) -> dict:
    """The mean change from `baseline` over the pairs that both have, with its 95% interval."""
    deltas = [values[p] - baseline[p] for p in values if p in baseline]
    low, high = paired_effect(deltas).interval(0.95) if deltas else (None, None)
    return {
        **described,
        "pairs": len(deltas),
        "delta_logprob": float(np.mean(deltas)) if deltas else None,
        "ci95": [low, high] if deltas and np.isfinite(low) else None,
    }


def sampled_leaks(
    model: GPT,
    flags: Flags,
    enc: tiktoken.Encoding,
    pairs: list[LeakPair],
    samples: int,
    device: torch.device,
    dtype: str,
) -> dict:
    """How often the import line sampled for B names a module of the file before it, with that file before
    B and with B alone, `samples` times a pair; the difference with its 95% interval over pairs."""
    generator = torch.Generator()
    repeated = [p for p in pairs for _ in range(samples)]
    conditions = {}
    for name, before in (("after", lambda p: p.preceding[1, 0]), ("alone", lambda p: np.zeros(0, np.int64))):
        starts = [np.concatenate([before(p), p.context]) for p in repeated]
        generator.manual_seed(0)  # the same random numbers for both: with the mask on, the same samples
        rests = [p.context_rest for p in repeated]
        found = sample_import_lines(model, flags, enc, starts, rests, generator, device, dtype)
        conditions[name] = (
            np.array([m in p.leak_modules for m, p in zip(found, repeated)], dtype=float),
            np.array([m is not None for m in found], dtype=float),
        )
    (leak_after, lines_after), (leak_alone, lines_alone) = conditions["after"], conditions["alone"]
    per_pair = (leak_after - leak_alone).reshape(len(pairs), samples).mean(1)
    low, high = paired_effect(per_pair.tolist()).interval(0.95)
    return {
        "samples": len(repeated),
        "leak_rate_after": float(leak_after.mean()),
        "leak_rate_alone": float(leak_alone.mean()),
        "difference": float(per_pair.mean()),
        "ci95": [low, high] if np.isfinite(low) else None,
        "import_line_rate_after": float(lines_after.mean()),
        "import_line_rate_alone": float(lines_alone.mean()),
    }


def validation_pairs(prepared: shards.Shards, enc: tiktoken.Encoding, n_pairs: int) -> list[LeakPair]:
    """Up to n_pairs pairs from the validation split's first documents; a DataError when there are not 2."""
    val = shards.leading_documents(prepared.val, prepared.eot_id, VAL_TOKENS)[:]
    texts = [enc.decode(val[s : e - 1].tolist()) for s, e in zip(*document_bounds(val, prepared.eot_id))]
    pairs = find_pairs(texts, enc, n_pairs)
    if len(pairs) < 2:
        raise DataError(
            f"the validation split gives {len(pairs)} import-leak pair(s) from {len(texts)} documents: the probe "
            "needs whole Python files (e.g. dataset=stdlib-files)"
        )
    return pairs


def probe_run(out_dir: Path, device: torch.device, n_pairs: int = 64, samples: int = 8) -> dict:
    """The probe on a run folder's model, under its settings, with pairs from its validation split."""
    model, enc, checkpoint = sample.load_run(out_dir, device)
    cfg = Config(**checkpoint["config"])
    pairs = validation_pairs(shards.load_shards(Path(checkpoint["shards"])), enc, n_pairs)
    return probe(model, cfg.flags, enc, pairs, samples, device, cfg.dtype)


def format_table(result: dict) -> str:
    def interval(ci) -> str:
        return "" if ci is None else f" [{ci[0]:+.3f}, {ci[1]:+.3f}]"

    s = result["sampling"]
    lines = [
        f"{result['pairs']} pairs; log P(import m) alone: {result['logprob_alone_mean']:.3f} nats on average",
        "",
        *markdown_table(
            ["preceding files", "extra tokens each", "pairs", "log-prob change (nats)"],
            [
                [
                    e["files"],
                    e["extra_tokens"],
                    e["pairs"],
                    "" if e["delta_logprob"] is None else f"{e['delta_logprob']:+.3f}{interval(e['ci95'])}",
                ]
                for e in result["logprob"].values()
            ],
        ),
        "",
        f"sampled import lines naming a module of the file before: {s['leak_rate_after']:.1%} with it before, "
        f"{s['leak_rate_alone']:.1%} alone (difference {s['difference']:+.3f}{interval(s['ci95'])}; "
        f"{s['samples']} samples; an import line sampled {s['import_line_rate_after']:.0%} / "
        f"{s['import_line_rate_alone']:.0%} of the time)",
    ]
    return "\n".join(lines)


@dataclass
class LeakSettings:
    out_dir: str = setting("out", "the training run's folder (holds ckpt.pt)", path=True)
    pairs: int = setting(64, "pairs (A, B) at most, from the validation split", minimum=1)
    samples: int = setting(8, "import lines sampled per pair and condition", minimum=1)
    device: str = setting("cpu", "cpu, cuda or cuda:N")


def main(argv: list[str]) -> int:
    args = script_settings(LeakSettings, argv, __doc__, "python -m studies.import_leak")
    try:
        result = probe_run(Path(args.out_dir), resolve_device(args.device), args.pairs, args.samples)
        print(format_table(result))
        write_atomically(Path(args.out_dir) / "import_leak.json", json.dumps(result, indent=1))
    except (ConfigError, DataError, SaveFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_main(main)
