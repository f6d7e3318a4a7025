"""Faster Flash Decoding kernels: 2-bit key scan, top-δ block selection, FP8 residual refine, and the torch rule."""
