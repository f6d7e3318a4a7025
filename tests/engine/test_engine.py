"""The engine end to end on tiny random models: batching, chunked prefill, preemption, prefix cache."""
import gc
import weakref

import pytest

from engine import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", num_layers=2)


def make_llm(tiny_dir, **overrides):
    # float32: these tests compare tokens across batch shapes exactly, which bf16's rounding breaks
    settings = dict(block_size=16, max_num_batched_tokens=256, cpu_kv_cache_bytes=32 << 20, cpu_weight_dtype="float32")
    return LLM(model=tiny_dir, **{**settings, **overrides})


def prompts(n):
    # Different lengths, crossing block boundaries; distinct contents.
    return [[(7 * i + j) % 250 + 3 for j in range(5 + 13 * i)] for i in range(n)]


def test_concurrent_equals_alone(tiny_dir):
    llm = make_llm(tiny_dir)
    batch = prompts(16)
    together = llm.generate(batch, GREEDY)
    alone = [llm.generate(p, GREEDY)[0] for p in batch]
    for t, a in zip(together, alone, strict=True):
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
                enable_prefix_caching=False, cpu_weight_dtype="float32")
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
    from engine.request.errors import ContextLengthExceeded
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


def test_prompt_logprobs_score_a_continuation_as_generation_did(tiny_dir):
    """prompt_logprobs: one entry per prompt token, None for the first. A greedy continuation scored as
    part of the prompt gets the logprobs its generation reported (teacher forcing), from one prefill,
    from 16-token chunks, and where the prefix cache holds the whole prompt (it is not used);
    max_tokens = 0 scores without output."""
    llm = make_llm(tiny_dir)
    prompt = prompts(3)[2]                                                   # 31 tokens
    gen = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2))[0]
    full = prompt + gen.token_ids
    llm.generate(full, GREEDY)                                               # every full block of `full` cached
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=2)
    for scorer in (llm, make_llm(tiny_dir, max_num_batched_tokens=16)):
        res = scorer.generate(full, scoring)[0]
        assert res.token_ids == [] and res.finish_reason == "length" and res.num_cached_tokens == 0
        scored = res.prompt_logprobs
        assert len(scored) == len(full) and scored[0] is None
        assert [e.token_id for e in scored[1:]] == full[1:]
        assert all(e.logprob <= 0 and len(e.top) == 2 for e in scored[1:])
        for entry, sampled in zip(scored[len(prompt):], gen.outputs[0].logprobs, strict=True):
            assert entry.token_id == sampled.token_id
            assert entry.logprob == pytest.approx(sampled.logprob, abs=1e-4)
            assert [i for i, _ in entry.top] == [i for i, _ in sampled.top]
    again = llm.generate(full, GREEDY)[0]                                    # plain requests still hit the cache
    assert again.num_cached_tokens > 0


def test_prompt_logprobs_survive_preemption(tiny_dir):
    """Scoring requests in a cache too small for all of them at once: preempted and recomputed, each
    prompt is scored once per position, as when scored alone."""
    batch = [p + p for p in prompts(10)[4:]]                                 # 106 to 240 tokens
    scoring = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    alone = [make_llm(tiny_dir).generate(p, scoring)[0] for p in batch]
    small = LLM(model=tiny_dir, block_size=16, max_num_batched_tokens=64, num_kv_blocks=20,
                enable_prefix_caching=False, cpu_weight_dtype="float32")
    together = small.generate(batch, scoring)
    assert small.engine.scheduler.num_preemptions > 0
    for t, a in zip(together, alone, strict=True):
        assert len(t.prompt_logprobs) == len(a.prompt_logprobs) == len(t.prompt_token_ids)
        assert [e.token_id for e in t.prompt_logprobs[1:]] == t.prompt_token_ids[1:]
        for x, y in zip(t.prompt_logprobs[1:], a.prompt_logprobs[1:], strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert t.token_ids == a.token_ids


def test_long_prompts_keep_one_run_of_blocks_after_the_cache_cycles(tmp_path, monkeypatch):
    """Long prompts one after another through a cache that holds about two of them: each prompt's blocks are one
    run of ids (what the GPU prefill reads in place), and its tokens are those of an engine with a fresh cache."""
    model = make_tiny_model(tmp_path, "llama", num_layers=2, max_position_embeddings=8192)
    long_prompts = [[(13 * i + 7 * j) % 250 + 3 for j in range(4200 + 40 * i)] for i in range(4)]
    llm = make_llm(model, max_num_batched_tokens=1024, num_kv_blocks=600)
    bm = llm.engine.block_manager
    tables = []
    free = bm.free
    monkeypatch.setattr(bm, "free", lambda seq: (tables.append(list(seq.block_table)), free(seq)))
    outputs = [llm.generate(p, GREEDY)[0].token_ids for p in long_prompts]
    assert [len(t) for t in tables] == [-(-(len(p) + 11) // 16) for p in long_prompts]
    assert all(t[:-1] == list(range(t[0], t[0] + len(t) - 1)) for t in tables)   # the decode's block aside
    assert len({t[0] for t in tables}) > 2          # the cache cycled: runs started elsewhere
    for prompt, tokens in zip(long_prompts, outputs, strict=True):
        assert make_llm(model, max_num_batched_tokens=1024).generate(prompt, GREEDY)[0].token_ids == tokens


def test_a_dropped_engine_frees_its_kv_cache_at_once(tiny_dir):
    """No reference cycle keeps a dropped engine's pages alive until the cycle collector runs: a benchmark
    (or an application) that builds a second engine on a GPU needs the first one's memory back at once."""
    llm = make_llm(tiny_dir)
    llm.generate([[5, 6, 7]], GREEDY)
    gc.collect()
    gc.disable()
    try:
        pages = weakref.ref(llm.engine.runner.k_cache)
        engine = weakref.ref(llm.engine)
        del llm
        assert engine() is None and pages() is None
    finally:
        gc.enable()
