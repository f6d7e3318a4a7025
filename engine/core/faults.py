"""What an exception inside a step means: one request's fault, or the end of the engine.

A step that raises is retried on parts of its batch to find the request it belongs to
(engine/core/step_isolation.py); that request ends with an error and the others go on. Some
failures leave nothing to retry: a device error (the CUDA or HIP context is unusable after
one), and running out of memory with a single sequence in the step, which the KV cache's
sizing (a profiling forward of a full step) rules out on a healthy device. Those raise
`EngineUnrecoverable`, which stops the engine so the server can exit and be restarted.
"""
from __future__ import annotations

import torch

from engine.distributed.group import RankFailure

# Failure stages, the `stage` label of fdserve_request_internal_errors in /metrics.
STAGE_FORWARD = "forward"
STAGE_SAMPLING = "sampling"
STAGE_OUTPUT = "output"            # turning tokens into text, stop checks
STAGE_NO_TOKEN = "no_admissible_token"
STAGE_ENGINE_STOPPED = "engine_stopped"

# Substrings of the RuntimeError messages torch raises for device faults (torch >= 2.8 raises
# torch.AcceleratorError for most of them; older releases and some libraries raise RuntimeError).
_DEVICE_ERROR_MARKERS = ("CUDA error", "HIP error", "hipError", "device-side assert", "CUBLAS_STATUS",
                         "CUDNN_STATUS", "illegal memory access", "NCCL error", "misaligned address")
_MESSAGE_LIMIT = 300


class EngineUnrecoverable(RuntimeError):
    """The engine cannot continue; `reason` is a short label (/metrics, the exit log line)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def describe(exc: BaseException) -> str:
    """One line for a client and the log: the exception's type and (shortened) message."""
    text = " ".join(str(exc).split())
    if len(text) > _MESSAGE_LIMIT:
        text = text[:_MESSAGE_LIMIT] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def is_device_error(exc: BaseException) -> bool:
    accelerator_error = getattr(torch, "AcceleratorError", None)   # torch >= 2.8
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _DEVICE_ERROR_MARKERS)


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))   # the CPU allocator's words


def raise_if_unrecoverable(exc: BaseException, num_rows: int) -> None:
    """Re-raise `exc` as EngineUnrecoverable when retrying parts of the step cannot help."""
    if isinstance(exc, EngineUnrecoverable):
        raise exc
    if isinstance(exc, RankFailure):
        raise EngineUnrecoverable("tensor_parallel_rank_failed", f"tensor parallelism: {describe(exc)}") from exc
    if is_device_error(exc):
        raise EngineUnrecoverable("device_error", f"device error: {describe(exc)}") from exc
    if is_out_of_memory(exc) and num_rows <= 1:
        raise EngineUnrecoverable("out_of_memory", f"out of memory with one sequence in the step: "
                                                   f"{describe(exc)}") from exc
