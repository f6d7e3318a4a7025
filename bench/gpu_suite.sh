#!/usr/bin/env bash
# Every GPU check and benchmark of bench/RESULTS.md in one go, each step under its own time limit,
# results under OUT (default bench/results/gpu_suite). Order: correctness first, then speed; the
# end-to-end rows last because they take longest. About 9 minutes on an H200.
#   bash bench/gpu_suite.sh [OUT]
set -u
OUT=${1:-bench/results/gpu_suite}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
step() {  # step SECONDS NAME COMMAND...: run, log to OUT/NAME.log, say how it ended
    local limit=$1 name=$2; shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? ($(tail -n 1 "$OUT/$name.log"))"
}
M="--model synthetic:llama-3.1-8b --no-plot"
step 120 gpu_tests python -m pytest -q -x tests/test_engine_gpu.py tests/test_fused_ops.py tests/test_matmul.py
step 100 ffd_check python bench/ffd_kernels.py --check --out "$OUT"
step 120 ffd_bench python bench/ffd_kernels.py --bench --budget-s 90 --out "$OUT"
step 150 matmul python bench/matmul.py --quick-tune --out "$OUT"
step 60 decode_profile python bench/decode_profile.py --context-len 1024 --out "$OUT"
step 90 latency_1k python -m bench.e2e latency $M --set backend.max_num_seqs=4 --context-len 1024 \
    --max-tokens 96 --repeat 2 --variants standard,flash --transformers --out "$OUT/latency_1k.json"
step 80 latency_16k python -m bench.e2e latency $M --set backend.max_num_seqs=4 --context-len 16384 \
    --max-tokens 96 --repeat 2 --variants standard,flash --out "$OUT/latency_16k.json"
step 100 concurrency_32x16k python -m bench.e2e concurrency $M --set backend.max_num_seqs=32 \
    --set backend.max_num_batched_tokens=16384 --context-len 16384 --max-tokens 64 --repeat 1 \
    --warmup 0 --num-requests 32 --variants flash --out "$OUT/concurrency_32x16k.json"
