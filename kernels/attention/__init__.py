"""Paged attention kernels (decode: standard, Flash-Decoding, FlashDecoding++; prefill; KV store) and their torch
references."""
