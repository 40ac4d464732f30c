#!/usr/bin/env bash
# The GPU speed check in one call of about 8 minutes on one H100/H200 (the stages' limits add up to 440 s,
# each stopped at most 10 s after its limit; its real wall time is not yet measured): the GPU tests, then the
# training step of every attention variant side by side at T=1024 and T=8192, then the FlexAttention
# kernel_options one set per row (attention call alone, with its error against the defaults).
#
#     OUT=out/bench_gpu bash bench/gpu.sh
#
# Each stage has its own time limit and writes its results as it goes, so a stage that runs out of time
# keeps its finished rows and the next stage still runs. Compiled kernels are cached in
# $TORCHINDUCTOR_CACHE_DIR (default: a folder beside the results), so a rerun on the same machine skips
# most compilation.
set -u
OUT=${OUT:-out/bench_gpu}
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$OUT/../inductor_cache}

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.txt, report the exit status
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    echo "stage $name: exit $? after $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/stages.txt"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >"$OUT/env.txt" 2>&1

stage test_gpu 90 python -m pytest -q tests/test_gpu.py
stage bench_T1024 180 python -m bench.attention --seq_lens=1024 --tokens=32768 --layouts=synthetic \
    --pos_embs=learned,rope --steps=10 --warmup=3 --out="$OUT/bench_T1024.json" \
    --variants=reference_causal,reference_causal_cudnn,flex_doc,flex_doc_by_position,sdpa_causal
stage bench_T8192 80 python -m bench.attention --seq_lens=8192 --tokens=65536 --layouts=synthetic \
    --pos_embs=learned --steps=5 --warmup=2 --out="$OUT/bench_T8192.json" \
    --variants=reference_causal,reference_causal_cudnn,flex_doc,sdpa_causal
stage kernel_options 90 python -m bench.attention --seq_lens=1024 --tokens=32768 --layouts=synthetic \
    --pos_embs=learned --variants=flex_doc --attention_only=true --steps=20 --warmup=3 \
    --out="$OUT/kernel_options_T1024.json" --flex_kernel_options='[{}, {"PRESCALE_QK": true},
    {"fwd_BLOCK_N": 64}, {"fwd_num_warps": 8}, {"bwd_num_stages": 2}, {"bwd_num_stages": 4},
    {"bwd_num_warps": 4}, {"ROWS_GUARANTEED_SAFE": true, "BLOCKS_ARE_CONTIGUOUS": true}]'

cat "$OUT/stages.txt"
for name in bench_T1024 bench_T8192 kernel_options; do
    grep -E '^\|' "$OUT/$name.txt" | cut -c1-220
done
