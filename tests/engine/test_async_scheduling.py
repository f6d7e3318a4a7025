"""Overlapped decode (backend.async_scheduling): step N+1 is launched on step N's device-side
tokens before they are read. Every result must equal the synchronous engine's, whatever ends a
request (length, EOS, stop token, stop string, context limit, abort) and whatever joins or is
preempted meanwhile; rows that end while their next step is in flight are dropped."""
import pytest

from engine import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_async"), "llama", num_layers=2)


def make_llm(tiny_dir, async_scheduling, **overrides):
    # float32: these tests compare tokens across batch shapes exactly, which bf16's rounding breaks
    settings = dict(block_size=16, max_num_batched_tokens=256, cpu_kv_cache_bytes=32 << 20,
                    async_scheduling=async_scheduling, cpu_weight_dtype="float32")
    return LLM(model=tiny_dir, **{**settings, **overrides})


def prompts(n, base=5):
    return [[(7 * i + j) % 250 + 3 for j in range(base + 13 * i)] for i in range(n)]


def outputs(results):
    return [[(c.token_ids, c.text, c.finish_reason) for c in r.outputs] for r in results]


def run_both(tiny_dir, batch, params, **overrides):
    on, off = make_llm(tiny_dir, True, **overrides), make_llm(tiny_dir, False, **overrides)
    a, b = on.generate(batch, params), off.generate(batch, params)
    for llm in (on, off):
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert all(seq.num_in_flight_tokens == 0 for seq in llm.engine.scheduler.running)
    return on, a, b


def count_overlapped_steps(llm):
    """Wrap the engine's launch to count steps launched before the previous one was read."""
    engine = llm.engine
    launch, seen = engine._launch, []

    def counting(seqs, input_ids=None):
        seen.append(input_ids is not None)
        return launch(seqs, input_ids)
    engine._launch = counting
    return seen


def test_greedy_equals_synchronous_and_really_overlaps(tiny_dir):
    on, off = make_llm(tiny_dir, True), make_llm(tiny_dir, False)
    seen = count_overlapped_steps(on)
    batch = prompts(6)
    params = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    assert outputs(on.generate(batch, params)) == outputs(off.generate(batch, params))
    assert sum(seen) >= 10, f"only {sum(seen)} steps were launched on device-side tokens"


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=1),
    SamplingParams(temperature=0.0, max_tokens=2),
    SamplingParams(temperature=0.0, max_tokens=40),                    # EOS may end some early
    SamplingParams(temperature=0.8, seed=3, max_tokens=15, n=2, ignore_eos=True),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=9, max_tokens=12, ignore_eos=True),
])
def test_every_finish_equals_synchronous(tiny_dir, params):
    _, a, b = run_both(tiny_dir, prompts(5), params)
    assert outputs(a) == outputs(b)


def test_stop_tokens_and_strings_drop_the_row_in_flight(tiny_dir):
    free_run = make_llm(tiny_dir, False).generate(prompts(4), SamplingParams(temperature=0.0, max_tokens=30,
                                                                            ignore_eos=True))
    stop_token = free_run[0].token_ids[6]
    stop_text = free_run[1].text[8:10]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_token],
                            stop=[stop_text])
    _, a, b = run_both(tiny_dir, prompts(4), params)
    assert outputs(a) == outputs(b)
    assert any(r.finish_reason == "stop" for r in a)


def test_context_limit_ends_on_time(tiny_dir):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    _, a, b = run_both(tiny_dir, [list(range(3, 40))], params, max_context_len=48)
    assert outputs(a) == outputs(b) and len(a[0].token_ids) == 48 - 37


def test_history_reading_rows_step_synchronously(tiny_dir):
    on, off = make_llm(tiny_dir, True), make_llm(tiny_dir, False)
    batch = prompts(3)
    kinds = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
             SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=4),
             SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias={7: 2.0})]
    for params in kinds:
        seen = count_overlapped_steps(on)
        a = on.generate(batch, params)
        assert outputs(a) == outputs(off.generate(batch, params))
        assert not any(seen), f"{params} was launched before its previous token was read"


def test_logprobs_are_read_back_with_their_step(tiny_dir):
    """Logprobs are computed on the device when the step launches (the logits are overwritten by the
    next step) and read back with its tokens: equal to the synchronous engine's, and overlapped."""
    on, off = make_llm(tiny_dir, True), make_llm(tiny_dir, False)
    batch = prompts(3)
    mixed = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3),
             SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=2, max_tokens=10, ignore_eos=True, logprobs=0)]
    seen = count_overlapped_steps(on)
    engine_on, engine_off = on.engine, off.engine
    got = {}
    for engine, sink in ((engine_on, got.setdefault("on", {})), (engine_off, got.setdefault("off", {}))):
        for i, (prompt, params) in enumerate(zip(batch, mixed, strict=True)):
            engine.add_request(f"m{i}", prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                for delta in out.deltas:
                    sink.setdefault(out.request_id, []).extend(
                        (lp.token_id, round(lp.logprob, 5), [(t, round(v, 5)) for t, v in lp.top])
                        for lp in delta.logprobs)
    assert got["on"] == got["off"]
    assert len(got["on"]["m0"]) == 10 and all(len(top) == 3 for _, _, top in got["on"]["m0"])
    assert not got["on"].get("m1") and all(top == [] for _, _, top in got["on"]["m2"])
    assert sum(seen) >= 5


def test_abort_and_arrival_while_a_step_is_in_flight(tiny_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference = {i: r.token_ids for i, r in enumerate(make_llm(tiny_dir, False).generate(prompts(4), greedy))}
    engine = make_llm(tiny_dir, True).engine
    batch = prompts(4)
    for i in range(3):
        engine.add_request(f"r{i}", batch[i], greedy)
    got: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            for delta in out.deltas:
                got.setdefault(out.request_id, []).extend(delta.token_ids)
        steps += 1
        if steps == 6:
            assert engine.in_flight is not None
            aborted = engine.abort("r1")
            assert aborted is not None and aborted.finished
            assert all(t >= 0 for t in aborted.deltas[-1].token_ids) if aborted.deltas else True
            engine.add_request("r3", batch[3], greedy)   # joins while a step is in flight
    assert got["r0"] == reference[0] and got["r2"] == reference[2] and got["r3"] == reference[3]
    assert got["r1"] == reference[1][:len(got["r1"])] and len(got["r1"]) < 20
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_under_a_small_cache(tiny_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    settings = dict(num_kv_blocks=14, enable_prefix_caching=False)
    on, a, b = run_both(tiny_dir, prompts(16), greedy, **settings)
    assert outputs(a) == outputs(b)
    assert on.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hashes_only_real_tokens(tiny_dir):
    """Blocks filled while a step is in flight are published with their real tokens: a later
    request sharing the generated text hits the cache and generates what a cold run does."""
    llm = make_llm(tiny_dir, True)
    first = llm.generate(prompts(1), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    follow = prompts(1)[0] + first.token_ids + [5, 6]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    warm = llm.generate(follow, greedy)[0]
    cold = make_llm(tiny_dir, False).generate(follow, greedy)[0]
    assert warm.num_cached_tokens >= 32 and warm.token_ids == cold.token_ids
