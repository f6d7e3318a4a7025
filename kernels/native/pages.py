"""The block tables a native kernel is given, checked first: the kernels read the pages they name unchecked."""
from __future__ import annotations

import torch


def host_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int,
                who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous int32 copies of (block_tables, seq_lens); raises ValueError unless every block id a
    sequence's length reaches lies in [0, num_blocks) and the tables are wide enough."""
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if lens.numel() == 0:
        return tables, lens
    max_len, min_len = int(lens.max()), int(lens.min())
    if max_len > tables.shape[1] * block_size or min_len < 0:
        raise ValueError(f"{who}: seq_lens in [{min_len}, {max_len}] over block tables of {tables.shape[1]} "
                         f"blocks of {block_size}")
    used = torch.arange(tables.shape[1])[None, :] < ((lens + block_size - 1) // block_size)[:, None]
    if bool((((tables < 0) | (tables >= num_blocks)) & used).any()):
        raise ValueError(f"{who}: a block table names a block outside [0, {num_blocks})")
    return tables, lens
