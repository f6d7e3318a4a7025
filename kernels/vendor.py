"""GPU vendor detection and the per-vendor launch configurations of our Triton kernels.

A requested vendor that the hardware contradicts is an error, never a silent fallback. The
configs differ because the hardware does: NVIDIA runs 32-wide warps with large shared memory
(deep software pipelines), AMD CDNA runs 64-wide wavefronts with 64 KB of LDS per CU, so its
tiles are smaller, it pipelines less, and it takes `waves_per_eu` / `matrix_instr_nonkdim`.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field

import torch

VENDORS = ("nvidia", "amd", "cpu")


def detect_vendor() -> str:
    """"nvidia" (CUDA build with a GPU), "amd" (ROCm/HIP build with a GPU) or "cpu"."""
    if torch.cuda.is_available():
        return "amd" if getattr(torch.version, "hip", None) else "nvidia"
    return "cpu"


def check_vendor(requested: str) -> str:
    """Resolve `[backend] gpu_vendor`: "auto" detects; a value the hardware contradicts raises.

    "cpu" is always allowed (running on the CPU of a GPU machine is a choice, not a contradiction).
    """
    if requested not in ("auto", *VENDORS):
        raise ValueError(f"gpu_vendor must be one of auto, nvidia, amd, cpu; got {requested!r}")
    found = detect_vendor()
    if requested == "auto" or requested == "cpu" or requested == found:
        return found if requested == "auto" else requested
    hardware = "no GPU" if found == "cpu" else f"an {found.upper()} GPU"
    raise ValueError(f"gpu_vendor = {requested!r} contradicts the hardware: this machine has {hardware}"
                     f" (torch {torch.__version__}); set gpu_vendor = \"auto\" or \"{found}\"")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the paged decode kernels (standard, flash and fdpp share it)."""

    # Defaults chosen by the H200 launch-config sweeps in bench/RESULTS.md.
    block_n: int = 128         # KV tokens per tile
    num_warps: int = 4
    num_stages: int = 3        # Triton software-pipeline depth of the KV loop
    prefetch: bool = False     # load tile i+1 (and page ids of i+2) in registers during tile i
    page_window: int = 0       # >0: page ids of this many pages held in registers per window
    ctas_per_sm: int = 0       # CTAs per SM the split heuristic fills; 0 = the compiled kernel's occupancy
    min_chunk: int = 128       # fewest KV tokens a split is given (bounds partial traffic)
    max_splits: int = 128      # cap on splits per sequence (kernels.attention.decode_host.MAX_SPLITS at most)
    merge_warps: int = 4
    tma: bool = False          # whole tiles as TMA bulk copies of a page's rows (compute 9.0+, tiles within pages)
    extra: dict[str, int] = field(default_factory=dict)   # vendor-only launch options

    def __post_init__(self) -> None:
        if self.page_window and (self.page_window < 2 or self.page_window & (self.page_window - 1)):
            raise ValueError(f"page_window must be 0 or a power of two >= 2; got {self.page_window}")


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of the paged prefill kernel for one head_dim."""

    block_m: int = 64          # query rows per program (tokens x packed heads)
    block_n: int = 64          # KV tokens per tile
    num_warps: int = 4
    num_stages: int = 2
    pack: int = 1              # most query heads of one KV head packed into a tile's rows
    tma: bool = False          # TMA loads where pages hold whole KV tiles (compute capability 9.0+)
    extra: dict[str, int] = field(default_factory=dict)
    # A chunk of at least `prefix_min_rows` new tokens over at least this many cached keys attends them
    # through cuDNN (`kernels.attention.prefix`) before the kernel; 0: the kernel attends every key.
    prefix_min_keys: int = 0
    prefix_min_rows: int = 64
    prefix_key_bucket: int = 2048   # spans end on multiples of this (of block_n): few shapes for cuDNN
    # A shape with more query rows a tile, taken where its grid is still at least `WIDE_MIN_WAVES` of programs
    # per compute unit (`kernels.attention.prefill.launch_shape`); None: this shape for every grid.
    wide: PrefillConfig | None = None


# Wide tiles won at 1.94 programs a SM and lost at 0.97 (H100, bench/RESULTS.md): taken from 1.5 on.
WIDE_MIN_WAVES = 1.5


@dataclass(frozen=True)
class VendorConfigs:
    vendor: str
    decode: DecodeConfig
    prefill: PrefillConfig
    store_warps: int = 4
    prefill_by_head_dim: dict[int, PrefillConfig] = field(default_factory=dict)
    decode_fp8: DecodeConfig | None = None   # pages of 1-byte codes; None: `decode`
    decode_fp8_tma: DecodeConfig | None = None   # the same where its tiles can be TMA copies; None: `decode_fp8`

    def decode_for(self, kv_dtype: torch.dtype, tma: bool = False) -> DecodeConfig:
        """The flash / standard decode launch shape for pages of `kv_dtype`; `tma`: the GPU has TMA copies
        (`kernels.attention.flash_decoding.decode_config` also asks whether the pages hold its tiles)."""
        if kv_dtype.itemsize == 1 and tma and self.decode_fp8_tma is not None:
            return self.decode_fp8_tma
        if kv_dtype.itemsize == 1 and self.decode_fp8 is not None:
            return self.decode_fp8
        return self.decode

    def prefill_for(self, head_dim: int) -> PrefillConfig:
        """The prefill launch shape for `head_dim` (`prefill` where none is specific)."""
        return self.prefill_by_head_dim.get(head_dim, self.prefill)


def _amd_extra(waves_per_eu: int) -> dict[str, int]:
    return {"waves_per_eu": waves_per_eu, "matrix_instr_nonkdim": 16}


# cuDNN over cached prefixes of 4K+ keys: from there a 2048-token chunk gains or breaks even (bench/RESULTS.md)
_NVIDIA_PREFILL = PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, pack=4, tma=True,
                                prefix_min_keys=4096)

_CONFIGS = {
    # Prefill: the H200 sweep of bench/prefill_kernels.py (bench/RESULTS.md); D=256 keeps its tiles
    # in shared memory with narrower KV tiles (not measured).
    "nvidia": VendorConfigs("nvidia", DecodeConfig(),
                            _NVIDIA_PREFILL,
                            # D=128: twice the rows a tile where the grid still fills the GPU (measured at D=128 only)
                            prefill_by_head_dim={128: dataclasses.replace(_NVIDIA_PREFILL, wide=PrefillConfig(
                                                     block_m=256, block_n=64, num_warps=8, num_stages=3, pack=4,
                                                     tma=True)),
                                                 256: PrefillConfig(block_m=64, block_n=32, pack=4)},
                            # FP8 pages: a tile of 1-byte codes is half the bytes, so many one-warp programs keep
                            # enough loads in flight (the launch sweep of bench/kv_fp8.py, bench/RESULTS.md)
                            decode_fp8=DecodeConfig(block_n=32, num_warps=1, ctas_per_sm=32),
                            # ... and on Hopper, page-row tiles by TMA, six copies in flight, twice the splits
                            decode_fp8_tma=DecodeConfig(block_n=16, num_warps=1, num_stages=6, ctas_per_sm=64,
                                                        tma=True)),
    # CDNA: 64 KB LDS per CU, so one pipeline stage and narrower KV tiles; MFMA 16x16 instructions.
    "amd": VendorConfigs(
        "amd",
        # num_stages=1 leaves no Triton pipelining, so prefetch in registers (not measured on AMD).
        DecodeConfig(block_n=32, num_warps=4, num_stages=1, prefetch=True, ctas_per_sm=2, extra=_amd_extra(1)),
        PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=1, extra=_amd_extra(2)),
    ),
    # The interpreter runs on the CPU: tiles as on NVIDIA, no pipelining to model.
    "cpu": VendorConfigs("cpu", DecodeConfig(block_n=64, num_stages=1),
                         PrefillConfig(block_m=16, block_n=32, num_stages=1)),
}


def check_launch_options(cfg_extra: dict[str, int], device: torch.device) -> None:
    """AMD-only launch options on an NVIDIA GPU are a caller error, not something to drop."""
    if cfg_extra and device.type == "cuda" and detect_vendor() != "amd":
        raise ValueError(f"launch options {sorted(cfg_extra)} are for AMD GPUs; this GPU is {detect_vendor()}")


def vendor_configs(vendor: str) -> VendorConfigs:
    if vendor not in _CONFIGS:
        raise ValueError(f"no kernel configs for vendor {vendor!r}; known: {', '.join(_CONFIGS)}")
    return _CONFIGS[vendor]


def configs_for(device: torch.device) -> VendorConfigs:
    """The configs for the vendor that owns `device` (CPU tensors: the interpreter's)."""
    return vendor_configs(detect_vendor() if device.type == "cuda" else "cpu")


def programmatic_launch(device: torch.device) -> bool:
    """True where a kernel may be launched while its predecessor in the stream still runs (CUDA
    programmatic dependent launch: NVIDIA sm_90 and later, kept through CUDA-graph capture). The
    dependent kernel then runs its prologue early and waits (`griddepcontrol.wait`) for the
    predecessor's results; ROCm and the interpreter have no such launch."""
    return device.type == "cuda" and not interpreting() and _nvidia_sm90_or_later(device.index)


@functools.cache
def _nvidia_sm90_or_later(index: int | None) -> bool:
    """Per device, once: `programmatic_launch` is asked on every FFD decode call (every layer, every step)."""
    return detect_vendor() == "nvidia" and torch.cuda.get_device_capability(index)[0] >= 9


def num_compute_units(device: torch.device) -> int:
    """SMs (NVIDIA) or CUs (AMD); on CPU a nominal 8 so the split heuristic still splits."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8
