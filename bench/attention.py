"""Benchmark attention variants for packed documents, side by side in one run.

    python -m bench.attention                   # GPU: GPT-2 small at seq_len 1024, 4096, 8192; CPU: a small size
    python -m bench.attention --seq_lens=1024 --tokens=32768 --layouts=synthetic --pos_embs=learned,rope

For each size, document layout and position kind, every variant runs (1) the real training step
(forward, backward, AdamW; train.py's loss function, with the attention mask built outside the compiled
model as train.py builds it) and (2) the attention call alone, and reports tokens/s, time, MFU, peak
memory and, for FlexAttention, the BlockMask build time per step.

  reference_causal  the plainest causal step, standing in for nanoGPT: the same blocks, positions 0..T-1,
                    causal SDPA, the loss inside the compiled forward; no document ids, no mask, no
                    position gather (learned positions whatever --pos_embs says)
  reference_causal_cudnn  the same step with SDPA held to its cuDNN backend, CUDA only (on Hopper it can be
                    the faster causal kernel; the honest reference is the faster of the two)
  flex_doc          FlexAttention, block-sparse document mask (what train.py uses on CUDA), with model.py's
                    mask function (document_causal_by_ids)
  flex_doc_by_position  the same with a mask function of one gather a score (document_causal_by_position, here)
  flex_causal       FlexAttention, causal mask only
  sdpa_causal       SDPA with is_causal, no document mask (train.py with doc_mask=false)
  sdpa_doc          SDPA with the dense document mask (what train.py uses on CPU)
  varlen            FlashAttention varlen (torch.nn.attention.varlen), attention alone, CUDA only

A variant that fails records its error in its row and the others go on; the JSON is rewritten after
every row, so an interrupted run keeps what it measured.

MFU: model FLOPs per token as in the PaLM paper's appendix B, 6N + 12*L*H*Q*T (N parameters, the tied
output layer included, L layers, H heads, Q head size, T sequence length), the same for every variant,
divided by the peak matmul rate this script measures on the same device (bf16 on GPU, fp32 on CPU).
"MFU doc" counts only the attention work the document mask leaves: the attention term divided by the
ideal speedup below. The ideal speedup of the document mask over causal attention is the ratio of
attention-score entries computed, T(T+1)/2 against the sum over documents of l(l+1)/2; the step-level
ideal is what the step would take if attention (n_layer x the sdpa_causal attention call) shrank by that
ratio and nothing else changed.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask

import corpora
import data
import train
from cli import run_main, script_settings
from config import setting
from data import Batch
from errors import ConfigError, SaveFailed
from model import (
    GPT,
    GPTConfig,
    attend,
    attention_mask,
    block_mask_over_rows,
    compiled_flex_attention,
    document_causal_block_mask,
    document_causal_dense,
)
from resolve import check_fits
from run.folder import write_atomically
from studies.tables import markdown_table

VARIANTS = (
    "reference_causal",
    "reference_causal_cudnn",
    "flex_doc",
    "flex_doc_by_position",
    "flex_causal",
    "sdpa_causal",
    "sdpa_doc",
    "varlen",
)


def has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, steps: int, warmup: int) -> float:
    """Median seconds per call after warm-up (compilation happens in the warm-up)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def peak_matmul_flops(device: torch.device) -> tuple[float, str]:
    """FLOP/s of a large square matmul: the denominator of MFU, measured rather than taken from a sheet."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 8192 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    seconds = timed(lambda: a @ b, device, steps=10, warmup=3)
    return 2 * n**3 / seconds, str(dtype).removeprefix("torch.")


def doc_ids_for_layout(layout: str, batch_size: int, seq_len: int, doc_len: int, seed: int) -> torch.Tensor:
    """Document ids (B, T): 'synthetic', documents of exactly doc_len tokens; 'real', the lengths of the
    built-in corpus's documents (top-level definitions, median ~130 tokens), shuffled and packed back
    to back, each row starting at a random place in that stream."""
    if layout == "synthetic":
        return (torch.arange(seq_len) // doc_len).expand(batch_size, seq_len).contiguous()
    docs = _corpus_documents()
    rng = np.random.default_rng(seed)
    # characters / 4 is close enough to a token count for a layout, and needs no tokenizer
    lengths = np.array([max(1, len(d) // 4) for d in docs])
    lengths = lengths[rng.permutation(len(lengths))]
    stream_ends = np.cumsum(lengths)
    rows = []
    for b in range(batch_size):
        start = b * seq_len + int(rng.integers(0, seq_len))
        ends = stream_ends[(stream_ends > start) & (stream_ends < start + seq_len)] - start
        boundary = torch.zeros(seq_len, dtype=torch.long)
        boundary[torch.from_numpy(ends).long()] = 1
        rows.append(boundary.cumsum(0))
    return torch.stack(rows)


@lru_cache(maxsize=1)
def _corpus_documents() -> list[str]:
    return list(corpora.stdlib_documents(split_definitions=True))


def ideal_speedup(doc_ids: torch.Tensor) -> float:
    T = doc_ids.shape[1]
    causal = T * (T + 1) / 2
    per_row = []
    for row in doc_ids:
        lengths = torch.unique_consecutive(row, return_counts=True)[1].double()
        per_row.append(causal / float((lengths * (lengths + 1) / 2).sum()))
    return float(np.mean(per_row))


def model_flops_per_token(config: GPTConfig, model: GPT) -> float:
    """PaLM appendix B: 6N + 12 * L * H * Q * T. As in nanoGPT, N leaves out the position table but
    counts the tied token embedding once, since it is the output layer's matmul."""
    n = model.num_params() - (model.wpe.weight.numel() if model.wpe is not None else 0)
    head_size = config.n_embd // config.n_head
    return 6 * n + 12 * config.n_layer * config.n_head * head_size * config.seq_len


