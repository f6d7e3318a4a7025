"""`[backend] kv_cache_dtype = "fp8_e4m3" | "fp8_e5m2"` through the engine on the CPU: the cache holds
one byte per value (so ~4x the float32 tokens in the same budget), batching, chunked prefill,
preemption and prefix-cache hits give the tokens they give alone (quantizing is per value, so
nothing depends on the batch), scales come from the calibration file, and what cannot work is
refused at startup."""
import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.kv_scales import kv_scales
from engine.config import ConfigError
from tests.support.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", num_layers=2)


def make_llm(tiny_dir, **overrides):
    settings = dict(block_size=16, max_num_batched_tokens=256, cpu_kv_cache_bytes=32 << 20, cpu_weight_dtype="float32",
                    kv_cache_dtype="fp8_e4m3")
    return LLM(model=tiny_dir, **{**settings, **overrides})


def prompts(n):
    return [[(7 * i + j) % 250 + 3 for j in range(5 + 13 * i)] for i in range(n)]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pages_hold_four_times_the_float32_tokens(tiny_dir, kv_cache_dtype):
    full = make_llm(tiny_dir, kv_cache_dtype="auto")
    fp8 = make_llm(tiny_dir, kv_cache_dtype=kv_cache_dtype)
    assert full.engine.runner.k_cache.dtype == torch.float32
    assert fp8.engine.runner.k_cache.dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[
        kv_cache_dtype]
    assert fp8.engine.block_manager.num_blocks >= 3.8 * full.engine.block_manager.num_blocks
    assert fp8.engine.stats().kv_cache_dtype == str(fp8.engine.kv_dtype).removeprefix("torch.")
    assert "scales 1 (no calibration file)" in fp8.engine.kv_cache_text
    # the pages hold what was stored: the tokens differ from the float32 cache's only by rounding
    out = fp8.generate(prompts(3), GREEDY)
    assert all(len(r.token_ids) == 12 for r in out)
    assert fp8.engine.runner.k_cache.float().abs().sum() > 0


def test_batching_chunking_preemption_and_prefix_hits_see_the_same_pages(tiny_dir):
    batch = prompts(16)
    llm = make_llm(tiny_dir)
    together = llm.generate(batch, GREEDY)
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in batch]
    assert [r.token_ids for r in together] == alone
    chunked = make_llm(tiny_dir, max_num_batched_tokens=16).generate(batch, GREEDY)
    assert [r.token_ids for r in chunked] == alone
    small = make_llm(tiny_dir, num_kv_blocks=14, enable_prefix_caching=False)
    preempted = small.generate(batch, GREEDY)
    assert small.engine.scheduler.num_preemptions > 0
    assert [r.token_ids for r in preempted] == alone
    prefix = [(11 * j) % 250 + 3 for j in range(200)]
    cold = make_llm(tiny_dir).generate(prefix + [9, 10, 11], GREEDY)[0]
    llm.generate(prefix + [5, 6], GREEDY)
    warm = llm.generate(prefix + [9, 10, 11], GREEDY)[0]
    assert warm.num_cached_tokens == 192 and warm.token_ids == cold.token_ids


def test_reference_attention_reads_the_same_pages(tiny_dir):
    """`cpu_attention = "reference"` (the paged oracle of every algorithm) over FP8 pages agrees with
    the fused CPU path."""
    fused = make_llm(tiny_dir).generate(prompts(4), GREEDY)
    for variant in ({"flashdecoding.enable": False}, {"flashdecoding.kernel": "flash"},
                    {"flashdecoding.kernel": "flash", "flashdecoding.async_softmax": True}):
        ref = make_llm(tiny_dir, cpu_attention="reference", **variant).generate(prompts(4), GREEDY)
        assert [r.token_ids for r in ref] == [r.token_ids for r in fused], variant


def test_scales_come_from_the_calibration_file(tiny_dir, tmp_path):
    from engine.tools.calibration_run import run_calibration

    path = tmp_path / "calibration.json"
    llm = make_llm(tiny_dir)
    run_calibration(llm.config, path, texts=["the quick brown fox jumps over the lazy dog " * 8],
                    prompt_tokens=64, decode_tokens=2)
    amax = json.loads(path.read_text())["kv_amax"]
    spec = llm.engine.runner.spec
    assert len(amax["k"]) == spec.num_layers and all(len(row) == spec.num_kv_heads for row in amax["k"])
    assert all(x > 0 for row in amax["k"] + amax["v"] for x in row)
    calibrated = make_llm(tiny_dir, **{"flashdecoding.calibration_file": str(path)})
    scales = calibrated.engine.backend.kv_scales
    assert "from" in scales.source and str(path) in calibrated.engine.kv_cache_text
    assert torch.allclose(scales.k, torch.tensor(amax["k"]) / 448.0)
    assert torch.allclose(scales.v, torch.tensor(amax["v"]) / 448.0)
    assert all(len(r.token_ids) == 12 for r in calibrated.generate(prompts(2), GREEDY))
    amax["k"] = amax["k"][:1]
    path.write_text(json.dumps({"kv_amax": amax}))
    with pytest.raises(ValueError, match="KV heads"):
        kv_scales(torch.float8_e4m3fn, spec.num_layers, spec.num_kv_heads, torch.device("cpu"), str(path))


def test_what_cannot_read_fp8_pages_is_refused_at_startup(tiny_dir):
    with pytest.raises((ConfigError, ValueError), match="FFD"):
        make_llm(tiny_dir, **{"flashdecoding.kernel": "ffd"})
    with pytest.raises((ConfigError, ValueError), match="kv_cache_dtype"):
        make_llm(tiny_dir, kv_cache_dtype="int8")


def test_the_fused_rope_store_writes_the_pages_the_plain_store_writes(tiny_dir):
    """The layer's fused RoPE + KV write (the GPU's path; Triton's interpreter here) over FP8 pages:
    the same tokens as the separate RoPE and store, and the same codes in the pages."""
    plain = make_llm(tiny_dir)
    fused = make_llm(tiny_dir)
    fused.engine.backend.fuse_rope_store = True
    batch = prompts(4)
    assert [r.token_ids for r in fused.generate(batch, GREEDY)] == [r.token_ids for r in plain.generate(batch, GREEDY)]
    used = plain.engine.runner.k_cache.float().abs().sum(dim=(0, 2, 3, 4)) > 0     # pages written
    for a, b in ((plain.engine.runner.k_cache, fused.engine.runner.k_cache),
                 (plain.engine.runner.v_cache, fused.engine.runner.v_cache)):
        assert torch.equal(a[:, used].float(), b[:, used].float())


def test_each_vendor_gets_its_fp8_format():
    from engine.worker.device import select_kv_dtype

    assert select_kv_dtype("auto", torch.bfloat16, "nvidia") == torch.bfloat16
    assert select_kv_dtype("fp8_e4m3", torch.bfloat16, "nvidia") == torch.float8_e4m3fn
    assert select_kv_dtype("fp8_e5m2", torch.float32, "cpu") == torch.float8_e5m2
    assert select_kv_dtype("fp8_e4m3", torch.bfloat16, "amd") == torch.float8_e4m3fnuz
    assert select_kv_dtype("fp8_e5m2", torch.bfloat16, "amd") == torch.float8_e5m2fnuz
