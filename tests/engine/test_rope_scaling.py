"""[model] rope_scaling: the model's logits equal transformers' (same rope_scaling, float32, CPU)
at positions beyond the checkpoint's own length, and the context length it allows."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine import load_config
from engine.config import ConfigError, RopeScaling
from engine.core.llm_engine import LLMEngine
from engine.model.loader import load_model
from tests.support.model_driver import PagedModelDriver
from tests.support.tiny_models import make_tiny_model

ORIGINAL = 64      # the tiny checkpoint's max_position_embeddings
FACTOR = 4.0
LENGTH = int(FACTOR * ORIGINAL)
PREFILL = 232      # then decodes up to LENGTH


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("rope") / "tiny", "llama", max_position_embeddings=ORIGINAL)


def _hf_logits(model_dir: Path, rope: dict, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    config.rope_parameters = {"rope_theta": 10000.0, **rope}
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), config=config, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn"])
def test_logits_match_transformers_beyond_the_original_length(model_dir, rope_type) -> None:
    """Prefill, then single-token decodes, through the paged path up to factor x the original
    length; transformers gets the whole sequence at once (its dynamic NTK then uses that length,
    which is what a table of this length holds)."""
    scaling = RopeScaling(type=rope_type, factor=FACTOR, original_max_position_embeddings=ORIGINAL)
    model = load_model(model_dir, torch.float32, torch.device("cpu"), scaling, LENGTH)
    tokens = torch.randint(0, 259, (LENGTH,), generator=torch.Generator().manual_seed(7)).tolist()
    driver = PagedModelDriver(model, num_blocks=LENGTH // 16 + 2, block_size=16)
    ours = [driver.step({0: tokens[:PREFILL]})]
    ours += [driver.step({0: [t]}) for t in tokens[PREFILL:]]
    got = torch.cat(ours)
    rope = {"rope_type": rope_type, "factor": FACTOR, "original_max_position_embeddings": ORIGINAL}
    want = _hf_logits(model_dir, rope, tokens)
    torch.testing.assert_close(got[ORIGINAL:], want[ORIGINAL:], atol=1e-4, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    plain = _hf_logits(model_dir, {"rope_type": "default"}, tokens)
    assert (plain[ORIGINAL:] - want[ORIGINAL:]).abs().max() > 1e-2  # the scaling changes the answer there


def _engine_config(model_dir: Path, **overrides):
    settings = {"model.name": str(model_dir), "backend.cpu_kv_cache_bytes": 4 * 1024 * 1024,
                "backend.block_size": 16, "backend.max_num_batched_tokens": 512}
    return load_config(None, overrides={**settings, **overrides})


def test_context_past_the_checkpoint_needs_rope_scaling(model_dir, caplog) -> None:
    with pytest.raises(ConfigError, match="rope_scaling"):
        LLMEngine(_engine_config(model_dir, **{"model.max_context_len": ORIGINAL * 2}))
    rope = {"type": "yarn", "factor": FACTOR, "original_max_position_embeddings": ORIGINAL}
    with pytest.raises(ConfigError, match=f"{LENGTH}"):
        LLMEngine(_engine_config(model_dir, **{"model.max_context_len": LENGTH + 1, "model.rope_scaling": rope}))
    with caplog.at_level(logging.WARNING, logger="engine.model.context_len"):
        engine = LLMEngine(_engine_config(model_dir, **{"model.rope_scaling": rope}))
    assert engine.max_context_len == LENGTH and "quality may drop" in caplog.text
    assert engine.model.model.layers[0].self_attn.rotary_emb.cos_cache.shape[0] == LENGTH


def test_rope_scaling_setting_is_validated() -> None:
    for bad in ({"type": "longrope", "factor": 2.0}, {"type": "linear", "factor": 1.0},
                {"type": "yarn", "factor": 2.0, "scale": 3}):
        with pytest.raises(ConfigError, match="rope_scaling"):
            load_config(None, overrides={"model.rope_scaling": bad})