class CausalReference(torch.nn.Module):
    """nanoGPT's training step built from this repo's blocks: token plus position embeddings for
    positions 0..T-1 (one (T, C) table, broadcast over the batch), causal SDPA, the loss in the forward."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(dataclasses.replace(config, pos_emb="learned", attn_impl="sdpa"))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in g.blocks:
            x = block(x, None, None)
        logits = g.lm_head(g.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def synthetic_batch(doc_ids: torch.Tensor, vocab_size: int) -> Batch:
    """Random tokens laid out in the given documents, each ending in an EOT (the vocabulary's last id),
    batched by data.make_batch: the same rules as real data."""
    B, T = doc_ids.shape
    eot = vocab_size - 1
    tokens = np.random.default_rng(0).integers(0, eot, (B, T + 1))
    ends = doc_ids[:, 1:].cpu().numpy() != doc_ids[:, :-1].cpu().numpy()  # slot t ends its document
    tokens[:, : T - 1][ends] = eot
    batch = data.make_batch(tokens, np.full(B, T + 1), eot)
    return batch.to(doc_ids.device)


def bench_training_step(variant: str, config: GPTConfig, doc_ids, device, steps, warmup) -> dict:
    """The training step, FlexAttention with PyTorch's default kernel_options (the model's)."""
    if variant == "varlen":
        return {"skipped": "varlen times the attention call alone"}
    flex, reference = variant.startswith("flex"), variant.startswith("reference_causal")
    if flex and device.type != "cuda":
        return {"skipped": "FlexAttention has no backward on CPU"}
    if variant == "reference_causal_cudnn" and device.type != "cuda":
        return {"skipped": "cuDNN attention needs CUDA"}
    if device.type == "cuda":
        # the SDPA backend is fixed when a graph is traced, and dynamo would reuse another variant's graph
        torch._dynamo.reset()
    cfg = dataclasses.replace(config, attn_impl="flex" if flex else "sdpa")
    doc = torch.zeros_like(doc_ids) if variant == "flex_causal" else doc_ids  # one document: a causal BlockMask
    batch = synthetic_batch(doc, cfg.vocab_size)
    doc_mask = variant != "sdpa_causal"
    torch.manual_seed(0)
    model = CausalReference(cfg).to(device) if reference else GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    precision = train.autocast(device)
    compiled = torch.compile(model) if device.type == "cuda" else model
    n_counted = batch.counted.sum()

    def backend():  # a fresh context each step: a context manager from a generator is entered once
        return sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if variant == "reference_causal_cudnn" else nullcontext()

    def step():
        with precision, backend():
            if reference:
                loss = compiled(batch.inputs, batch.inputs)  # targets: any tokens do
            else:
                # each step, outside the compiled model, as train.py builds it
                mask = attention_mask_of(variant, batch, cfg, doc_mask)
                loss = compiled(batch.inputs, batch.position_ids, mask, batch.targets).sum() / n_counted
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = timed(step, device, steps, warmup)
    B, T = doc_ids.shape
    result = {
        "step_ms": seconds * 1e3,
        "tokens_per_sec": B * T / seconds,
        "model_flops_per_token": model_flops_per_token(cfg, model.gpt if reference else model),
    }
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    if flex:
        build = lambda: block_mask_of(variant, doc)  # noqa: E731
        result["block_mask_ms"] = timed(build, device, steps, warmup) * 1e3
    return result


def positions_in_documents(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int32: how far each slot is into its document's run in the row, whatever reset_position_ids."""
    ids = doc_ids.contiguous()
    first_slot = torch.searchsorted(ids, ids)  # document ids never decrease along a row
    return (torch.arange(ids.shape[-1], device=ids.device) - first_slot).to(torch.int32)


