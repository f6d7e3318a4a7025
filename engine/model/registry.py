"""Model registry: HF `architectures` name -> our implementation."""
from __future__ import annotations

from typing import Any

from torch import nn

from engine.model.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(hf_config: Any) -> type[nn.Module]:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported model architecture {architectures or '(none in config.json)'}; "
                     f"supported: {', '.join(MODEL_REGISTRY)}")


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "get_model_class"]
