"""C++ kernels shipped as source, compiled once per machine with the system compiler and loaded by ctypes.

A library is built with `-O3 -march=native -fopenmp` (the instruction set of the CPU it runs on) into
`$FDSERVE_CACHE_DIR/native/` (default ~/.cache/fdserve), keyed by the source, the compiler's version,
the flags and the CPU, so a later start loads it in milliseconds. OpenMP resolves to the runtime torch
already loaded (the same `libgomp.so.1`), so its threads are torch's. No torch headers: the kernels take
raw pointers, which keeps a build to about a second.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from kernels.cache_dir import cache_root

FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")


class NativeBuildError(RuntimeError):
    """No compiler, or the source did not build on this machine (the message has the compiler's output)."""


def compiler() -> str:
    """`$CXX`, else the first of c++ / g++ / clang++ on PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise NativeBuildError("no C++ compiler found (set CXX, or install g++ or clang++)")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags where the OS reports them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(keep))) or platform.machine()


def _cache_dir() -> Path:
    return cache_root() / "native"


@cache
def _compiler_identity() -> tuple[str, str]:
    """(compiler, its --version text), asked once per process."""
    cxx = compiler()
    return cxx, subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout


def build(source: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared library compiled from `source` with `flags` (cached; built if missing). The headers
    beside the source are part of the cache key."""
    cxx, version = _compiler_identity()
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, cxx, version, *flags,
                                    _cpu_signature()]).encode())
    target = _cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([cxx, *flags, f"-I{source.parent}", str(source), "-o", str(built)],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NativeBuildError(f"{cxx} failed to build {source.name}:\n{result.stderr.strip()}")
        built.replace(target)   # atomic: a concurrent build leaves one whole library
    return target


@cache
def load(name: str, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The library built from this package's `<name>.cpp` (raises `NativeBuildError`)."""
    return ctypes.CDLL(str(build(Path(__file__).resolve().parent / f"{name}.cpp", flags)))
