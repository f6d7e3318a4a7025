"""A CPU decode step in one C++ call for every decoder layer (`kernels/native/decode_stack.py`), where it applies.

On a CPU a decode step of a small model is mostly dispatch: a few hundred small torch ops a layer, each
from Python. When the model is the plain Llama layer (no biases, no q/k norms, no experts, one rank) in
float32 over float32 or bfloat16 pages, every product has the checkpoint's own block weight (`cpu_weights`:
"auto" on a CPU without fast bf16) and the attention backend decodes with the exact softmax through the C++ paged
kernel, the runner hands a decode step's rows to `NativeDecodeStep` instead of the model's forward: the
same operations, one call. `native_decode_for` says why not otherwise, for the startup log.
"""
from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.dense import DenseBackend
from engine.attention.metadata import AttentionMetadata
from engine.distributed.group import tp_rank_and_size
from engine.model.cpu_weights import BlockDecodeWeight
from engine.model.layers import HasWeight
from engine.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from kernels.native import decode_stack
from kernels.native.block_gemv import BlockWeight
from kernels.native.build import NativeBuildError


class NativeDecodeStep:
    """A decode step's rows (one token each) -> the final norm's hidden states, through the C++ stack."""

    def __init__(self, model: LlamaForCausalLM, stack: decode_stack.DecodeStack) -> None:
        self.embed_tokens = model.model.embed_tokens
        self.stack = stack
        self.max_rows = stack.max_rows

    def takes(self, num_rows: int) -> bool:
        return 1 <= num_rows <= self.max_rows

    def forward(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        tables = metadata.block_tables_host if metadata.block_tables_host is not None else metadata.block_tables
        return self.stack.run(hidden, metadata.positions, metadata.slot_mapping, tables, metadata.seq_lens)


def _block(layer: HasWeight, what: str, int16_inputs: bool) -> BlockWeight:
    weight = layer.decode_weight
    if not isinstance(weight, BlockDecodeWeight):
        raise _NotApplicable(f"{what} has no block decode weight")
    if weight.int16_inputs != int16_inputs:
        raise _NotApplicable(f"{what} rounds its inputs unlike layer 0's qkv_proj")
    return weight.packed


class _NotApplicable(Exception):
    """Why the model's decode steps keep its torch forward."""


def _layer_weights(layer: LlamaDecoderLayer, i: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   int16_inputs: bool) -> decode_stack.StackLayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, LlamaMLP):
        raise _NotApplicable(f"layer {i} is a mixture of experts")
    if attn.qk_norm:
        raise _NotApplicable("q/k norms")
    if any(b is not None for b in (attn.qkv_proj.bias, attn.o_proj.bias, mlp.gate_up_proj.bias, mlp.down_proj.bias)):
        raise _NotApplicable("biases on the projections")
    return decode_stack.StackLayerWeights(
        layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
        _block(attn.qkv_proj, f"layer {i} qkv_proj", int16_inputs),
        _block(attn.o_proj, f"layer {i} o_proj", int16_inputs),
        _block(mlp.gate_up_proj, f"layer {i} gate_up_proj", int16_inputs),
        _block(mlp.down_proj, f"layer {i} down_proj", int16_inputs),
        k_cache, v_cache)


def _build(model: torch.nn.Module, backend: AttentionBackend, k_cache: torch.Tensor, v_cache: torch.Tensor
           ) -> NativeDecodeStep:
    if not isinstance(model, LlamaForCausalLM):
        raise _NotApplicable(f"{type(model).__name__} is not a Llama-family model")
    if tp_rank_and_size()[1] > 1:
        raise _NotApplicable("tensor parallelism")
    if (model.dtype != torch.float32 or k_cache.dtype not in (torch.float32, torch.bfloat16)
            or k_cache.device.type != "cpu"):
        raise _NotApplicable(f"{model.dtype} weights over {k_cache.dtype} pages on {k_cache.device.type} "
                             "(float32 over float32 or bfloat16 pages on a CPU)")
    if not isinstance(backend, DenseBackend) or not backend.cpu_native:
        raise _NotApplicable("the attention backend does not decode through the C++ paged kernel")
    layers = [layer for layer in model.model.layers if isinstance(layer, LlamaDecoderLayer)]
    if not layers or len(layers) != len(model.model.layers):
        raise _NotApplicable("no decoder layers, or layers other than Llama's")
    first = layers[0]
    attn = first.self_attn
    rotary = attn.rotary_emb
    first_weight = attn.qkv_proj.decode_weight
    int16_inputs = isinstance(first_weight, BlockDecodeWeight) and first_weight.int16_inputs
    weights = []
    for i, layer in enumerate(layers):
        if layer.self_attn.rotary_emb is not rotary:
            raise _NotApplicable("rotary tables differ between layers")
        weights.append(_layer_weights(layer, i, k_cache[i], v_cache[i], int16_inputs))
    norm = model.model.norm
    shape = decode_stack.StackShape(
        hidden=first.input_layernorm.weight.shape[0], num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim, rotary_dim=rotary.rotary_dim, intermediate=weights[0].down.in_features,
        eps=first.input_layernorm.eps, attn_scale=attn.attn.scale)
    if any(layer.input_layernorm.eps != shape.eps or layer.post_attention_layernorm.eps != shape.eps
           for layer in layers) or norm.eps != shape.eps:
        raise _NotApplicable("RMSNorm epsilons differ between layers")
    stack = decode_stack.DecodeStack(shape, weights, norm.weight.detach(), rotary.cos_cache, rotary.sin_cache,
                                     int16_inputs=int16_inputs)
    return NativeDecodeStep(model, stack)


def native_decode_for(model: torch.nn.Module, backend: AttentionBackend, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> tuple[NativeDecodeStep | None, str]:
    """The C++ decode step for this model over these pages [layers, blocks, block_size, Hkv, D], or None;
    and what runs, for the startup log."""
    try:
        step = _build(model, backend, k_cache, v_cache)
    except _NotApplicable as why:
        return None, f"eager on cpu: the model's torch forward ({why})"
    except NativeBuildError as err:
        return None, (f"eager on cpu: the model's torch forward (the C++ decode stack does not build: "
                      f"{str(err).splitlines()[0]})")
    return step, (f"one C++ call a step for the {step.stack.num_layers} decoder layers on cpu (up to "
                  f"{step.max_rows} sequences; more run the model's torch forward)")
