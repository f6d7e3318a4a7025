"""One rank's part of the engine: its device, its shard of the weights, the attention backend, the KV cache
and the model runner. `LLMEngine` holds rank 0's; with tensor parallelism every other rank builds the same
(engine/parallel/worker_loop.py), so construction runs the same collectives in the same order everywhere:
the profiling forward, the agreement on the number of KV blocks, the graph captures.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.attention.backend import AttentionBackend
from engine.config import ConfigError, FdserveConfig
from engine.distributed.group import min_over_ranks, wait_for_all_ranks
from engine.model.cpu_weights import configure_cpu_weights
from engine.model.layers import configure_matmul, linear_shapes
from engine.model.loader import load_model
from engine.model.native_decode import native_decode_for
from engine.worker.device import select_device, select_dtype, select_kv_dtype
from engine.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: FdserveConfig, model_dir: Path, hf_config: PretrainedConfig, max_context_len: int,
                 local_rank: int = 0, cpu_threads: int | None = None) -> None:
        """`local_rank`: this rank's GPU among the node's; `cpu_threads`: torch threads on a CPU (None: torch's
        default, or `[backend] cpu_threads`)."""
        self.config = config
        self.max_context_len = max_context_len
        device, self.vendor = select_device(config.backend.gpu_vendor)
        if device.type == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise ConfigError(f"backend.tensor_parallel_size: rank {local_rank} of this node has no GPU "
                                  f"({torch.cuda.device_count()} visible)")
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        self.device = device
        threads = config.backend.cpu_threads or cpu_threads
        if threads and device.type == "cpu":
            torch.set_num_threads(threads)
        self.dtype = select_dtype(config.model.dtype, device, getattr(hf_config, "torch_dtype", None),
                                  cpu_weight_dtype=config.backend.cpu_weight_dtype)
        self.backend = self._make_backend()
        self.model = load_model(model_dir, self.dtype, device, config.model.rope_scaling, max_context_len)
        # Ranks load at their own pace; the collectives below each wait only `distributed.timeout_s`.
        wait_for_all_ranks(config.distributed.startup_timeout_s)
        self.cpu_weights_text = (configure_cpu_weights(self.model, config.backend.cpu_weight_dtype, self.dtype,
                                                       config.backend.cpu_matmul, config.backend.cpu_product_inputs)
                                 if device.type == "cpu" else "")
        # Decode-phase linears: cuBLAS, or our flat GEMM / GEMV per shape from the tuned table.
        configure_matmul(config.flashdecoding, device, self.dtype, linear_shapes(self.model))
        self.block_size = self.backend.page_size(config.backend.block_size)
        if self.block_size != config.backend.block_size:
            logger.info("kernel = %r: KV pages of %d tokens (backend.block_size = %d applies to the dense kernels)",
                        config.flashdecoding.kernel, self.block_size, config.backend.block_size)
        self.kv_dtype = select_kv_dtype(config.backend.kv_cache_dtype, self.dtype, self.vendor)
        self.runner = ModelRunner(self.model, device, self.dtype, self.block_size, self.backend, self.kv_dtype)
        self.num_blocks = self._num_kv_blocks()
        self.runner.allocate_kv_cache(self.num_blocks)
        self.graphs_text = self._capture_graphs()

    def _make_backend(self) -> AttentionBackend:
        from engine.attention.select import make_attention_backend
        limits = self.config.backend
        return make_attention_backend(self.config.flashdecoding, self.device, self.vendor,
                                      max_num_seqs=limits.max_num_seqs,
                                      max_num_batched_tokens=limits.max_num_batched_tokens,
                                      cpu_attention=limits.cpu_attention, kv_cache_dtype=limits.kv_cache_dtype,
                                      prefill_prefix=limits.prefill_prefix)

    def _capture_graphs(self) -> str:
        """How decode steps run, for the startup log: CUDA graphs on a GPU; on a CPU the C++ decode stack where
        the model allows it (engine/model/native_decode.py)."""
        backend = self.config.backend
        if self.device.type == "cpu":
            assert self.runner.k_cache is not None and self.runner.v_cache is not None
            self.runner.native_decode, text = native_decode_for(self.model, self.backend, self.runner.k_cache,
                                                                self.runner.v_cache)
            return text
        if not backend.cuda_graphs:
            return "eager (backend.cuda_graphs = false)"
        max_batch = min(backend.cuda_graph_max_batch, backend.max_num_seqs)
        self.runner.capture_decode_graphs(max_batch, self.max_context_len)
        return f"CUDA graphs for batch sizes up to {max_batch}, eager above and for prefill"

    def _num_kv_blocks(self) -> int:
        backend = self.config.backend
        if backend.num_kv_blocks:
            return backend.num_kv_blocks
        if self.device.type == "cuda":
            # kv_cache_ratio of what is free once the weights are in and a full step's
            # activations (measured by a profiling forward) are set aside.
            peak = self.runner.profile_peak_bytes(backend.max_num_batched_tokens)
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int((free - peak) * backend.kv_cache_ratio)
        else:
            budget = int(backend.cpu_kv_cache_bytes * backend.kv_cache_ratio)
        # More than every running sequence at full context could ever use is wasted memory.
        useful = backend.max_num_seqs * -(-self.max_context_len // backend.block_size)
        # Every rank holds the same pages (of its own heads): as many as the fullest rank has room for.
        num_blocks = min_over_ranks(min(self.runner.num_blocks_for_budget(budget), useful))
        if num_blocks < 2:
            raise ConfigError("backend.kv_cache_ratio / cpu_kv_cache_bytes leave no room for the KV cache "
                              f"({budget} bytes); raise them or set backend.num_kv_blocks")
        return num_blocks
