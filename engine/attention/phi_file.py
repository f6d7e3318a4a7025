"""The per-layer φ file FlashDecoding++ reads (`[flashdecoding] calibration_file`, written by
`fdserve calibrate`): its format version and its reader."""
from __future__ import annotations

import json
import math
from pathlib import Path

FORMAT_VERSION = 1


def load_phi(path: str | Path) -> list[float]:
    """The per-layer φ list of a calibration file; a malformed file is an error naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the φ calibration file {path}: {exc}") from exc
    phi = data.get("phi") if isinstance(data, dict) else None
    if not isinstance(phi, list) or data.get("version") != FORMAT_VERSION or not phi \
            or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in phi):
        raise ValueError(f"{path} is not a version-{FORMAT_VERSION} φ calibration file with a finite "
                         "'phi' list (re-run `fdserve calibrate`)")
    return [float(x) for x in phi]
