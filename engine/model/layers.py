"""Model building blocks: RMSNorm, rotary embedding, SiLU-and-mul, tensor-parallel linear layers.

Tensor parallelism follows Megatron/vLLM: column-parallel layers split their output features
across ranks, row-parallel layers split their input features and all-reduce the partial sums,
the embedding and LM head split the vocabulary. Each parameter carries a `weight_loader` that
copies this rank's slice of a full checkpoint tensor (or of one shard of a fused tensor), so
a rank builds its shard from `get_tp_rank_and_size()`, the process group's rank and size.

Every linear product goes through `linear`, whose implementation `configure_matmul` picks once at
startup: `F.linear`, or on a GPU with `[flashdecoding] adaptive_matmul` the per-shape dispatcher of
`kernels.gemm.dispatch` (GEMV / flat GEMM / cuBLAS for decode-sized M).
"""
from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.layer import step_is_decode_only
from engine.distributed.group import all_gather, all_reduce, tp_rank_and_size
from engine.model.checkpoint_slice import CheckpointTensor, in_memory
from engine.model.rope import cos_sin_tables
from kernels import fused
from kernels.attention.reference import store_kv_ref
from kernels.native import rms_norm as native_rms_norm
from kernels.native import rope_store as native_rope

if TYPE_CHECKING:
    from engine.config import FlashDecodingConfig

WeightLoader = Callable[..., None]
logger = logging.getLogger(__name__)

_matmul: Callable[..., torch.Tensor] = F.linear   # set by configure_matmul


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x·Wᵀ (+ b) for every linear layer, through the implementation `configure_matmul` chose."""
    return _matmul(x, weight, bias)


class DecodeWeight(abc.ABC):
    """A second form of one layer's weight for decode-sized products (`engine/model/cpu_weights.py`:
    int4 on the CPU, where a decode step is a read of every weight)."""

    max_tokens: int   # products with more rows (prefill chunks) use the dense weight

    @abc.abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x·Wᵀ [M, N] in x's dtype."""


class HasWeight(nn.Module):
    """A layer whose `weight` [N, K] multiplies its input; `decode_weight` may stand in for it."""

    weight: nn.Parameter
    decode_weight: DecodeWeight | None = None

    def product(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x·Wᵀ (+ b): `decode_weight` for rows up to its `max_tokens` in a decode-only step, else `linear`.

        Prompt tokens always take the dense weight (prompt logprobs are computed outside any step), so a
        prompt's logits do not depend on how much of it a prefix-cache hit left to compute."""
        decode = self.decode_weight
        if decode is not None and x.dim() == 2 and (_decode_weights_for_every_row or (
                x.shape[0] <= decode.max_tokens and step_is_decode_only() is True)):
            out = decode(x)
            return out if bias is None else out + bias
        return linear(x, self.weight, bias)


_decode_weights_for_every_row = False


@contextlib.contextmanager
def decode_weights_for_every_row() -> Iterator[None]:
    """Every product of a layer with a decode weight runs it, prompt rows included: how a quantized
    decode weight is scored teacher-forced on real text."""
    global _decode_weights_for_every_row
    previous, _decode_weights_for_every_row = _decode_weights_for_every_row, True
    try:
        yield
    finally:
        _decode_weights_for_every_row = previous


def configure_matmul(fd: FlashDecodingConfig, device: torch.device, dtype: torch.dtype,
                     shapes: dict[str, tuple[int, int]] | None = None, table_path: str | None = None) -> str:
    """Choose what `linear` runs from `[flashdecoding]` (fd) and the device; log and return it.

    F.linear unless enable, adaptive_matmul and a GPU all hold; then the dispatcher, which keeps
    cuBLAS for M > 256 and for every shape its measured table (`fdserve tune`) does not cover.
    `shapes` ({name: (K, N)}, see `linear_shapes`) only makes the log line specific.
    """
    global _matmul
    if not fd.enable:
        why = "[flashdecoding] enable = false"
    elif not fd.adaptive_matmul:
        why = "[flashdecoding] adaptive_matmul = false" + (" (double_buffer applies only to the adaptive "
                                                           "kernels)" if fd.double_buffer else "")
    elif device.type != "cuda":
        why = f"the flat-GEMM/GEMV kernels need a GPU, this runs on {device.type}"
    else:
        from kernels.gemm.dispatch import AdaptiveMatmul

        dispatcher = AdaptiveMatmul.from_file(torch.cuda.get_device_name(device), dtype,
                                              double_buffer=fd.double_buffer, path=table_path)
        _matmul = dispatcher
        text = dispatcher.describe(shapes)
        logger.log(logging.WARNING if dispatcher.problem else logging.INFO, "linear layers: %s", text)
        return text
    _matmul = F.linear
    text = f"F.linear for every linear layer: {why}"
    logger.info("linear layers: %s", text)
    return text


def get_tp_rank_and_size() -> tuple[int, int]:
    """(rank, world size) of the tensor-parallel group (engine/distributed/group.py); (0, 1) alone."""
    return tp_rank_and_size()


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return all_reduce(x)


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return all_gather(x, dim)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def check_shape(loaded: CheckpointTensor, expected: tuple[int, ...], name: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} != expected {tuple(expected)}")


def check_and_copy(param: torch.Tensor, loaded: CheckpointTensor, name: str) -> None:
    check_shape(loaded, tuple(param.shape), name)
    with torch.no_grad():
        param.copy_(in_memory(loaded))


def default_weight_loader(param: torch.Tensor, loaded_weight: CheckpointTensor,
                          shard_id: Any = None) -> None:
    """For replicated parameters (norms): the whole tensor, shape checked."""
    if shard_id is not None:
        raise ValueError(f"replicated parameter got shard {shard_id!r}")
    check_and_copy(param, loaded_weight, "replicated parameter")


def new_param(shape: tuple[int, ...], dtype: torch.dtype | None,
               loader: WeightLoader) -> nn.Parameter:
    # Left uninitialised: load_weights checks that every parameter receives checkpoint data.
    param = nn.Parameter(torch.empty(shape, dtype=dtype or torch.get_default_dtype()),
                         requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]  # the loader rides on the parameter itself
    return param


# ---------------------------------------------------------------------------------------------
# Normalisation, activation, rotary embedding
# ---------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32; optionally adds a residual first."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param((hidden_size,), dtype, default_weight_loader)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...
    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if x.is_cuda:   # one fused launch instead of ~8 small ones (kernels/fused.py)
            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps)
            return fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if native_rms_norm.takes(x, self.weight):   # bf16 / float32 rows: one C++ call with the torch form's bits
            lanes = native_rms_norm.torch_order_lanes()
            if lanes is not None:
                return native_rms_norm.rms_norm_rows(x, self.weight, self.eps, residual, lanes=lanes)
        return native_rms_norm.rms_norm_torch(x, self.weight, self.eps, residual)