def document_causal_by_position(doc_ids: torch.Tensor):
    """model.document_causal_by_ids with one gather a score: a document is a contiguous run of its row, so key
    kv is in query q's document iff it lies at most q's position in its document before q. Timed against it
    here; the model keeps by_ids, the faster on an H200 (results/benchmarks/bench_gpu_h200)."""
    within = positions_in_documents(doc_ids)

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= within[b, q_idx])

    return document_causal


def block_mask_of(variant: str, doc_ids: torch.Tensor) -> BlockMask:
    """The variant's BlockMask: model.py's, or one from this file's mask function, built by model.py's builder."""
    if variant != "flex_doc_by_position":
        return document_causal_block_mask(doc_ids)
    return block_mask_over_rows(document_causal_by_position(doc_ids), doc_ids)


def attention_mask_of(variant: str, batch: Batch, cfg: GPTConfig, doc_mask: bool):
    """The mask train.py would build for this batch, with this variant's mask function."""
    if variant.startswith("flex") and doc_mask:
        return block_mask_of(variant, batch.doc_ids)
    return attention_mask(batch.doc_ids, doc_mask, cfg.attn_impl)


def bench_attention(
    variant: str, config: GPTConfig, doc_ids, device, steps, warmup, kernel_options: dict | None = None
) -> dict:
    """The attention call alone, forward (and backward where the device has one). `kernel_options`: the
    FlexAttention variants' (None: PyTorch's defaults)."""
    if variant.startswith("reference_causal"):
        return {"attention_skipped": "the same call as sdpa_causal"}
    B, T = doc_ids.shape
    H, D = config.n_head, config.n_embd // config.n_head
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backward = device.type == "cuda" or not variant.startswith("flex")
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=backward) for _ in range(3))
    if variant == "varlen":
        if not has_varlen():
            return {"attention_skipped": "varlen needs CUDA and torch.nn.attention.varlen"}
        from torch.nn.attention.varlen import varlen_attn

        lengths = torch.cat([torch.unique_consecutive(row, return_counts=True)[1] for row in doc_ids.cpu()])
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device, torch.int32)
        max_len = int(lengths.max())
        qp, kp, vp = (x.detach().transpose(1, 2).reshape(B * T, H, D).requires_grad_() for x in (q, k, v))

        def call():
            # causal is window_size=(-1, 0): no limit to the left, none to the right (there is no is_causal)
            out = varlen_attn(qp, kp, vp, cu_seqlens, cu_seqlens, max_len, max_len, window_size=(-1, 0))
            out.sum().backward()
    else:
        if variant == "sdpa_causal":
            mask = None
        elif variant == "sdpa_doc":
            mask = document_causal_dense(doc_ids)
        else:
            doc = torch.zeros_like(doc_ids) if variant == "flex_causal" else doc_ids
            mask = block_mask_of(variant, doc)
        if kernel_options is not None and variant.startswith("flex") and device.type == "cuda":
            attention = lambda: compiled_flex_attention(q, k, v, block_mask=mask, kernel_options=kernel_options)  # noqa: E731
        else:
            attention = lambda: attend(q, k, v, mask)  # noqa: E731

        def call():
            with torch.no_grad() if not backward else nullcontext():
                out = attention()
            if backward:
                out.sum().backward()

    seconds = timed(call, device, steps, warmup)
    result = {"attention_ms": seconds * 1e3, "backward": backward}
    if kernel_options and variant.startswith("flex") and device.type == "cuda":
        try:  # what the options cost in accuracy: the output against PyTorch's defaults
            with torch.no_grad():
                default = compiled_flex_attention(q, k, v, block_mask=mask)
                result["max_error_vs_default"] = float((attention().float() - default.float()).abs().max())
        except Exception as e:  # noqa: BLE001 - the timing stands without it
            result["error_check_failed"] = error_line(e)
    return result


