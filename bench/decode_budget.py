"""The shortest decode phase worth timing, shared by the engine and the HTTP benchmarks."""
from __future__ import annotations

# Below this many generated tokens the decode phase is too short to time (a steady measurement wants >= 512).
MIN_DECODE_TOKENS = 16


def decode_warnings(max_tokens: int) -> list[str]:
    """One warning when `max_tokens` leaves too few decode steps to measure per-token latency."""
    if max_tokens >= MIN_DECODE_TOKENS:
        return []
    return [f"max_tokens={max_tokens} is below {MIN_DECODE_TOKENS}: too few decode steps to measure "
            f"per-token latency (the numbers are mostly prefill); use --max-tokens {MIN_DECODE_TOKENS} or more "
            f"(512 gives a steady measurement)"]
