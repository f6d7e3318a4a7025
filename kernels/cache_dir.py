"""Where fdserve keeps what it derives on this machine (GGUF conversions, synthetic model folders, tuned
kernel tables, compiled CPU kernels)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$FDSERVE_CACHE_DIR`, default `~/.cache/fdserve`."""
    return Path(os.environ.get("FDSERVE_CACHE_DIR") or Path.home() / ".cache" / "fdserve").expanduser()
