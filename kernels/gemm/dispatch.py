"""Adaptive matmul (FlashDecoding++ idea iii): per (M, N, K), GEMV, flat GEMM or cuBLAS.

The choice comes from a crossover table measured on this GPU by `fdserve tune` and stored as JSON
(one file per GPU name); without one, a table measured on the same GPU model and shipped in this
package (`kernels/gemm/matmul_table-<gpu>.json`, Llama-3.1-8B shapes) is used. Between two measured M
the kernel is used only when both neighbours chose a kernel (and with the larger neighbour's config);
anything unmeasured, M > MAX_DECODE_M, another GPU's or dtype's table, or no table at all means
cuBLAS (`F.linear`), and `describe()` says which, so the startup log always shows what runs. Under
CUDA graphs the lookup happens at capture time.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels.cache_dir import cache_root
from kernels.gemm.matmul import GEMV_MAX_M, MatmulConfig, flat_gemm, gemv

IMPLS = ("gemv", "flat", "cublas")
MAX_DECODE_M = 256      # prefill-sized products always stay on cuBLAS
TABLE_VERSION = 1


@dataclass(frozen=True)
class Choice:
    impl: str
    config: MatmulConfig | None = None

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"unknown matmul implementation {self.impl!r}; known: {', '.join(IMPLS)}")
        if (self.impl == "cublas") != (self.config is None):
            raise ValueError(f"{self.impl}: a kernel choice needs a config and cuBLAS takes none")


CUBLAS = Choice("cublas")


@dataclass
class MatmulTable:
    """Best implementation per (K, N) and measured M. `timings` (µs per impl) is kept for the record."""

    gpu: str
    dtype: str                       # torch dtype name, e.g. "bfloat16"
    double_buffer: bool              # what the kernels were timed with
    choices: dict[tuple[int, int], dict[int, Choice]] = field(default_factory=dict)
    names: dict[tuple[int, int], str] = field(default_factory=dict)
    timings: dict[tuple[int, int], dict[int, dict[str, float]]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        shapes = []
        for (k, n), per_m in sorted(self.choices.items()):
            rows = {str(m): {"impl": c.impl, "config": c.config.to_dict() if c.config else None,
                             "us": self.timings.get((k, n), {}).get(m, {})}
                    for m, c in sorted(per_m.items())}
            shapes.append({"name": self.names.get((k, n), ""), "K": k, "N": n, "m": rows})
        return {"version": TABLE_VERSION, "gpu": self.gpu, "dtype": self.dtype,
                "double_buffer": self.double_buffer, **self.meta, "shapes": shapes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MatmulTable:
        if data.get("version") != TABLE_VERSION:
            raise ValueError(f"table version {data.get('version')!r}, this fdserve reads {TABLE_VERSION}")
        meta = {k: v for k, v in data.items() if k not in ("version", "gpu", "dtype", "double_buffer", "shapes")}
        table = cls(str(data["gpu"]), str(data["dtype"]), bool(data["double_buffer"]), meta=meta)
        for shape in data["shapes"]:
            key = (int(shape["K"]), int(shape["N"]))
            table.names[key] = str(shape.get("name", ""))
            for m, row in shape["m"].items():
                cfg = MatmulConfig.from_dict(row["config"]) if row.get("config") else None
                table.choices.setdefault(key, {})[int(m)] = Choice(row["impl"], cfg)
                table.timings.setdefault(key, {})[int(m)] = {i: float(t) for i, t in row.get("us", {}).items()}
        return table


def default_table_path(gpu_name: str) -> Path:
    """`$FDSERVE_CACHE_DIR` (default ~/.cache/fdserve) / matmul_table-<gpu name>.json."""
    return cache_root() / f"matmul_table-{re.sub(r'[^A-Za-z0-9._-]+', '_', gpu_name)}.json"


def shipped_table_path(gpu_name: str) -> Path:
    """The table measured for this GPU model that ships with fdserve (it may not exist)."""
    return Path(__file__).resolve().parent / default_table_path(gpu_name).name


def find_table_path(gpu_name: str) -> Path:
    """This machine's own table (`fdserve tune`) if it has one, else the shipped one for this GPU
    model if there is one, else the path `fdserve tune` would write (absent: cuBLAS everywhere)."""
    own, shipped = default_table_path(gpu_name), shipped_table_path(gpu_name)
    return shipped if not own.is_file() and shipped.is_file() else own


def load_table(path: Path) -> MatmulTable | None:
    """The table at `path`, None when there is none; a damaged file is an error naming the fix."""
    if not path.is_file():
        return None
    try:
        return MatmulTable.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"matmul table {path} is unreadable ({exc}); delete it or re-run `fdserve tune`") from None


class AdaptiveMatmul:
    """Callable like `F.linear(x, weight, bias)`; routes each product per the table."""

    def __init__(self, table: MatmulTable | None, *, gpu: str, dtype: torch.dtype, double_buffer: bool,
                 source: str) -> None:
        self.gpu = gpu
        self.dtype = dtype
        self.double_buffer = double_buffer
        self.source = source
        self.problem = self._check(table)
        self.table = None if self.problem else table
        self._cache: dict[tuple[int, int, int], Choice] = {}

    @classmethod
    def from_file(cls, gpu: str, dtype: torch.dtype, *, double_buffer: bool,
                  path: str | Path | None = None) -> AdaptiveMatmul:
        table_path = Path(path) if path else find_table_path(gpu)
        return cls(load_table(table_path), gpu=gpu, dtype=dtype, double_buffer=double_buffer,
                   source=str(table_path))

    def _check(self, table: MatmulTable | None) -> str | None:
        """Why the table cannot be used here (None: it can)."""
        if table is None:
            return f"no matmul table at {self.source}"
        if table.gpu != self.gpu:
            return f"the table at {self.source} was measured on {table.gpu!r}, not this {self.gpu!r}"
        if table.dtype != str(self.dtype).removeprefix("torch."):
            return f"the table at {self.source} was measured in {table.dtype}, the model runs {self.dtype}"
        return None

    def choose(self, m: int, n: int, k: int) -> Choice:
        key = (m, n, k)
        if key not in self._cache:
            self._cache[key] = self._lookup(m, n, k)
        return self._cache[key]

    def _lookup(self, m: int, n: int, k: int) -> Choice:
        per_m = self.table.choices.get((k, n)) if self.table else None
        if not per_m or not 1 <= m <= MAX_DECODE_M:
            return CUBLAS
        above = [x for x in per_m if x >= m]
        below = [x for x in per_m if x <= m]
        if not above:
            return CUBLAS
        hi = per_m[min(above)]
        if hi.impl == "cublas" or (below and per_m[max(below)].impl == "cublas"):
            return CUBLAS
        if hi.impl == "gemv" and m > GEMV_MAX_M:   # a hand-edited table; never launch an invalid GEMV
            return CUBLAS
        return hi

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = weight.shape
        if x.dtype != self.dtype or weight.dtype != self.dtype or x.shape[-1] != k:
            return F.linear(x, weight, bias)   # e.g. float32 heads: not what the table measured
        choice = self.choose(x.numel() // k if k else 0, n, k)
        if choice.impl == "cublas":
            return F.linear(x, weight, bias)
        kernel = gemv if choice.impl == "gemv" else flat_gemm
        return kernel(x, weight, bias, config=choice.config, double_buffer=self.double_buffer)

    def describe(self, shapes: dict[str, tuple[int, int]] | None = None) -> str:
        """One line for the startup log: the source and, per (K, N) shape, which path runs at which M."""
        if self.table is None:
            return (f"adaptive matmul: {self.problem} for {self.gpu}: cuBLAS (F.linear) for every linear "
                    f"layer; run `fdserve tune` on this GPU to measure the GEMV/flat-GEMM crossovers")
        shipped = Path(self.source) == shipped_table_path(self.gpu)
        head = (f"adaptive matmul: {'the table shipped for this GPU, ' if shipped else 'table '}{self.source} "
                f"({self.table.gpu}, {self.table.dtype}, double_buffer {'on' if self.double_buffer else 'off'}")
        if self.double_buffer != self.table.double_buffer:
            head += f"; NOTE tuned with double_buffer {'on' if self.table.double_buffer else 'off'}, " \
                    "crossovers may differ"
        if shapes is None:
            shapes = {self.table.names.get(key) or f"{key[0]}x{key[1]}": key for key in self.table.choices}
        parts = [f"{name} {k}->{n}: {self.ranges(n, k)}" for name, (k, n) in shapes.items()]
        tail = "; `fdserve tune` measures this machine's own" if shipped else ""
        return head + "); " + "; ".join(parts) + tail

    def ranges(self, n: int, k: int) -> str:
        """E.g. "gemv M<=2, flat M<=16, cublas M>16"; M > MAX_DECODE_M is always cuBLAS."""
        runs: list[tuple[str, int]] = []
        for m in range(1, MAX_DECODE_M + 1):
            impl = self.choose(m, n, k).impl
            if runs and runs[-1][0] == impl:
                runs[-1] = (impl, m)
            else:
                runs.append((impl, m))
        if runs[-1][0] != "cublas":
            runs.append(("cublas", MAX_DECODE_M + 1))
        parts = [f"{impl} M<={last}" for impl, last in runs[:-1]]   # the last run is always cuBLAS
        parts.append(f"cublas M>{runs[-2][1]}" if len(runs) > 1 else "cublas all M")
        return ", ".join(parts)
