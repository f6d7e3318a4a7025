"""Starting the ranks of a tensor-parallel engine, on one node or several, and watching them.

`[backend] tensor_parallel_size` ranks, `[distributed] nnodes` nodes with the same number of ranks each.
Every node runs `fdserve serve` with its `--node-rank`; that process is the node's first rank and starts
the node's others as child processes (`python -m engine.parallel.worker_main`, the config on stdin). They
meet at `--master-addr:--master-port` (torch.distributed's env:// rendezvous); node 0's first process is
rank 0, which serves HTTP and drives every step.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ConfigError, FdserveConfig
from engine.distributed.group import TensorParallelGroup, init_tensor_parallel
from engine.worker.device import select_device

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0   # a rank asked to stop is killed after this
FAILED_STOP_GRACE_S = 1.0   # after a failure no rank was asked: those left are killed after this


@dataclass(frozen=True)
class RankLayout:
    world_size: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.ranks_per_node


def rank_layout(config: FdserveConfig) -> RankLayout:
    world, dist_cfg = config.backend.tensor_parallel_size, config.distributed
    if world % dist_cfg.nnodes:
        raise ConfigError(f"backend.tensor_parallel_size = {world} does not split over distributed.nnodes = "
                          f"{dist_cfg.nnodes}: every node runs the same number of ranks")
    if dist_cfg.node_rank >= dist_cfg.nnodes:
        raise ConfigError(f"distributed.node_rank = {dist_cfg.node_rank} is not below distributed.nnodes = "
                          f"{dist_cfg.nnodes}")
    port = dist_cfg.master_port
    if port == 0:
        if dist_cfg.nnodes > 1:
            raise ConfigError("distributed.master_port (--master-port): every node must be given the same port")
        port = _free_port(dist_cfg.master_addr)
    return RankLayout(world, dist_cfg.nnodes, dist_cfg.node_rank, dist_cfg.master_addr, port)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_device(config: FdserveConfig, local_rank: int) -> torch.device:
    device, _ = select_device(config.backend.gpu_vendor)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def cpu_threads_per_rank(layout: RankLayout) -> int:
    """The node's cores shared among its ranks (more threads than cores slow every rank)."""
    return max(1, (os.cpu_count() or 1) // layout.ranks_per_node)


def join_group(config: FdserveConfig, layout: RankLayout, local_rank: int) -> TensorParallelGroup:
    os.environ["MASTER_ADDR"] = layout.master_addr
    os.environ["MASTER_PORT"] = str(layout.master_port)
    return init_tensor_parallel(layout.first_rank + local_rank, layout.world_size, local_rank,
                                rank_device(config, local_rank), config.distributed.timeout_s,
                                config.distributed.startup_timeout_s)


class LocalRanks:
    """The rank processes this node started (all of its ranks but the first)."""

    def __init__(self, procs: dict[int, subprocess.Popen[bytes]]) -> None:
        self.procs = procs

    def exited(self) -> str | None:
        """A line naming each rank that has exited, or None while all run."""
        gone = [(rank, proc.returncode) for rank, proc in self.procs.items() if proc.poll() is not None]
        if not gone:
            return None
        return "; ".join(f"rank {rank} exited with status {code}" for rank, code in gone)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Wait up to `grace_s` for the ranks to exit (after a Stop message), then kill what is left."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_local_ranks(config: FdserveConfig, layout: RankLayout, model_dir: Path) -> LocalRanks:
    """Start local ranks 1 .. ranks_per_node - 1 of this node."""
    env = {**os.environ, "MASTER_ADDR": layout.master_addr, "MASTER_PORT": str(layout.master_port)}
    payload = config.model_dump_json().encode()
    procs: dict[int, subprocess.Popen[bytes]] = {}
    for local_rank in range(1, layout.ranks_per_node):
        rank = layout.first_rank + local_rank
        cmd = [sys.executable, "-m", "engine.parallel.worker_main", "--rank", str(rank),
               "--world-size", str(layout.world_size), "--local-rank", str(local_rank),
               "--model-dir", str(model_dir), "--cpu-threads", str(cpu_threads_per_rank(layout))]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
        assert proc.stdin is not None
        proc.stdin.write(payload)
        proc.stdin.close()
        procs[rank] = proc
    logger.info("tensor parallelism: started ranks %s of %d on this node (rendezvous %s:%d)",
                sorted(procs), layout.world_size, layout.master_addr, layout.master_port)
    return LocalRanks(procs)
