#!/usr/bin/env bash
# Every GPU check and benchmark of bench/RESULTS.md, each step under its own time limit, results
# under OUT (default bench/results/gpu_suite). Two parts of about 7 to 9 minutes each on an H200, so each
# fits one 10-minute device session; correctness before speed, the end-to-end rows last; "floor" (about
# 2 minutes) is bench/ffd_floor.py.
#   bash bench/gpu_suite.sh [OUT] [all|kernels|e2e|floor|fp8|moe|moe_e2e|prefill|ttft|tp]
# "fp8" (about 9 minutes): FP8 KV pages, kernels against the float32 oracle and timed, then the
# end-to-end rows over bf16 and FP8 pages side by side.
# "moe" (about 9 minutes): the MoE GPU tests, then bench/moe.py tunes the fused-MoE configs at
# Qwen3-30B-A3B's expert shape, checks them against float32 and times them against a per-expert
# cuBLAS loop; "moe_e2e" (about 8 minutes): synthetic:qwen3-30b-a3b end to end (batch 1 at 1K and
# 16K, 32 concurrent 4K requests). "prefill" (about 18 minutes: two device calls): the prefill kernel's and
# the cuDNN prefix's GPU tests and the kernel's per-layer time against SDPA, then the time to first token from
# 1K to 130K beside transformers, FFD's own prefill rule at 4K to 130K, pages of 16 and of 128, and where that
# time goes at 1K, 32K and
# 130K (bench/prefill_profile.py). "ttft" (about 8 minutes, one device call; not part of "all", whose
# "prefill" covers it): the prefill GPU tests, the time to the first token at 4K to 130K beside transformers
# (median of 3), and decode latency at 1K, 16K and 100K. "tp" (two GPUs, not part of "all"): the
# tensor-parallel GPU tests, then
# synthetic Llama-3.1-8B at TP = 1 and TP = 2 (batch 1 at 1K, 32 x 16K) and synthetic Llama-3.1-70B at
# TP = 2 (batch 1 at 1K, one 32K prompt), with NVLink multicast off.
set -u
OUT=${1:-bench/results/gpu_suite}
PART=${2:-all}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
step() {  # step SECONDS NAME COMMAND...: run, log to OUT/NAME.log, say how it ended
    local limit=$1 name=$2; shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? ($(tail -n 1 "$OUT/$name.log"))"
}
prefill_tests() {  # the prefill kernel's GPU tests: first in "prefill" and in "ttft"
    step 120 prefill_tests python -m pytest -q tests/kernels/test_prefill.py tests/kernels/test_kernels.py -k prefill
}
if [ "$PART" = kernels ] || [ "$PART" = all ]; then
    step 240 gpu_tests python -m pytest -q tests/engine/test_engine_gpu.py tests/kernels/test_fused_ops.py tests/kernels/test_matmul.py \
        tests/kernels/test_kernels.py tests/kernels/test_ffd_kernels.py tests/kernels/test_ffd_prefill.py tests/engine/test_ffd_compact.py
    step 100 ffd_check python bench/ffd_kernels.py --check --out "$OUT"
    step 120 ffd_bench python bench/ffd_kernels.py --bench --budget-s 90 --out "$OUT"
    step 100 ffd_prefill python bench/ffd_kernels.py --prefill --out "$OUT/prefill"
    step 150 matmul python bench/matmul.py --out "$OUT"
fi
if [ "$PART" = e2e ] || [ "$PART" = all ]; then
    M="--model synthetic:llama-3.1-8b --no-plot"
    step 60 decode_profile python bench/decode_profile.py --context-len 1024 --out "$OUT"
    step 110 latency_1k python -m bench.e2e latency $M --set backend.max_num_seqs=4 --context-len 1024 \
        --max-tokens 96 --repeat 2 --variants standard,flash --transformers --out "$OUT/latency_1k.json"
    step 80 latency_16k python -m bench.e2e latency $M --set backend.max_num_seqs=4 --context-len 16384 \
        --max-tokens 96 --repeat 2 --variants flash --out "$OUT/latency_16k.json"
    step 100 concurrency_32x16k python -m bench.e2e concurrency $M --set backend.max_num_seqs=32 \
        --set backend.max_num_batched_tokens=16384 --context-len 16384 --max-tokens 64 --repeat 1 \
        --warmup 0 --num-requests 32 --variants flash --out "$OUT/concurrency_32x16k.json"
fi
if [ "$PART" = floor ] || [ "$PART" = all ]; then   # about 90 s: the FFD data flow with no arithmetic
    step 200 ffd_floor python bench/ffd_floor.py --budget-s 150 --out "$OUT"
fi
if [ "$PART" = fp8 ] || [ "$PART" = all ]; then
    M="--model synthetic:llama-3.1-8b --no-plot"
    step 70 fp8_tests python -m pytest -q tests/kernels/test_kv_fp8.py
    step 100 fp8_kernels python bench/kv_fp8.py --check --bench --out "$OUT"
    step 200 fp8_latency_100k python -m bench.e2e latency $M --set backend.max_num_seqs=4 --context-len 100000 \
        --max-tokens 96 --repeat 2 --variants flash,flash+fp8_e4m3,flash+fp8_e5m2 --out "$OUT/fp8_latency_100k.json"
    step 200 fp8_concurrency_32x16k python -m bench.e2e concurrency $M --set backend.max_num_seqs=32 \
        --set backend.max_num_batched_tokens=16384 --context-len 16384 --max-tokens 64 --repeat 1 \
        --warmup 0 --num-requests 32 --variants flash,flash+fp8_e4m3,flash+fp8_e5m2 --out "$OUT/fp8_concurrency_32x16k.json"