def error_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


CUDA = torch.cuda.is_available()


@dataclass
class BenchSettings:
    seq_lens: list[int] = setting([1024, 4096, 8192] if CUDA else [256], "sequence lengths", minimum=2)
    tokens: int = setting(
        65536 if CUDA else 2048, "tokens per batch (batch size = tokens / seq_len, at least 1)", minimum=1
    )
    n_layer: int = setting(12 if CUDA else 2, "transformer blocks", minimum=1)
    n_head: int = setting(12 if CUDA else 2, "attention heads", minimum=1)
    n_embd: int = setting(768 if CUDA else 64, "model width", minimum=1)
    vocab_size: int = setting(50304 if CUDA else 512, "vocabulary", minimum=2)
    doc_len: int = setting(300 if CUDA else 64, "synthetic document length", minimum=1)
    layouts: list[str] = setting(["real", "synthetic"], "document layouts to run", choices=("real", "synthetic"))
    pos_embs: list[str] = setting(["learned", "rope"], "position kinds to run", choices=("learned", "rope"))
    variants: list[str] = setting(list(VARIANTS), "variants to run", choices=tuple(VARIANTS))
    attention_only: bool = setting(False, "time the attention call alone")
    flex_kernel_options: str = setting(
        "",
        "a JSON list of FlexAttention kernel_options dicts: the flex variants' attention call is timed once with "
        "each (CUDA), e.g. '[{}, {\"ROWS_GUARANTEED_SAFE\": true}]'; their training step runs with PyTorch's own "
        "options, in the row of {} (default: PyTorch's own options only)",
    )
    steps: int = setting(20 if CUDA else 3, "timed steps (median reported)", minimum=1)
    warmup: int = setting(5 if CUDA else 1, "untimed steps first (compilation)", minimum=0)
    out: str = setting("bench.json", "where the JSON results are written", path=True)


