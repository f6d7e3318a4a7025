"""Decode-phase matmuls (GEMV, flat GEMM) and the per-GPU table that picks one per shape."""
