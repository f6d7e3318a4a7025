"""Tensor parallelism across processes: starting the ranks, the driver's step messages, the other ranks' loop."""
