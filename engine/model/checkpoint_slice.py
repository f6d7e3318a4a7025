"""A checkpoint tensor read lazily: a rank copies only its shard (`narrow`), so under tensor parallelism
each rank reads its slices of the safetensors files and not the whole model."""
from __future__ import annotations

from typing import Any

import torch

# safetensors dtype names -> bytes per element (for the loading progress)
_ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class CheckpointSlice:
    """One tensor of an open safetensors file (`safe_open(...).get_slice(name)`)."""

    def __init__(self, lazy: Any) -> None:
        self._lazy = lazy
        self.shape = torch.Size(lazy.get_shape())
        self.nbytes = self.shape.numel() * _ITEM_BYTES.get(lazy.get_dtype(), 2)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows start .. start + length of dimension `dim`, read from the file (only those)."""
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._lazy[index]

    def read(self) -> torch.Tensor:
        return self._lazy[:]


# What a parameter's weight_loader receives: a tensor in memory (GGUF conversion, tests) or a slice of a file.
CheckpointTensor = torch.Tensor | CheckpointSlice


def in_memory(t: CheckpointTensor) -> torch.Tensor:
    return t.read() if isinstance(t, CheckpointSlice) else t