class SiluAndMul(nn.Module):
    """x[..., 2I] (gate then up) -> silu(gate) * up, [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)   # in place: one [T, I] tensor fewer to allocate and fill


def side_by_side(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """[T, A] and [T, B] that sit next to each other in every row of one tensor (slices of a fused
    projection's output) as one [T, A + B] view of it; None when they do not."""
    if (a.dim() != 2 or b.dim() != 2 or a.dtype != b.dtype or a.shape[0] != b.shape[0] or a.stride() != b.stride()
            or a.stride(1) != 1 or b.data_ptr() != a.data_ptr() + a.shape[1] * a.element_size()):
        return None
    return a.as_strided((a.shape[0], a.shape[1] + b.shape[1]), a.stride())


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, GPT-NeoX layout (rotate halves), as in HF Llama/Qwen.

    The first `rotary_dim` features of each head rotate; cos/sin are precomputed in float32
    for positions [0, max_position) and the rotation runs in float32.
    Scalings (`scaling["rope_type"]`, None = plain RoPE): those of engine/model/rope.py.
    """

    cos_cache: torch.Tensor   # buffers, registered in __init__
    sin_cache: torch.Tensor

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        cos, sin = cos_sin_tables(base, rotary_dim, max_position, scaling)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        # `_step_tables`: (positions, cos, sin, the cos_cache they came from)
        self._tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # the step's (positions, slot_mapping) the C++ RoPE + store has checked (held, so never a stale match)
        self._checked_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x[T, H*D] -> same shape, first rotary_dim features of each head rotated.

        rotate-half as x·cos + roll(x)·sin with cos = [c, c] and sin = [-s, s]: the same products and
        sums as transformers' x·cos + rotate_half(x)·sin, in fewer ops (a decode step runs this for
        every layer)."""
        num_tokens = x.shape[0]
        heads = x.view(num_tokens, -1, self.head_dim)
        rot = heads[..., :self.rotary_dim].float()
        rotated = (rot * cos + rot.roll(self.rotary_dim // 2, dims=-1) * sin).to(x.dtype)
        if self.rotary_dim < self.head_dim:
            rotated = torch.cat((rotated, heads[..., self.rotary_dim:]), dim=-1)
        return rotated.reshape(num_tokens, -1)

    def _step_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, rotary_dim] cos = [c, c] and sin = [-s, s] at `positions`, looked up once per step
        (every layer of a step rotates at the same positions; a copy of them is the cache key)."""
        cached = self._tables
        if (cached is not None and cached[3] is self.cos_cache and cached[0].shape == positions.shape
                and torch.equal(cached[0], positions)):
            return cached[1], cached[2]
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        cos_full = torch.cat((cos, cos), dim=-1)[:, None, :]
        sin_signed = torch.cat((-sin, sin), dim=-1)[:, None, :]
        self._tables = (positions.clone(), cos_full, sin_signed, self.cos_cache)
        return cos_full, sin_signed

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions[T]; q[T, Hq*D], k[T, Hkv*D] -> rotated (q, k)."""
        if q.is_cuda:
            return fused.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache,
                                          self.head_dim, self.rotary_dim)
        cos, sin = self._step_tables(positions)
        both = side_by_side(q, k)
        if both is not None:   # one rotation for both: a decode step runs this in every layer
            rotated = self._rotate(both, cos, sin)
            return rotated[:, :q.shape[1]], rotated[:, q.shape[1]:]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def rotate_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The rotated q; rotated k and v written into the paged caches at slot_mapping (GPU, one
        launch: kernels/fused.py; FP8 caches with their per-head scales). On the CPU one C++ call for
        bf16 or float32 rows and pages (kernels/native/rope_store.py), else the rotation and the store in torch."""
        if not q.is_cuda:
            if k_scale is None and native_rope.takes(q, k, v, k_cache, v_cache, self.cos_cache, self.sin_cache):
                checked = self._checked_rows   # every layer of a step passes the same positions and slots
                if checked is None or checked[0] is not positions or checked[1] is not slot_mapping:
                    native_rope.check_rows(positions, slot_mapping, self.cos_cache.shape[0],
                                           k_cache.shape[0] * k_cache.shape[1])
                    self._checked_rows = (positions, slot_mapping)
                return native_rope.rope_store_rows(positions, q, k, v, self.cos_cache, self.sin_cache, self.head_dim,
                                                   self.rotary_dim, k_cache, v_cache, slot_mapping, rows_checked=True)
            q, k = self(positions, q, k)
            shape = (q.shape[0], -1, self.head_dim)
            store_kv_ref(k.reshape(shape), v.reshape(shape), k_cache, v_cache, slot_mapping, k_scale=k_scale,
                         v_scale=v_scale)
            return q
        return fused.rotary_embedding_and_store(positions, q, k, v, self.cos_cache, self.sin_cache, self.head_dim,
                                                self.rotary_dim, k_cache, v_cache, slot_mapping, k_scale, v_scale)


# ---------------------------------------------------------------------------------------------
# Tensor-parallel linear layers
# ---------------------------------------------------------------------------------------------

class ColumnParallelLinear(HasWeight):
    """y = x W^T + b with W's output rows split across ranks: this rank holds rows
    [rank * out/tp, (rank+1) * out/tp). Output stays sharded unless `gather_output`."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank_and_size()
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = self._partition_size()
        self.gather_output = gather_output
        self.weight = new_param((self.output_size_per_partition, input_size), dtype, self.weight_loader)
        self.bias = (new_param((self.output_size_per_partition,), dtype, self.weight_loader)
                     if bias else None)

    def _partition_size(self) -> int:
        return divide(self.output_size, self.tp_size, "output size")

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointTensor,
                      shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        size = param.shape[0]
        check_shape(loaded_weight, (size * self.tp_size, *param.shape[1:]), type(self).__name__)
        check_and_copy(param, loaded_weight.narrow(0, self.tp_rank * size, size), type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x, self.bias)
        return tensor_parallel_all_gather(out) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate_up_proj).

    Checkpoint shard `i` (size `output_sizes[i]`) is split across ranks like a column-parallel
    weight; this rank's slices sit back to back: [shard0/tp | shard1/tp | ...].
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias, dtype=dtype)

    def _partition_size(self) -> int:
        return sum(divide(s, self.tp_size, "merged output size") for s in self.output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointTensor,
                      shard_id: Any = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear needs a shard index in "
                             f"[0, {len(self.output_sizes)}), got {shard_id!r}")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(s // self.tp_size for s in self.output_sizes[:shard_id])
        check_shape(loaded_weight, (self.output_sizes[shard_id], *param.shape[1:]), f"shard {shard_id}")
        check_and_copy(param.narrow(0, offset, size),
                        loaded_weight.narrow(0, self.tp_rank * size, size), f"shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused. Query heads split across ranks; KV heads split too, or,
    when there are fewer KV heads than ranks, each KV head is replicated on tp/num_kv_heads
    ranks. Layout of this rank's output: [q heads | k heads | v heads]."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, dtype: torch.dtype | None = None) -> None:
        _, tp_size = get_tp_rank_and_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads, "tensor_parallel_size vs KV heads")
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "number of KV heads")
            self.num_kv_head_replicas = 1
        # The size before splitting, counting replicated KV heads once per rank that holds them.
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias=bias, dtype=dtype)

    def _shard_offset_and_size(self, shard_id: str) -> tuple[int, int, int]:
        """(offset in this rank's param, rows per rank, index of this rank's slice in the checkpoint)."""
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        if shard_id == "q":
            return 0, q_size, self.tp_rank
        kv_index = self.tp_rank // self.num_kv_head_replicas
        if shard_id == "k":
            return q_size, kv_size, kv_index
        if shard_id == "v":
            return q_size + kv_size, kv_size, kv_index
        raise ValueError(f"QKVParallelLinear shard must be 'q', 'k' or 'v', got {shard_id!r}")

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointTensor,
                      shard_id: Any = None) -> None:
        offset, size, index = self._shard_offset_and_size(shard_id)
        total_heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        check_shape(loaded_weight, (total_heads * self.head_size, *param.shape[1:]), f"qkv shard {shard_id}")
        check_and_copy(param.narrow(0, offset, size), loaded_weight.narrow(0, index * size, size),
                        f"qkv shard {shard_id}")


