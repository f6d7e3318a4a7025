"""Attention kernels as pure tensor functions (Triton on GPU, torch references everywhere)."""
from kernels.reference import decode_attention_ref, prefill_attention_ref, store_kv_ref

__all__ = ["decode_attention_ref", "prefill_attention_ref", "store_kv_ref"]
