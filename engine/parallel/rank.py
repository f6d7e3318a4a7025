"""A rank other than 0: join the group, build this rank's `Worker`, follow rank 0's steps until it stops."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.config import FdserveConfig
from engine.distributed.group import destroy_tensor_parallel, init_tensor_parallel
from engine.model.context_len import resolve_context_len
from engine.model.loader import resolve_model_dir
from engine.parallel.launch import cpu_threads_per_rank, join_group, rank_device, rank_layout, start_local_ranks
from engine.parallel.worker_loop import RankLoop
from engine.worker.worker import Worker

logger = logging.getLogger(__name__)


def serve_rank(config: FdserveConfig, model_dir: Path, rank: int, world_size: int, local_rank: int,
               cpu_threads: int | None) -> None:
    """A rank its node's first process started (MASTER_ADDR / MASTER_PORT in the environment)."""
    init_tensor_parallel(rank, world_size, local_rank, rank_device(config, local_rank),
                         config.distributed.timeout_s, config.distributed.startup_timeout_s)
    try:
        _follow(config, model_dir, local_rank, cpu_threads)
    finally:
        destroy_tensor_parallel()


def serve_node(config: FdserveConfig) -> int:
    """`fdserve serve --node-rank K` for K > 0: this node's ranks, no HTTP; 0 once rank 0 stops them."""
    layout = rank_layout(config)
    model_dir = resolve_model_dir(config.model.name)
    ranks = start_local_ranks(config, layout, model_dir)
    try:
        join_group(config, layout, local_rank=0)
        _follow(config, model_dir, 0, cpu_threads_per_rank(layout))
    except Exception:  # noqa: BLE001 - reported by the exit status
        logger.exception("node %d: rank %d stopped on an error", layout.node_rank, layout.first_rank)
        return 1
    finally:
        destroy_tensor_parallel()
        ranks.stop()
    return 0


def _follow(config: FdserveConfig, model_dir: Path, local_rank: int, cpu_threads: int | None) -> None:
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(config.model.seed)
    worker = Worker(config, model_dir, hf_config, resolve_context_len(config.model, hf_config),
                    local_rank=local_rank, cpu_threads=cpu_threads)
    RankLoop(worker.runner).run()