class RowParallelLinear(HasWeight):
    """y = x W^T + b with W's input columns split across ranks; x arrives already split (the
    output of a column-parallel layer) and partial products are summed by an all-reduce.
    The bias is added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 reduce_results: bool = True, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank_and_size()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = divide(input_size, self.tp_size, "input size")
        self.reduce_results = reduce_results
        self.weight = new_param((output_size, self.input_size_per_partition), dtype, self.weight_loader)
        self.bias = new_param((output_size,), dtype, default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointTensor,
                      shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear has no shard {shard_id!r}")
        size = param.shape[1]
        check_shape(loaded_weight, (self.output_size, self.input_size), "RowParallelLinear")
        check_and_copy(param, loaded_weight.narrow(1, self.tp_rank * size, size), "RowParallelLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x)
        if self.reduce_results:
            out = tensor_parallel_all_reduce(out)
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(HasWeight):
    """Embedding table split by vocabulary rows. The vocabulary is padded to a multiple of the
    TP size; rank r owns ids [r * per_rank, (r+1) * per_rank). Ids outside this rank's range
    embed to zero and the all-reduce fills them in from their owner."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank_and_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        self.weight = new_param((self.num_embeddings_per_partition, embedding_dim), dtype, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointTensor,
                      shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        check_shape(loaded_weight, (self.num_embeddings, self.embedding_dim), type(self).__name__)
        rows = max(0, self.vocab_end_index - self.vocab_start_index)
        with torch.no_grad():
            param[rows:].zero_()  # padding rows: their logits are cut off, their embeddings unused
        check_and_copy(param[:rows], loaded_weight.narrow(0, self.vocab_start_index, rows),
                        type(self).__name__)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside[:, None], 0.0)
        return tensor_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection hidden -> vocab, split by vocabulary like the embedding (and able
    to share the embedding's weight when the model ties them)."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden[N, H] -> float32 logits[N, vocab]: local matmul, gather over ranks, drop padding."""
        logits = tensor_parallel_all_gather(self.product(hidden))
        return logits[:, :self.num_embeddings].float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is a projection; call compute_logits(hidden)")


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(K, N) of this rank's weight for each kind of linear layer in `model` (qkv_proj, o_proj,
    gate_up_proj, down_proj, a MoE router's gate, lm_head): the products a decode step runs."""
    shapes: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        # Every product with a weight (a MoE router too), but not an embedding lookup.
        if isinstance(module, HasWeight) and (isinstance(module, ParallelLMHead)
                                              or not isinstance(module, VocabParallelEmbedding)):
            n, k = module.weight.shape
            shapes.setdefault(name.rsplit(".", 1)[-1], (int(k), int(n)))
    return shapes
