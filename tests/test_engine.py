"""The engine end to end on tiny random models: batching, chunked prefill, preemption, prefix cache."""
import pytest

from engine import LLM, SamplingParams
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", num_layers=2)


def make_llm(tiny_dir, **overrides):
    settings = dict(block_size=16, max_num_batched_tokens=256, cpu_kv_cache_bytes=32 << 20)
    return LLM(model=tiny_dir, **{**settings, **overrides})


def prompts(n):
    # Different lengths, crossing block boundaries; distinct contents.
    return [[(7 * i + j) % 250 + 3 for j in range(5 + 13 * i)] for i in range(n)]


def test_concurrent_equals_alone(tiny_dir):
    llm = make_llm(tiny_dir)
    batch = prompts(16)
    together = llm.generate(batch, GREEDY)
    alone = [llm.generate(p, GREEDY)[0] for p in batch]
    for t, a in zip(together, alone):
        assert t.token_ids == a.token_ids and len(t.token_ids) == 12
        assert t.finish_reason == "length"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_chunked_prefill_equals_whole_prefill(tiny_dir):
    batch = prompts(6)
    whole = make_llm(tiny_dir).generate(batch, GREEDY)
    chunked = make_llm(tiny_dir, max_num_batched_tokens=16).generate(batch, GREEDY)
    assert [r.token_ids for r in whole] == [r.token_ids for r in chunked]


def test_small_cache_preempts_and_completes(tiny_dir):
    batch = prompts(16)
    reference = make_llm(tiny_dir).generate(batch, GREEDY)
    # 14 blocks x 16 tokens: far less than 16 sequences need at once.
    small = LLM(model=tiny_dir, block_size=16, max_num_batched_tokens=256, num_kv_blocks=14,
                enable_prefix_caching=False)
    results = small.generate(batch, GREEDY)
    assert small.engine.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    bm = small.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_shared_prefix_computes_only_new_tokens(tiny_dir):
    llm = make_llm(tiny_dir)
    prefix = [(11 * j) % 250 + 3 for j in range(200)]
    first = prefix + [5, 6, 7]
    second = prefix + [9, 10, 11, 12]
    cold = make_llm(tiny_dir).generate(second, GREEDY)[0]
    llm.generate(first, GREEDY)
    before = llm.engine.num_forwarded_tokens
    warm = llm.generate(second, GREEDY)[0]
    forwarded = llm.engine.num_forwarded_tokens - before
    # 192 prefix tokens (12 full blocks of 16) come from the cache; the rest is computed.
    assert warm.num_cached_tokens == 192
    assert forwarded == len(second) - 192 + GREEDY.max_tokens - 1
    assert warm.token_ids == cold.token_ids


def test_stop_and_max_tokens_and_n(tiny_dir):
    llm = make_llm(tiny_dir)
    out = llm.generate(prompts(1), SamplingParams(temperature=0.9, n=3, seed=1, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 5 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate(prompts(1), SamplingParams(temperature=0.9, n=3, seed=1, max_tokens=5, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    full = llm.generate(prompts(1), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    stop = full.text[3:5]
    cut = llm.generate(prompts(1), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and full.text.startswith(cut.text)


def test_context_length_is_enforced(tiny_dir):
    from engine.errors import ContextLengthExceeded
    llm = make_llm(tiny_dir, max_context_len=64)
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 64"):
        llm.generate([list(range(3, 70))], GREEDY)
    out = llm.generate([list(range(3, 60))], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 57


def test_profiling_forward_runs_and_releases_its_cache(tiny_dir):
    llm = make_llm(tiny_dir)
    runner = llm.engine.runner
    num_blocks = runner.num_blocks
    assert runner.profile_peak_bytes(100) == 0  # activations are only measured on a GPU
    assert runner.k_cache is None and runner.v_cache is None
    assert all(layer.k_cache is None for layer in runner.attention_layers)
    runner.allocate_kv_cache(num_blocks)
    assert llm.generate(prompts(2), GREEDY)[1].finish_reason == "length"
