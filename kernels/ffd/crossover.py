"""The stored FFD crossover per GPU (`crossover.json` beside this file): the context length from
which our FFD kernel (δ = 5 nats, BS = 128) beats our dense Flash-Decoding kernel at batch 1 and 8,
measured by `bench/ffd_kernels.py --crossover` (bench/RESULTS.md, "FFD crossover (stored table)").

A GPU name (`torch.cuda.get_device_name`) maps to a token count, or to null: measured, and FFD
was never faster there.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

TABLE_PATH = Path(__file__).resolve().parent / "crossover.json"


@functools.lru_cache(maxsize=1)
def crossover_table() -> dict[str, int | None]:
    """GPU name -> crossover context length in tokens (None: FFD never faster), read once."""
    data = json.loads(TABLE_PATH.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not all(v is None or (isinstance(v, int) and v > 0) for v in data.values()):
        raise ValueError(f"{TABLE_PATH}: expected {{\"<GPU name>\": <tokens> or null, ...}}")
    return {str(name): tokens for name, tokens in data.items()}