fi
if [ "$PART" = moe ] || [ "$PART" = all ]; then
    step 220 moe_tests python -m pytest -q tests/kernels/test_moe.py tests/engine/test_moe_gpu.py
    step 330 moe_kernels python bench/moe.py --tune --quick --check --bench --out "$OUT"
fi
if [ "$PART" = moe_e2e ] || [ "$PART" = all ]; then
    M="--model synthetic:qwen3-30b-a3b --no-plot"
    step 150 moe_latency_1k python -m bench.e2e latency $M --set backend.max_num_seqs=4 --context-len 1024 \
        --max-tokens 96 --repeat 2 --variants standard,flash --out "$OUT/moe_latency_1k.json"
    step 130 moe_latency_16k python -m bench.e2e latency $M --set backend.max_num_seqs=4 --context-len 16384 \
        --max-tokens 96 --repeat 2 --variants flash,ffd --out "$OUT/moe_latency_16k.json"
    step 180 moe_concurrency_32x4k python -m bench.e2e concurrency $M --set backend.max_num_seqs=32 \
        --set backend.max_num_batched_tokens=16384 --context-len 4096 --max-tokens 64 --repeat 1 \
        --warmup 0 --num-requests 32 --variants flash --out "$OUT/moe_concurrency_32x4k.json"
fi
if [ "$PART" = prefill ] || [ "$PART" = all ]; then
    prefill_tests
    step 150 prefix_tests python -m pytest -q tests/kernels/test_prefill_prefix.py tests/engine/test_engine_gpu.py
    step 110 prefill_kernels python bench/prefill_kernels.py --check --prompt --prompt-pages 16,128 --chunks 2048 \
        --lengths 16384,131072 --out "$OUT"
    L=1024,4096,16384,32768,65536,102400,130000
    step 230 prefill_ttft_b16 python -m bench.e2e prefill --model synthetic:llama-3.1-8b --variants flash \
        --transformers --context-lens $L --max-tokens 32 --repeat 2 --out "$OUT/e2e_prefill_b16.json"
    step 300 prefill_ttft_ffd python -m bench.e2e prefill --model synthetic:llama-3.1-8b --variants ffd \
        --context-lens 4096,16384,32768,65536,130000 --max-tokens 8 --repeat 1 --out "$OUT/e2e_prefill_ffd.json"
    step 150 prefill_ttft_b128 python -m bench.e2e prefill --model synthetic:llama-3.1-8b --variants flash \
        --set backend.block_size=128 --context-lens $L --max-tokens 32 --repeat 2 --out "$OUT/e2e_prefill_b128.json"
    for N in 1024 32768 130000; do
        step 200 prefill_profile_$N python bench/prefill_profile.py --model synthetic:llama-3.1-8b \
            --context-len $N --transformers --out "$OUT"
    done
fi
if [ "$PART" = ttft ]; then
    prefill_tests
    step 270 prefill_ttft python -m bench.e2e prefill --model synthetic:llama-3.1-8b --no-plot --variants flash \
        --transformers --context-lens 4096,16384,32768,65536,130000 --max-tokens 8 --repeat 3 --out "$OUT/e2e_prefill.json"
    for N in 1024 16384 100000; do
        step 70 decode_latency_$N python -m bench.e2e latency --model synthetic:llama-3.1-8b --no-plot \
            --set backend.max_num_seqs=4 --context-len $N --max-tokens 96 --repeat 2 --variants flash \
            --out "$OUT/decode_latency_$N.json"
    done
fi
if [ "$PART" = tp ]; then
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    step 300 tp_gpu_tests python -m pytest -q tests/engine/test_tensor_parallel_gpu.py
    for TP in 1 2; do
        M="--model synthetic:llama-3.1-8b --no-plot --set backend.tensor_parallel_size=$TP"
        step 150 tp${TP}_latency_1k python -m bench.e2e latency $M --set backend.max_num_seqs=4 --context-len 1024 \
            --max-tokens 128 --repeat 2 --variants flash --out "$OUT/tp${TP}_latency_1k.json"
        step 240 tp${TP}_concurrency_32x16k python -m bench.e2e concurrency $M --set backend.max_num_seqs=32 \
            --set backend.max_num_batched_tokens=16384 --context-len 16384 --max-tokens 64 --repeat 1 \
            --warmup 0 --num-requests 32 --variants flash --out "$OUT/tp${TP}_concurrency_32x16k.json"
    done
    M="--model synthetic:llama-3.1-70b --no-plot --set backend.tensor_parallel_size=2 --set backend.max_num_seqs=4"
    step 300 tp2_70b_latency_1k python -m bench.e2e latency $M --context-len 1024 --max-tokens 128 --repeat 2 \
        --variants flash --out "$OUT/tp2_70b_latency_1k.json"
    step 300 tp2_70b_latency_32k python -m bench.e2e latency $M --context-len 32768 --max-tokens 32 --repeat 1 \
        --variants flash --out "$OUT/tp2_70b_latency_32k.json"
fi
