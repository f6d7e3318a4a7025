"""Opcode counts of the FFD scan's main loop, compiled by Triton for sm_90 without a GPU.

    python -m tests.support.scan_sass DIM GROUP SUM_BY_MMA(0/1)    # prints {"HMMA": n, "LOP3": n, ...} as JSON

Exit 3 (with the reason) where this Triton cannot compile for sm_90 or has no cuobjdump. Used by
tests/kernels/test_ffd_kernels.py in a child process, because the tests run under the Triton interpreter.
"""
from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

from kernels.ffd import decode as ffd
from kernels.ffd.scan import _scan_kernel


def scan_loop_opcodes(dim: int, group: int, sum_by_mma: bool) -> collections.Counter:
    """The scan as `ffd_decode` launches it (8 KV heads, pages of 128, default sinks and window)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _scan_kernel
    bs, tokens_as_m = 128, dim >= ffd.SCAN_TOKENS_AS_M_MIN_DIM
    consts = {"BPP": ffd.SCAN_BLOCKS_PER_STEP, "NUM_PARTS": 4, "PARTS_PAD": 16, "NUM_HEADS": 8 * group,
              "NUM_KV_HEADS": 8, "GROUP": group, "BLOCK_H": 16, "D": dim, "D4": dim // 4, "BS": bs,
              "UPCAST": False, "WRITE_MASK": False, "TOKENS_AS_M": tokens_as_m, "SINK_PARTS": 1,
              "HAS_KMAP": False, "SUM_BY_MMA": sum_by_mma, "PM_SLICE": ffd.PM_SLICE,
              "DECIDE_CHUNK": ffd.DECIDE_CHUNK, "PDL": True,
              "SCAN_N": triton.next_power_of_2(group) if tokens_as_m else 16}
    types = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KMAP": "*i32", "CODES": "*u8", "SCALES": "*fp32",
             "RES": "*fp8e4nv", "BT": "*i32", "SEQ": "*i32", "PM": "*fp32", "BMAX": "*fp32", "FLAGS": "*i32",
             "MASK": "*i8", "SYNC": "*i32", "scale_log2": "fp32", "delta_log2": "fp32"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        sig[name] = "constexpr" if name in consts else types.get(name, "i32")
        if sig[name].startswith("*") or name.startswith("stride") or name == "max_blocks":
            attrs[(i,)] = [["tt.divisibility", 16]]      # what the launcher specializes on
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": ffd.SCAN_WARPS, "num_stages": ffd.SCAN_STAGES})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "scan.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ins = [(int(addr, 16), text.strip()) for addr, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(addr - int(target, 16), int(target, 16), addr) for addr, text in ins
             for target in re.findall(r"\bBRA\b.*?0x([0-9a-f]+)", text) if int(target, 16) < addr]
    _, lo, hi = max(loops)                                # the main loop: the widest backward branch
    ops = (re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for addr, text in ins if lo <= addr <= hi)
    return collections.Counter(ops)


if __name__ == "__main__":
    try:
        counts = scan_loop_opcodes(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1")
    except (ImportError, FileNotFoundError, subprocess.CalledProcessError) as e:
        print(f"no sm_90 compile here: {e}")
        sys.exit(3)
    print(json.dumps(counts))
