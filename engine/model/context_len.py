"""How long a context the engine serves: the model's own, or `[model] max_context_len` within what RoPE reaches."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


def model_context_len(hf_config: PretrainedConfig) -> int:
    return int(getattr(hf_config, "max_position_embeddings", 0) or 2048)


def resolve_context_len(model: ModelConfig, hf_config: PretrainedConfig) -> int:
    """The model's own length; with [model] rope_scaling, up to factor x the original length
    (the default then), past what the checkpoint was trained for, with a warning."""
    own = model_context_len(hf_config)
    wanted = model.max_context_len
    scaling = model.rope_scaling
    if scaling is None:
        if wanted is not None and wanted > own:  # RoPE as trained is only defined up to max_position_embeddings
            raise ConfigError(f"model.max_context_len: {wanted} is above what this model supports "
                              f"({own}, its max_position_embeddings); set max_context_len <= {own}, remove it, "
                              f"or set model.rope_scaling to stretch the positions")
        return wanted or own
    original = scaling.original_max_position_embeddings or own
    limit = int(scaling.factor * original)
    if wanted is not None and wanted > limit:
        raise ConfigError(f"model.max_context_len: {wanted} is above what model.rope_scaling reaches "
                          f"({scaling.factor:g} x {original} = {limit}); raise rope_scaling.factor or lower "
                          f"max_context_len")
    length = wanted or limit
    if length > own:
        logger.warning("model.rope_scaling (%s, factor %g over %d positions): context %d is beyond the %d tokens "
                       "this checkpoint was trained for; output quality may drop", scaling.type, scaling.factor,
                       original, length, own)
    return length
