"""A minimal stand-in for the model runner, for tests: paged KV caches, a shuffled block pool,
per-step `AttentionMetadata`, and a forward under `forward_context`.

    driver = PagedModelDriver(model, num_blocks=32, block_size=16)
    logits = driver.step({0: prompt_ids, 1: other_ids})   # prefill both (one mixed batch)
    logits = driver.step({0: [tok], 1: [tok]})            # a decode-only step
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.kv_cache_spec import KVCacheSpec
from engine.attention.layer import Attention, AttentionMetadata, forward_context
from engine.attention.torch_reference import ReferenceBackend


class PagedModelDriver:
    def __init__(self, model: nn.Module, num_blocks: int = 32, block_size: int = 16,
                 backend: AttentionBackend | None = None, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.backend = backend or ReferenceBackend()
        param = next(model.parameters())
        self.device = param.device
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        if not layers:
            raise ValueError("model has no Attention layers")
        generator = torch.Generator().manual_seed(seed)
        pages: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in layers:
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            # Large finite garbage: reading a slot that was never written changes the output
            # visibly (NaN would too, but the reference decode turns 0 * NaN padding into NaN).
            k, v = ((torch.randn(shape, generator=generator) * 100).to(self.device, param.dtype) for _ in range(2))
            pages.append((k, v))
        # One K and one V tensor for all layers, as the model runner allocates them and backends plan for.
        self.k_cache = torch.stack([k for k, _ in pages])
        self.v_cache = torch.stack([v for _, v in pages])
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.k_cache[i], self.v_cache[i]
        first = layers[0]
        spec = KVCacheSpec(len(layers), first.num_heads, first.num_kv_heads, first.head_dim, block_size, param.dtype)
        self.backend.allocate(spec, self.k_cache, self.v_cache)
        # Pages handed out in a shuffled order, so block tables are never 0..n-1.
        self.free_blocks: list[int] = torch.randperm(num_blocks, generator=generator).tolist()
        self.block_tables: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}

    def _slots(self, seq_id: int, num_new: int) -> list[int]:
        table = self.block_tables.setdefault(seq_id, [])
        start = self.num_cached.get(seq_id, 0)
        end = start + num_new
        while len(table) * self.block_size < end:
            if not self.free_blocks:
                raise RuntimeError("PagedModelDriver ran out of KV blocks")
            table.append(self.free_blocks.pop())
        self.num_cached[seq_id] = end
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]

    def build_metadata(self, batch: dict[int, list[int]]) -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata and flat input ids for one step: `batch` maps sequence id -> its new tokens."""
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        for seq_id, tokens in batch.items():
            first = self.num_cached.get(seq_id, 0)
            positions += range(first, first + len(tokens))
            slots += self._slots(seq_id, len(tokens))
            starts.append(starts[-1] + len(tokens))
        width = max(len(self.block_tables[s]) for s in batch)
        tables = [self.block_tables[s] + [0] * (width - len(self.block_tables[s])) for s in batch]
        query_lens = [len(t) for t in batch.values()]

        def tensor(values: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        metadata = AttentionMetadata(
            positions=tensor(positions, torch.long), slot_mapping=tensor(slots, torch.long),
            query_start_loc=tensor(starts), seq_lens=tensor([self.num_cached[s] for s in batch]),
            block_tables=tensor(tables), max_query_len=max(query_lens),
            is_decode_only=all(n == 1 for n in query_lens),
            seq_lens_host=tuple(self.num_cached[s] for s in batch), query_start_loc_host=tuple(starts))
        metadata.plan = self.backend.plan(metadata.step_shape)
        input_ids = tensor([t for tokens in batch.values() for t in tokens], torch.long)
        return metadata, input_ids

    @torch.inference_mode()
    def step(self, batch: dict[int, list[int]]) -> torch.Tensor:
        """Run one forward over all new tokens of `batch`; float32 logits[T, V] in batch order."""
        metadata, input_ids = self.build_metadata(batch)
        with forward_context(metadata, self.backend):
            hidden = self.model(input_ids, metadata.positions)
        return self.model.compute_logits(hidden)
