"""The interface the engine calls on a model class, beyond nn.Module's own."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from engine.attention.metadata import OutputRows
from engine.model.checkpoint_slice import CheckpointTensor


class CausalLM(nn.Module, ABC):
    """A decoder-only language model: `forward(input_ids [T], positions [T])` gives the hidden
    states [T, H] of a flattened batch, read back into logits with `compute_logits`."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, output_rows: OutputRows | None = None
                ) -> torch.Tensor:
        """Final hidden states [T, H]; with `output_rows`, those rows' alone [N, H] (every row's K/V stored)."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] for hidden states [N, H]."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Copy checkpoint tensors, as (name, tensor or file slice) pairs, into the parameters."""
