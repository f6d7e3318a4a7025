"""Attention kernels as pure tensor functions (Triton on GPU, torch references everywhere).

`decode_attention(..., variant="standard" | "flash" | "fdpp")` is the one decode entry point;
`decode_reference` is the same signature in torch (the CPU path and the kernels' oracle).
"""
from kernels.attention.fdpp import fdpp_decode, new_stats
from kernels.attention.flash_decoding import choose_num_splits, decode_attention, flash_decode
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
from kernels.vendor import check_vendor, detect_vendor

__all__ = [
    "decode_attention", "decode_reference", "flash_decode", "fdpp_decode", "new_stats",
    "choose_num_splits", "store_kv", "prefill_attention", "check_vendor", "detect_vendor",
    "decode_attention_ref", "flash_decode_ref", "fdpp_decode_ref", "prefill_attention_ref", "store_kv_ref",
]
