"""Model registry: HF `architectures` name -> our implementation."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.model.causal_lm import CausalLM
from engine.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
}


def get_model_class(hf_config: PretrainedConfig) -> type[CausalLM]:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported model architecture {architectures or '(none in config.json)'}; "
                     f"supported: {', '.join(MODEL_REGISTRY)}")


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "get_model_class"]
