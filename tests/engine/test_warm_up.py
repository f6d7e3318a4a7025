"""The startup warm-up of the prefill path: which prompts, that they reach the prefix path, and that the
engine is left as if it had served nothing."""
import pytest

from engine import LLM, SamplingParams
from engine.core import warm_up
from engine.core.warm_up import ODD_ROWS, WarmUpError, warm_up_prefill, warm_up_prompt_lens
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", num_layers=2)


def make_llm(tiny_dir, chunk=16):
    return LLM(model=tiny_dir, block_size=16, max_num_batched_tokens=chunk, cpu_kv_cache_bytes=32 << 20,
               cpu_weight_dtype="float32")


@pytest.mark.parametrize(("chunk", "prefix_keys", "limit", "expected"), [
    (2048, 4096, 1 << 20, [6144, 4096 + ODD_ROWS]),
    (2048, 0, 1 << 20, [6144, 4096 + ODD_ROWS]),           # a prefix of two chunks at least
    (8192, 4096, 1 << 20, [24576, 16384 + ODD_ROWS]),
    (4096, 10000, 1 << 20, [16384, 12288 + ODD_ROWS]),     # the prefix rounded up to whole chunks
    (16, 48, 1 << 20, [64, 48 + 15]),                       # fewer odd rows than a chunk holds
    (2048, 4096, 5000, [4096 + ODD_ROWS]),                  # prompts at the limit are left out
    (2048, 4096, 4000, []),
])
def test_prompt_lens(chunk, prefix_keys, limit, expected):
    assert warm_up_prompt_lens(chunk, prefix_keys, limit) == expected


def test_warm_up_reaches_the_prefix_path_and_leaves_nothing_behind(tiny_dir, monkeypatch):
    llm = make_llm(tiny_dir)
    engine = llm.engine
    backend = engine.backend
    monkeypatch.setattr(backend, "prefill_prefix_keys", 48)
    chunks = []   # (cached keys before the chunk, rows) of every prefill call of layer 0
    prefill = backend.prefill

    def recording_prefill(layer_idx, q, k_cache, v_cache, metadata, *, scale):
        if layer_idx == 0:
            starts, lens = metadata.query_start_loc_host, metadata.seq_lens_host
            chunks.extend((lens[b] - (starts[b + 1] - starts[b]), starts[b + 1] - starts[b])
                          for b in range(len(lens)))
        return prefill(layer_idx, q, k_cache, v_cache, metadata, scale=scale)

    monkeypatch.setattr(backend, "prefill", recording_prefill)
    baseline = make_llm(tiny_dir).generate([[5, 6, 7, 8] * 10], SamplingParams(temperature=0.0, max_tokens=8))

    assert warm_up_prefill(engine) == [64, 48 + 15]
    assert (48, 16) in chunks and (48, 15) in chunks
    bm = engine.block_manager
    stats = engine.stats()
    assert bm.num_free_blocks == bm.num_blocks and not engine.has_unfinished()
    assert stats.prefix_cache_queries == stats.prefix_cache_hits == stats.num_preemptions == 0
    assert engine.num_forwarded_tokens == 0 and engine.attention_counters == {}
    after = llm.generate([[5, 6, 7, 8] * 10], SamplingParams(temperature=0.0, max_tokens=8))
    assert after[0].token_ids == baseline[0].token_ids


def test_a_failing_prefill_path_stops_the_start(tiny_dir, monkeypatch):
    engine = make_llm(tiny_dir).engine

    def broken_prefill(*args, **kwargs):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(engine.backend, "prefill", broken_prefill)
    with pytest.raises(WarmUpError, match="48-token warm-up prompt failed"):
        warm_up_prefill(engine)


def test_a_large_token_budget_warms_up_in_short_chunks_and_is_restored(tiny_dir, monkeypatch):
    engine = make_llm(tiny_dir, chunk=256).engine
    monkeypatch.setattr(warm_up, "MAX_CHUNK", 16)
    rows = []
    prefill = engine.backend.prefill

    def recording_prefill(layer_idx, q, k_cache, v_cache, metadata, *, scale):
        if layer_idx == 0:
            rows.append(q.shape[0])
        return prefill(layer_idx, q, k_cache, v_cache, metadata, scale=scale)

    monkeypatch.setattr(engine.backend, "prefill", recording_prefill)
    assert warm_up_prefill(engine) == [48, 32 + 15]
    assert max(rows) == 16
    assert engine.scheduler.max_num_batched_tokens == 256
