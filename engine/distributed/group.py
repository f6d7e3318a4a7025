"""The tensor-parallel process group: rank, size and the collectives the layers and the step messages run.

Every rank is one process (engine/parallel/ starts them). `init_tensor_parallel` joins the group through
torch.distributed's env:// rendezvous (MASTER_ADDR and MASTER_PORT; rank and world size passed in): NCCL
(RCCL on ROCm) for the forward's tensors on GPUs, gloo on the CPU, and beside it a gloo group for the host
messages that start each step, so that they never wait behind device work. Until it is called (one
process, `tensor_parallel_size = 1`) every collective here is the identity.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """Another rank died, hung past the group's timeout, or fell out of step: the group cannot go on."""


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    local_rank: int                  # index among this node's ranks (its GPU)
    device_group: dist.ProcessGroup  # the forward's all-reduces and gathers
    cpu_group: dist.ProcessGroup     # gloo: pickled step messages, heartbeats, agreement on sizes
    timeout_s: float                 # a collective waiting longer than this raises


_group: TensorParallelGroup | None = None


def init_tensor_parallel(rank: int, world_size: int, local_rank: int, device: torch.device,
                         timeout_s: float, startup_timeout_s: float) -> TensorParallelGroup:
    """Join the group: the rendezvous waits up to `startup_timeout_s` for every rank; afterwards any one
    collective waits at most `timeout_s`."""
    global _group
    if _group is not None:
        raise RuntimeError("this process already belongs to a tensor-parallel group")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=startup_timeout_s),
                            device_id=device if device.type == "cuda" else None)
    timeout = timedelta(seconds=timeout_s)
    device_group = dist.new_group(backend=backend, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    _group = TensorParallelGroup(rank, world_size, local_rank, device_group, cpu_group, timeout_s)
    logger.info("tensor-parallel rank %d of %d joined (%s on %s)", rank, world_size, backend, device)
    return _group


def destroy_tensor_parallel() -> None:
    global _group
    if _group is None:
        return
    _group = None
    if dist.is_initialized():
        dist.destroy_process_group()


def current_group() -> TensorParallelGroup | None:
    return _group


def tp_rank_and_size() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside a group."""
    return (0, 1) if _group is None else (_group.rank, _group.world_size)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks, in place."""
    if _group is not None:
        dist.all_reduce(x, group=_group.device_group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order."""
    if _group is None:
        return x
    x = x.contiguous()
    parts = torch.empty((_group.world_size, *x.shape), dtype=x.dtype, device=x.device)
    if x.is_cuda:   # one NCCL call, capturable in a CUDA graph
        dist.all_gather_into_tensor(parts, x, group=_group.device_group)
    else:
        dist.all_gather(list(parts.unbind(0)), x, group=_group.device_group)
    return torch.cat(parts.unbind(0), dim=dim)


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` into every rank's `x` (same shape and dtype on each), in place."""
    if _group is not None:
        dist.broadcast(x, src=0, group=_group.device_group)
    return x


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` (pickled) on every rank; the others pass None."""
    assert _group is not None, "broadcast_object needs a tensor-parallel group"
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_group.cpu_group)
    return box[0]


def sum_over_ranks(value: int) -> int:
    """Σ value over ranks (host ints, on the gloo group)."""
    if _group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, group=_group.cpu_group)
    return int(t.item())


def min_over_ranks(value: int) -> int:
    """min value over ranks (e.g. the KV blocks every rank has room for)."""
    if _group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_group.cpu_group)
    return int(t.item())


def wait_for_all_ranks(timeout_s: float) -> None:
    """Return once every rank has reached this point; raise naming the ranks that did not in `timeout_s`
    (model loading may take longer than one collective's timeout)."""
    if _group is not None:
        dist.monitored_barrier(group=_group.cpu_group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
