"""Attention kernels as pure tensor functions (Triton on GPU, torch references everywhere).

`decode_attention(..., variant="standard" | "flash" | "fdpp")` is the functional decode entry point,
`plan_decode` (once per step) + `run_decode` (per layer) the same work split at the step boundary;
`decode_reference` is the same signature in torch (the CPU path and the kernels' oracle).
"""
from kernels.attention.decode import DecodePlan, decode_attention, plan_decode, run_decode
from kernels.attention.decode_host import choose_num_splits
from kernels.attention.fdpp import fdpp_decode, new_stats
from kernels.attention.flash_decoding import flash_decode
from kernels.attention.kv_store import store_kv
from kernels.attention.prefill import prefill_attention
from kernels.attention.reference import (
                               decode_attention_ref,
                               decode_reference,
                               fdpp_decode_ref,
                               flash_decode_ref,
                               prefill_attention_ref,
                               store_kv_ref,
)
from kernels.ffd.decode import FFDDecodePlan, ffd_decode, plan_ffd_decode, run_ffd_decode
from kernels.vendor import check_vendor, detect_vendor

__all__ = [
    "decode_attention", "plan_decode", "run_decode", "DecodePlan", "decode_reference", "flash_decode",
    "fdpp_decode", "new_stats", "ffd_decode", "plan_ffd_decode", "run_ffd_decode", "FFDDecodePlan",
    "choose_num_splits", "store_kv", "prefill_attention", "check_vendor", "detect_vendor",
    "decode_attention_ref", "flash_decode_ref", "fdpp_decode_ref", "prefill_attention_ref", "store_kv_ref",
]