def main(argv: list[str]) -> int:
    args = script_settings(BenchSettings, argv, __doc__, "python -m bench.attention")
    variants, layouts, pos_embs, seq_lens = args.variants, args.layouts, args.pos_embs, args.seq_lens
    try:
        option_sets = checked_option_sets(args)
    except ConfigError as e:  # settings that can never run: a usage error
        return error_exit(e, 2)
    device = torch.device("cuda" if CUDA else "cpu")
    # every kernel_options set and grad mode is one more compiled entry of compiled_flex_attention; past
    # the default limit of 8, dynamo would fall back to the slow unfused path and time that instead
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(option_sets) + 8)
    base = GPTConfig(vocab_size=args.vocab_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    out = Path(args.out)
    try:
        check_it_can_finish(args, base, device, out)
    except (ConfigError, SaveFailed) as e:
        return error_exit(e, 1)
    peak, peak_dtype = peak_matmul_flops(device)
    report = report_header(args, device, peak, peak_dtype)
    try:
        run_all(args, report, out, seq_lens, variants, layouts, pos_embs, option_sets, base, device, peak)
    except SaveFailed as e:  # a full disk or a file-size limit, after some rows: they stay in out
        return error_exit(e, 1)
    print(format_table(report["results"], args.n_layer))
    print(f"wrote {out}")
    return 0


def error_exit(error: Exception, code: int) -> int:
    """The one line on stderr that every script ends with on an error; `code` is main's to return."""
    print(f"error: {error}", file=sys.stderr)
    return code


def checked_option_sets(args: BenchSettings) -> list[dict | None]:
    """--flex_kernel_options as the kernel_options to time (None: PyTorch's own), once every setting is
    checked: a ConfigError now, not after minutes of benchmark."""
    if not (args.variants and args.layouts and args.pos_embs and args.seq_lens):
        raise ConfigError("variants, layouts, pos_embs and seq_lens must each name at least one")
    try:
        option_sets = json.loads(args.flex_kernel_options) if args.flex_kernel_options else [None]
    except json.JSONDecodeError as e:
        raise ConfigError(f"--flex_kernel_options: not JSON ({e})") from e
    if not (isinstance(option_sets, list) and option_sets and all(isinstance(o, dict | None) for o in option_sets)):
        raise ConfigError("--flex_kernel_options: give a non-empty JSON list of objects")
    if not any(o in (None, {}) for o in option_sets):
        raise ConfigError("--flex_kernel_options: include {} (PyTorch's own), the options the training step runs with")
    if args.n_embd % args.n_head or (args.n_embd // args.n_head) % 2:
        raise ConfigError(f"--n_embd={args.n_embd} must split into --n_head={args.n_head} heads of even size")
    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():
        raise ConfigError(f"--out={out} is a folder" if out.is_dir() else f"--out={out}: folder {out.parent} not found")
    return option_sets


def check_it_can_finish(args: BenchSettings, base: GPTConfig, device: torch.device, out: Path) -> None:
    """What would otherwise fail only after the benchmark: a size that does not fit the device (ConfigError),
    a results file that cannot be written (SaveFailed). A probe beside `out` is written, never `out` itself: an
    earlier benchmark's results stay until this one has a row."""
    for seq_len in args.seq_lens:
        check_fits(dataclasses.replace(base, seq_len=seq_len), max(1, args.tokens // seq_len), device)
    if (out.exists() or out.is_symlink()) and not out.is_file():
        raise SaveFailed(f"could not write {out} ({out} exists and is not a regular file)")
    probe = out.with_name(f".{out.name}.probe-{os.getpid()}")
    write_atomically(probe, "{}")
    probe.unlink()


def report_header(args: BenchSettings, device: torch.device, peak: float, peak_dtype: str) -> dict:
    """The results file's header, with no rows yet; the device line is printed too, before the first row."""
    hardware = torch.cuda.get_device_name(device) if CUDA else f"CPU ({torch.get_num_threads()} threads)"
    print(
        f"device: {hardware}, torch {torch.__version__}, measured peak {peak / 1e12:.2f} TFLOP/s ({peak_dtype} matmul)"
    )
    return {
        "device": hardware,
        "torch": torch.__version__,
        "peak_flops": peak,
        "peak_dtype": peak_dtype,
        "args": vars(args),
        "results": [],
    }


def run_all(args, report, out, seq_lens, variants, layouts, pos_embs, option_sets, base, device, peak) -> None:
    """Every row, each written to `out` as soon as it is measured."""
    cuda = device.type == "cuda"
    for seq_len in seq_lens:
        batch_size = max(1, args.tokens // seq_len)
        for layout in layouts:
            doc_ids = doc_ids_for_layout(layout, batch_size, seq_len, args.doc_len, seed=seq_len).to(device)
            ideal = ideal_speedup(doc_ids.cpu())
            for pos_emb in pos_embs:
                config = dataclasses.replace(base, seq_len=seq_len, pos_emb=pos_emb)
                for variant in variants:
                    if variant.startswith("reference_causal") and pos_emb != pos_embs[0]:
                        continue  # it has no position kind to vary: once per size and layout
                    flex = variant.startswith("flex")
                    for options in option_sets if flex else [None]:
                        row = {
                            "seq_len": seq_len,
                            "batch_size": batch_size,
                            "layout": layout,
                            "pos_emb": "learned" if variant.startswith("reference_causal") else pos_emb,
                            "variant": variant,
                            "docs_per_row": float((doc_ids[:, -1] + 1).float().mean()),
                            "ideal_doc_mask_speedup": ideal,
                        }
                        if flex:
                            row["kernel_options"] = options
                        try:
                            if args.attention_only:
                                row["skipped"] = "--attention_only=true"
                            elif options not in (None, {}):
                                row["skipped"] = "the step runs with PyTorch's kernel_options only (the row of {})"
                            else:
                                row.update(
                                    bench_training_step(variant, config, doc_ids, device, args.steps, args.warmup)
                                )
                            row.update(
                                bench_attention(variant, config, doc_ids, device, args.steps, args.warmup, options)
                            )
                        except Exception as e:  # noqa: BLE001 - one variant's failure must not stop the others
                            row["error"] = error_line(e)
                        if "tokens_per_sec" in row:
                            flops, attention = row["model_flops_per_token"], attention_flops_per_token(config)
                            row["mfu"] = row["tokens_per_sec"] * flops / peak
                            row["mfu_doc"] = row["tokens_per_sec"] * (flops - attention + attention / ideal) / peak
                        report["results"].append(row)
                        write_atomically(out, json.dumps(report, indent=1))
                        name = f"T={seq_len} {layout} {row['pos_emb']} {variant}"
                        print(f"  done: {name} {row.get('error', '')}", flush=True)
                        gc.collect()
                        if cuda:
                            torch.cuda.empty_cache()


def attention_flops_per_token(config: GPTConfig) -> float:
    return 12 * config.n_layer * config.n_embd * config.seq_len


def format_table(results: list[dict], n_layer: int) -> str:
    def cell(row: dict, key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "-"

    def same(row: dict, variant: str, pos_emb: str | None = None) -> dict | None:
        return next(
            (
                r
                for r in results
                if (r["seq_len"], r["layout"], r["variant"]) == (row["seq_len"], row["layout"], variant)
                and (pos_emb is None or r["pos_emb"] == pos_emb)
                and "step_ms" in r
            ),
            None,
        )

    header = ["T", "layout", "docs/row", "pos", "variant", "step ms", "tokens/s", "MFU", "MFU doc"]
    header += ["vs fastest reference", "vs sdpa_causal", "step ideal", "attn fwd+bwd ms", "attn ideal", "mask ms"]
    header += ["peak GB", "kernel options", "why '-'"]
    table = []
    for row in results:
        references = [r for r in (same(row, "reference_causal"), same(row, "reference_causal_cudnn")) if r]
        reference = min(references, key=lambda r: r["step_ms"], default=None)  # the faster causal kernel
        causal = same(row, "sdpa_causal", row["pos_emb"])
        vs_reference = vs_causal = step_ideal = "-"
        if "step_ms" in row and reference:
            vs_reference = f"{reference['step_ms'] / row['step_ms']:.2f}x"
        if "step_ms" in row and causal:
            vs_causal = f"{causal['step_ms'] / row['step_ms']:.2f}x"
            if row["variant"].startswith("flex_doc") and "attention_ms" in causal:
                attention = n_layer * causal["attention_ms"]
                saved = attention * (1 - 1 / row["ideal_doc_mask_speedup"])
                step_ideal = f"{causal['step_ms'] / (causal['step_ms'] - min(saved, 0.99 * causal['step_ms'])):.2f}x"
        options = row.get("kernel_options")
        table.append(
            [
                row["seq_len"],
                row["layout"],
                f"{row['docs_per_row']:.1f}",
                row["pos_emb"],
                row["variant"],
                cell(row, "step_ms", ".1f"),
                cell(row, "tokens_per_sec", ",.0f"),
                cell(row, "mfu", ".1%"),
                cell(row, "mfu_doc", ".1%"),
                vs_reference,
                vs_causal,
                step_ideal,
                cell(row, "attention_ms", ".2f") + ("" if row.get("backward", True) else " (fwd only)"),
                f"{row['ideal_doc_mask_speedup']:.1f}x",
                cell(row, "block_mask_ms", ".2f"),
                cell(row, "peak_memory_gb", ".1f"),
                json.dumps(options) if options is not None else "-",
                "; ".join(empty_cell_reasons(row, reference, causal)),
            ]
        )
    return "\n".join(markdown_table(header, table) + column_notes(header, table))


# why a column shows '-' in rows that the last column does not explain
COLUMN_NOTES = {
    "step ideal": "flex_doc rows only, against a timed sdpa_causal",
    "mask ms": "the BlockMask build, FlexAttention rows whose step ran",
    "peak GB": "measured on CUDA only, in the training step",
    "kernel options": "PyTorch's defaults, or not a FlexAttention row",
}


def column_notes(header: list[str], table: list[list]) -> list[str]:
    """A line under the table on the columns with a '-' that the last column does not explain."""
    dashed = [column for column in COLUMN_NOTES if any(row[header.index(column)] == "-" for row in table)]
    notes = "; ".join(f"{column}: {COLUMN_NOTES[column]}" for column in dashed)
    return ["", f"'-' where the last column does not say why: {notes}"] if dashed else []


def empty_cell_reasons(row: dict, reference: dict | None, causal: dict | None) -> list[str]:
    """Why this row's step, comparison and attention cells are '-' (COLUMN_NOTES: the other columns')."""
    if "error" in row:
        return [f"error: {row['error']}"]
    reasons = []
    if "step_ms" not in row:
        reasons.append(f"step: {row.get('skipped', 'not timed')}")
    else:
        if reference is None:
            reasons.append("vs reference: no reference_causal step timed at this size and layout")
        if causal is None:
            reasons.append("vs sdpa_causal: no sdpa_causal step timed at this size, layout and pos")
    if "attention_ms" not in row:
        reasons.append(f"attention: {row.get('attention_skipped', 'not timed')}")
    return reasons


if __name__ == "__main__":
    run_main(main)
