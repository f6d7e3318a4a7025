"""Whether a model splits over `tensor_parallel_size` ranks: a startup error naming its numbers if not."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def check_tensor_parallel_sizes(hf_config: PretrainedConfig, tp_size: int, model_name: str) -> None:
    """Query heads, KV heads (or tp a multiple of them: replicated), MLP and expert widths must divide."""
    if tp_size == 1:
        return
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    problems = []
    if heads % tp_size:
        problems.append(f"{heads} attention heads")
    if kv_heads % tp_size and tp_size % kv_heads:
        problems.append(f"{kv_heads} KV heads (nor is {tp_size} a multiple of them)")
    for key, what in (("intermediate_size", "MLP width"), ("moe_intermediate_size", "expert MLP width")):
        width = getattr(hf_config, key, None)
        if width and int(width) % tp_size:
            problems.append(f"{what} {width} ({key})")
    if problems:
        fits = [n for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)
                and all(not getattr(hf_config, k, None) or int(getattr(hf_config, k)) % n == 0
                        for k in ("intermediate_size", "moe_intermediate_size"))]
        raise ConfigError(f"backend.tensor_parallel_size = {tp_size} does not divide {model_name}'s "
                          f"{', '.join(problems)}; sizes that split this model: {', '.join(map(str, fits))}")
