"""Launch configs of the fused MoE kernels: vendor defaults, or a per-GPU table from `fdserve tune --moe`.

The table (`moe_table-<gpu>.json`, in `$FDSERVE_CACHE_DIR` or shipped beside this file) holds, per
MoE shape (experts, top-k, hidden, intermediate), the fastest measured config at a set of token
counts; a batch uses the entry of the smallest measured count at or above its own (the largest
one past the end). Shapes the table lacks use the defaults below.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels.cache_dir import cache_root
from kernels.vendor import detect_vendor

IMPLS = ("gemv", "gemm", "pairs")
TABLE_VERSION = 1
# (num_experts, top_k, hidden, intermediate)
MoeShape = tuple[int, int, int, int]


@dataclass(frozen=True)
class MoeConfig:
    """One `fused_moe` launch shape: the path, its tiles, warps and pipeline depth."""

    impl: str = "gemv"
    block_m: int = 16          # grouped GEMM: rows (pairs of one expert) per program
    block_n: int = 32          # gate_up: intermediate features per program
    down_block_n: int = 16     # down: hidden features per program
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    extra: dict[str, int] = field(default_factory=dict)   # vendor-only launch options

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"MoeConfig.impl must be one of {IMPLS}, got {self.impl!r}")
        for name in ("block_m", "block_n", "down_block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MoeConfig.{name} must be a power of two, got {value}")
        if self.impl in ("gemm", "pairs") and self.block_m < 16:
            raise ValueError(f"MoeConfig.block_m must be >= 16 for the grouped GEMM (tl.dot), got {self.block_m}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MoeConfig:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown MoeConfig keys {sorted(unknown)}")
        return cls(**data)


def default_config(num_tokens: int, num_experts: int, top_k: int, vendor: str, element_bytes: int = 2) -> MoeConfig:
    """The config for a shape no table covers. On the H200 the tensor-core paths with 16-row blocks
    beat the pair GEMV at every M (bench/RESULTS.md), and one token skips the alignment ("pairs");
    float32 operands halve the K tile so a 3-stage pipeline fits in shared memory."""
    if vendor == "cpu":      # the interpreter: small tiles keep it quick
        impl = "gemv" if num_tokens <= 4 else "gemm"
        return MoeConfig(impl, block_m=16, block_n=16, down_block_n=16, block_k=32, num_stages=1)
    impl = "pairs" if num_tokens == 1 else "gemm"
    pairs_per_expert = num_tokens * top_k / num_experts
    block_m = 16 if impl == "pairs" or pairs_per_expert <= 16 else 32 if pairs_per_expert <= 48 else 64
    if vendor == "amd":
        return MoeConfig(impl, block_m=min(block_m, 32), block_n=64, down_block_n=64, block_k=32,
                         num_stages=1, extra={"waves_per_eu": 2, "matrix_instr_nonkdim": 16})
    wide = block_m >= 64 and element_bytes <= 2
    block_k = (128 if block_m == 16 else 64) // (1 if element_bytes <= 2 else 2)
    return MoeConfig(impl, block_m=block_m, block_n=128 if wide else 64, down_block_n=128 if wide else 64,
                     block_k=block_k, num_warps=8 if wide else 4, num_stages=3)


@dataclass
class MoeTable:
    gpu: str
    dtype: str
    entries: dict[MoeShape, dict[int, MoeConfig]] = field(default_factory=dict)
    timings: dict[MoeShape, dict[int, dict[str, float]]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def lookup(self, shape: MoeShape, num_tokens: int) -> MoeConfig | None:
        per_m = self.entries.get(shape)
        if not per_m:
            return None
        above = [m for m in per_m if m >= num_tokens]
        return per_m[min(above) if above else max(per_m)]

    def to_json(self) -> dict[str, Any]:
        shapes = [{"E": e, "top_k": k, "H": h, "I": i,
                   "m": {str(m): {"config": c.to_dict(), "us": self.timings.get((e, k, h, i), {}).get(m, {})}
                         for m, c in sorted(per_m.items())}}
                  for (e, k, h, i), per_m in sorted(self.entries.items())]
        return {"version": TABLE_VERSION, "gpu": self.gpu, "dtype": self.dtype, **self.meta, "shapes": shapes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MoeTable:
        if data.get("version") != TABLE_VERSION:
            raise ValueError(f"table version {data.get('version')!r}, this fdserve reads {TABLE_VERSION}")
        meta = {k: v for k, v in data.items() if k not in ("version", "gpu", "dtype", "shapes")}
        table = cls(str(data["gpu"]), str(data["dtype"]), meta=meta)
        for row in data["shapes"]:
            key = (int(row["E"]), int(row["top_k"]), int(row["H"]), int(row["I"]))
            for m, entry in row["m"].items():
                table.entries.setdefault(key, {})[int(m)] = MoeConfig.from_dict(entry["config"])
                table.timings.setdefault(key, {})[int(m)] = {n: float(t) for n, t in entry.get("us", {}).items()}
        return table


def table_file_name(gpu_name: str) -> str:
    return f"moe_table-{re.sub(r'[^A-Za-z0-9._-]+', '_', gpu_name)}.json"


def default_table_path(gpu_name: str) -> Path:
    """Where `fdserve tune --moe` writes: `$FDSERVE_CACHE_DIR` (default ~/.cache/fdserve)."""
    return cache_root() / table_file_name(gpu_name)


def find_table_path(gpu_name: str) -> Path:
    """This machine's own table if it has one, else the one shipped for this GPU model."""
    own, shipped = default_table_path(gpu_name), Path(__file__).resolve().parent / table_file_name(gpu_name)
    return shipped if not own.is_file() and shipped.is_file() else own


@functools.cache
def _device_table(device_index: int) -> MoeTable | None:
    """The table for the GPU at `device_index`, looked up once (a MoE layer asks on every eager step)."""
    path = find_table_path(torch.cuda.get_device_name(device_index))
    if not path.is_file():
        return None
    try:
        return MoeTable.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"MoE table {path} is unreadable ({exc}); delete it or re-run `fdserve tune --moe`") from None


def moe_config(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
               device: torch.device, dtype: torch.dtype = torch.bfloat16) -> MoeConfig:
    """The config a `fused_moe` call of this shape launches with on `device`."""
    if device.type != "cuda":
        return default_config(num_tokens, num_experts, top_k, "cpu", dtype.itemsize)
    table = _device_table(torch.cuda.current_device() if device.index is None else device.index)
    if table is not None and table.dtype == str(dtype).removeprefix("torch."):
        found = table.lookup((num_experts, top_k, hidden, inter), num_tokens)
        if found is not None:
            return found
    return default_config(num_tokens, num_experts, top_k, detect_vendor(), dtype.itemsize)
