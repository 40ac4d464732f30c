"""Benchmark attention variants for packed documents, side by side in one run.

    python bench.py                       # GPU: GPT-2 small at seq_len 1024, 4096, 8192; CPU: a small size
    python bench.py --seq_lens=1024 --steps=20 --out=bench.json

For each size and document layout, every variant runs (1) the real training step (forward, backward,
AdamW) of the GPT in model.py and (2) the attention call alone, and reports tokens/s, time, MFU, peak
memory and, for FlexAttention, the BlockMask build time per step.

  flex_doc     FlexAttention, block-sparse document mask (what train.py uses on CUDA)
  flex_causal  FlexAttention, causal mask only
  sdpa_causal  SDPA with is_causal (nanoGPT's path; no document mask)
  sdpa_doc     SDPA with the dense document mask (what train.py uses on CPU)
  varlen       FlashAttention varlen (torch.nn.attention.varlen), attention alone, CUDA only

MFU: model FLOPs per token as in the PaLM paper's appendix B, 6N + 12*L*H*Q*T (N parameters, the tied
output layer included, L layers, H heads, Q head size, T sequence length), the same for every variant, divided
by the peak matmul rate this script measures on the same device (bf16 on GPU, fp32 on CPU). The ideal
speedup of the document mask over causal attention is the ratio of attention-score entries computed:
T(T+1)/2 against the sum over documents of l(l+1)/2.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import data
import train
from model import GPT, GPTConfig, attend, document_causal_block_mask, document_causal_dense

VARIANTS = ("flex_doc", "flex_causal", "sdpa_causal", "sdpa_doc", "varlen")


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
    return list(data.stdlib_documents(split_definitions=True))


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


def bench_training_step(variant: str, config: GPTConfig, doc_ids, device, steps, warmup) -> dict:
    if variant == "varlen":
        return {"skipped": "attention only"}
    flex = variant.startswith("flex")
    if flex and device.type != "cuda":
        return {"skipped": "FlexAttention has no backward on CPU"}
    cfg = GPTConfig(
        **{**config.__dict__, "doc_mask": variant != "sdpa_causal", "attn_impl": "flex" if flex else "sdpa"}
    )
    doc = torch.zeros_like(doc_ids) if variant == "flex_causal" else doc_ids  # one document: a causal BlockMask
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    B, T = doc_ids.shape
    inputs = torch.randint(0, cfg.vocab_size, (B, T), device=device)
    positions = torch.arange(T, device=device).expand(B, T)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    compiled = torch.compile(model) if device.type == "cuda" else model

    def step():
        with autocast:
            logits = compiled(inputs, doc, positions)
        loss = F.cross_entropy(logits.float().flatten(0, 1), inputs.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = timed(step, device, steps, warmup)
    result = {
        "step_ms": seconds * 1e3,
        "tokens_per_sec": B * T / seconds,
        "model_flops_per_token": model_flops_per_token(cfg, model),
    }
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    if flex:
        result["block_mask_ms"] = timed(lambda: document_causal_block_mask(doc), device, steps, warmup) * 1e3
    return result


def bench_attention(variant: str, config: GPTConfig, doc_ids, device, steps, warmup) -> dict:
    """The attention call alone, forward (and backward where the device has one)."""
    B, T = doc_ids.shape
    H, D = config.n_head, config.n_embd // config.n_head
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backward = device.type == "cuda" or not variant.startswith("flex")
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=backward) for _ in range(3))
    if variant == "varlen":
        if not has_varlen():
            return {"skipped": "needs CUDA and torch.nn.attention.varlen"}
        from torch.nn.attention.varlen import varlen_attn

        lengths = torch.cat([torch.unique_consecutive(row, return_counts=True)[1] for row in doc_ids.cpu()])
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device, torch.int32)
        max_len = int(lengths.max())
        qp, kp, vp = (x.detach().transpose(1, 2).reshape(B * T, H, D).requires_grad_() for x in (q, k, v))

        def call():
            out = varlen_attn(qp, kp, vp, cu_seqlens, cu_seqlens, max_len, max_len, is_causal=True)
            out.sum().backward()
    else:
        if variant == "sdpa_causal":
            mask = None
        elif variant == "sdpa_doc":
            mask = document_causal_dense(doc_ids)
        else:
            mask = document_causal_block_mask(torch.zeros_like(doc_ids) if variant == "flex_causal" else doc_ids)

        def call():
            with torch.no_grad() if not backward else nullcontext():
                out = attend(q, k, v, mask)
            if backward:
                out.sum().backward()

    seconds = timed(call, device, steps, warmup)
    return {"attention_ms": seconds * 1e3, "backward": backward}


def main(argv: list[str]) -> int:
    cuda = torch.cuda.is_available()
    parser = train.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--seq_lens", default="1024,4096,8192" if cuda else "256", help="comma-separated sequence lengths"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=65536 if cuda else 2048,
        help="tokens per batch (batch size = tokens / seq_len, at least 1)",
    )
    parser.add_argument("--n_layer", type=int, default=12 if cuda else 2)
    parser.add_argument("--n_head", type=int, default=12 if cuda else 2)
    parser.add_argument("--n_embd", type=int, default=768 if cuda else 64)
    parser.add_argument("--vocab_size", type=int, default=50304 if cuda else 512)
    parser.add_argument("--doc_len", type=int, default=300 if cuda else 64, help="synthetic document length")
    parser.add_argument("--layouts", default="real,synthetic", help="document layouts to run: real, synthetic")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS)
    )
    parser.add_argument("--steps", type=int, default=20 if cuda else 3, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=5 if cuda else 1, help="untimed steps first (compilation)")
    parser.add_argument("--out", default="bench.json", help="where the JSON results are written")
    args = parser.parse_args(argv)
    variants, layouts = args.variants.split(","), args.layouts.split(",")
    for name, chosen, valid in (("variants", variants, VARIANTS), ("layouts", layouts, ("real", "synthetic"))):
        if unknown := sorted(set(chosen) - set(valid)):
            parser.error(f"--{name}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(valid)}")
    try:
        seq_lens = [int(s) for s in args.seq_lens.split(",")]
    except ValueError:
        parser.error(f"--seq_lens={args.seq_lens!r}: give comma-separated integers")
    for name, value, minimum in [
        ("seq_lens", min(seq_lens), 2),
        *((k, getattr(args, k), 1) for k in ("tokens", "n_layer", "n_head", "n_embd", "doc_len", "steps")),
        ("vocab_size", args.vocab_size, 2),
        ("warmup", args.warmup, 0),
    ]:
        if value < minimum:
            parser.error(f"--{name}: {value} is below {minimum}")
    if args.n_embd % args.n_head or (args.n_embd // args.n_head) % 2:
        parser.error(f"--n_embd={args.n_embd} must split into --n_head={args.n_head} heads of even size")
    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():
        parser.error(f"--out={out} is a folder" if out.is_dir() else f"--out={out}: folder {out.parent} not found")

    device = torch.device("cuda" if cuda else "cpu")
    configs = [
        GPTConfig(
            vocab_size=args.vocab_size,
            seq_len=seq_len,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
            pos_emb="rope",
        )
        for seq_len in seq_lens
    ]
    try:
        for config in configs:
            train.check_fits(config, max(1, args.tokens // config.seq_len), device)
    except train.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    peak, peak_dtype = peak_matmul_flops(device)
    hardware = torch.cuda.get_device_name(device) if cuda else f"CPU ({torch.get_num_threads()} threads)"
    print(
        f"device: {hardware}, torch {torch.__version__}, measured peak {peak / 1e12:.2f} TFLOP/s ({peak_dtype} matmul)"
    )
    results = []
    for config in configs:
        seq_len = config.seq_len
        batch_size = max(1, args.tokens // seq_len)
        for layout in layouts:
            doc_ids = doc_ids_for_layout(layout, batch_size, seq_len, args.doc_len, seed=seq_len).to(device)
            docs_per_row = float((doc_ids[:, -1] + 1).float().mean())
            for variant in variants:
                row = {
                    "seq_len": seq_len,
                    "batch_size": batch_size,
                    "layout": layout,
                    "variant": variant,
                    "docs_per_row": docs_per_row,
                    "ideal_doc_mask_speedup": ideal_speedup(doc_ids.cpu()),
                }
                row.update(bench_training_step(variant, config, doc_ids, device, args.steps, args.warmup))
                row.update(bench_attention(variant, config, doc_ids, device, args.steps, args.warmup))
                if "tokens_per_sec" in row:
                    row["mfu"] = row["tokens_per_sec"] * row["model_flops_per_token"] / peak
                results.append(row)
                print(f"  done: T={seq_len} {layout} {variant}", flush=True)
    report = {
        "device": hardware,
        "torch": torch.__version__,
        "peak_flops": peak,
        "peak_dtype": peak_dtype,
        "args": vars(args),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(format_table(results))
    print(f"wrote {args.out}")
    return 0


def format_table(results: list[dict]) -> str:
    def cell(row: dict, key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "-"

    header = (
        "| T | layout | docs/row | variant | step ms | tokens/s | MFU | attn fwd+bwd ms | mask build ms | peak GB "
        "| speedup vs sdpa_causal | ideal |"
    )
    lines = [header, "|" + " --- |" * (header.count("|") - 1)]
    for row in results:
        base = next(
            (
                r
                for r in results
                if r["seq_len"] == row["seq_len"]
                and r["layout"] == row["layout"]
                and r["variant"] == "sdpa_causal"
                and "step_ms" in r
            ),
            None,
        )
        speedup = f"{base['step_ms'] / row['step_ms']:.2f}x" if base and "step_ms" in row else "-"
        lines.append(
            f"| {row['seq_len']} | {row['layout']} | {row['docs_per_row']:.1f} | {row['variant']} "
            f"| {cell(row, 'step_ms', '.1f')} | {cell(row, 'tokens_per_sec', ',.0f')} | {cell(row, 'mfu', '.1%')} "
            f"| {cell(row, 'attention_ms', '.2f')}{'' if row.get('backward', True) else ' (fwd only)'} "
            f"| {cell(row, 'block_mask_ms', '.2f')} "
            f"| {cell(row, 'peak_memory_gb', '.1f')} | {speedup} | {row['ideal_doc_mask_speedup']:.1f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
