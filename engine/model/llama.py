"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral) over paged attention.

The families differ by switches read from the HF config: bias on q/k/v (Qwen2 always,
Llama when `attention_bias`), per-head RMSNorm on q and k before RoPE (Qwen3, Qwen3-MoE), an
explicit `head_dim`, RoPE scaling, tied embeddings, and a sparse mixture-of-experts block in place
of the MLP on the layers `engine/model/moe.py` names (every Mixtral layer; Qwen3-MoE's per
`decoder_sparse_step` and `mlp_only_layers`). Forward takes a flat token batch; the per-step
batch layout (which tokens belong to which sequence, where their K/V go) lives in the
attention metadata installed by the model runner.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.attention.layer import Attention
from engine.attention.metadata import OutputRows
from engine.model.causal_lm import CausalLM
from engine.model.checkpoint_slice import CheckpointTensor
from engine.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    default_weight_loader,
    divide,
    get_tp_rank_and_size,
)
from engine.model.moe import ALL_EXPERTS, FusedExperts, SparseMoeBlock, expert_param_name, moe_checkpoint_name, moe_spec
from engine.model.rope import get_rope_parameters
from kernels.fused import qk_rms_norm

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# (fused parameter, checkpoint projection, shard id)
STACKED_PARAMS: tuple[tuple[str, str, Any], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# Buffers some checkpoints carry that we recompute.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")


def _head_dim(cfg: PretrainedConfig) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _sliding_window(cfg: PretrainedConfig) -> int | None:
    """The attention window the checkpoint was trained with, if any (Mistral v0.1, some Qwen)."""
    if cfg.model_type in ("qwen2", "qwen3", "qwen3_moe") and not getattr(cfg, "use_sliding_window", False):
        return None
    return getattr(cfg, "sliding_window", None)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: PretrainedConfig, dtype: torch.dtype) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias, dtype=dtype)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: PretrainedConfig, layer_idx: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        _, tp_size = get_tp_rank_and_size()
        self.head_dim = _head_dim(cfg)
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        qkv_bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        # Qwen2 has q/k/v bias but no o_proj bias; Llama's attention_bias covers all four.
        o_bias = cfg.model_type != "qwen2" and bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, total_heads, total_kv_heads,
                                          bias=qkv_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, cfg.hidden_size, bias=o_bias, dtype=dtype)
        self.num_heads = divide(total_heads, tp_size, "attention heads")
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rotary_emb = rotary_emb
        self.qk_norm = cfg.model_type in QK_NORM_TYPES
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim ** -0.5, layer_idx=layer_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rows: OutputRows | None = None
                ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm and q.is_cuda:  # per head, before RoPE: q and k in one launch
            q, k = qk_rms_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.k_norm.eps)
        elif self.qk_norm:
            num_tokens = hidden.shape[0]
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim)).reshape(num_tokens, -1)
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim)).reshape(num_tokens, -1)
        out = self.attn(q, k, v, rotary=self.rotary_emb, positions=positions, rows=rows)
        return out if rows is not None and rows.empty else self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: PretrainedConfig, layer_idx: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary_emb, dtype)
        spec = moe_spec(cfg, layer_idx)
        self.mlp: nn.Module = LlamaMLP(cfg, dtype) if spec is None else SparseMoeBlock(spec, cfg.hidden_size, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                rows: OutputRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """With `rows` (the last layer), every row stores its K/V and only those rows go on."""
        # The residual stream is carried separately so each norm can fuse the preceding add.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rows)
        if rows is not None:
            residual = residual[rows.index]
            if rows.empty:
                return hidden, residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: PretrainedConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        head_dim = _head_dim(cfg)
        theta, scaling = get_rope_parameters(cfg)
        rotary_dim = int(head_dim * float(getattr(cfg, "partial_rotary_factor", 1.0)))
        # One cos/sin table shared by every layer.
        rotary_emb = RotaryEmbedding(head_dim, rotary_dim, cfg.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, rotary_emb, dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, output_rows: OutputRows | None = None
                ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, output_rows if i == last else None)
        if residual is None:  # no layers
            return self.norm(hidden if output_rows is None else hidden[output_rows.index])
        if output_rows is not None and output_rows.empty:
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    """The model the runner drives: forward over a flat token batch, logits for chosen rows."""

    def __init__(self, hf_config: PretrainedConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.sliding_window = _sliding_window(hf_config)
        if self.sliding_window is not None:
            logger.warning("%s was trained with a %d-token sliding window; this engine attends over the "
                           "full context, so outputs differ beyond %d tokens",
                           hf_config.model_type, self.sliding_window, self.sliding_window)
        self.model = LlamaModel(hf_config, dtype)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, output_rows: OutputRows | None = None
                ) -> torch.Tensor:
        """input_ids[T], positions[T] -> hidden[T, H], or [N, H] for `output_rows` (attention metadata from
        forward_context)."""
        return self.model(input_ids, positions, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden[N, H] -> float32 logits[N, V]."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Copy HF-named checkpoint tensors into our (fused, sharded) parameters.

        Raises ValueError naming every checkpoint tensor without a destination and every
        parameter (or fused shard) the checkpoint did not provide.
        """
        params = dict(self.named_parameters())  # tied lm_head appears once, as embed_tokens
        expected: dict[str, set[Any]] = {name: {None} for name in params}
        for fused, _, shard_id in STACKED_PARAMS:
            for name in params:
                if f".{fused}." in name:
                    expected[name].discard(None)
                    expected[name].add(shard_id)
        for module_name, module in self.named_modules():
            if isinstance(module, FusedExperts):
                for suffix, shards in module.expected_shards().items():
                    expected[f"{module_name}.{suffix}"] = shards
        loaded: dict[str, set[Any]] = {name: set() for name in params}
        unexpected: list[str] = []
        for ckpt_name, tensor in weights:
            if ckpt_name.endswith(IGNORED_SUFFIXES):
                continue
            if self.tie_word_embeddings and ckpt_name == "lm_head.weight":
                continue  # some tied checkpoints store the shared matrix twice
            name, shard_id = moe_checkpoint_name(ckpt_name), None
            expert = expert_param_name(name)
            if expert is not None:
                name, shard_id = expert
            else:
                for fused, proj, sid in STACKED_PARAMS:
                    if f".{proj}." in name:
                        name, shard_id = name.replace(f".{proj}.", f".{fused}."), sid
                        break
            param = params.get(name)
            if param is None:
                unexpected.append(ckpt_name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                if shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
            except ValueError as err:
                raise ValueError(f"checkpoint tensor {ckpt_name}: {err}") from None
            loaded[name].update(expected[name] if shard_id == ALL_EXPERTS else {shard_id})
        missing = [name if shards == {None} else f"{name} (shards {sorted(map(str, shards))})"
                   for name in params if (shards := expected[name] - loaded[name])]
        if unexpected or missing:
            lines = []
            if unexpected:
                lines.append(f"checkpoint tensors with no destination in {type(self).__name__} "
                             f"({self.config.model_type}): {', '.join(unexpected)}")
            if missing:
                lines.append(f"parameters not found in the checkpoint: {', '.join(missing)}")
            raise ValueError("; ".join(lines))
