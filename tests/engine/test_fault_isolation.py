"""A failure inside a step ends only the request it belongs to: the others finish with the tokens
of a clean run, every KV block is free afterwards, and a device error stops the engine.

Faults are injected by wrapping the engine's own runner / sampler / detokenizer calls, so the
production path is what runs around them."""
import dataclasses
import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.faults import EngineUnrecoverable
from tests.support.tiny_models import make_tiny_model

NUM_REQUESTS = 16
CULPRIT = 7          # prompt index whose request the fault belongs to
FAULT_AFTER = 3      # output tokens the culprit has before its part of a step fails


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_faults"), "llama", num_layers=2)


def make_llm(tiny_dir, **overrides):
    # float32: these tests compare tokens across batch shapes exactly, which bf16's rounding breaks
    settings = dict(block_size=16, max_num_batched_tokens=512, cpu_kv_cache_bytes=32 << 20,
                    async_scheduling=False, cpu_weight_dtype="float32")
    return LLM(model=tiny_dir, **{**settings, **overrides})


def prompts(n=NUM_REQUESTS):
    return [[(11 * i + 3 * j) % 250 + 3 for j in range(4 + 5 * i)] for i in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def culprit_id(llm, seqs):
    """The request id of the culprit prompt among `seqs`, once it has FAULT_AFTER tokens."""
    culprit_prompt = prompts()[CULPRIT]
    for seq in seqs:
        if seq.token_ids[:seq.num_prompt_tokens] == culprit_prompt and seq.num_output_tokens >= FAULT_AFTER:
            return seq.request_id
    return None


def wrap_execute(llm, fault):
    """Make the runner raise `fault` for any forward that includes the culprit's row."""
    runner = llm.engine.runner
    execute, calls = runner.execute, []

    def faulty(seqs, input_ids=None):
        calls.append(len(seqs))
        if culprit_id(llm, seqs) is not None:
            raise fault
        return execute(seqs, input_ids)
    runner.execute = faulty
    return calls


def assert_all_blocks_free(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting
    assert not llm.engine.output_processor.requests and not llm.engine.output_processor.failed


def check_isolated(clean, faulty, stage, llm):
    for i, (a, b) in enumerate(zip(clean, faulty, strict=True)):
        if i == CULPRIT:
            assert b.finish_reason == "error"
            assert len(b.token_ids) == FAULT_AFTER   # what it had before its failing step
        else:
            assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason), f"request {i} changed"
    assert llm.engine.stats().internal_errors == {stage: 1}
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_forward_fault_ends_only_its_request(tiny_dir, async_scheduling):
    clean = make_llm(tiny_dir, async_scheduling=async_scheduling).generate(prompts(), GREEDY)
    llm = make_llm(tiny_dir, async_scheduling=async_scheduling)
    calls = wrap_execute(llm, ValueError("injected forward fault"))
    faulty = llm.generate(prompts(), GREEDY)
    check_isolated(clean, faulty, "forward", llm)
    assert NUM_REQUESTS in calls, "the culprit's step was batched with the others"
    assert 1 in calls, "the culprit was found by running parts of the batch"


def test_a_sampler_fault_ends_only_its_request_and_seeded_rows_draw_as_clean(tiny_dir):
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    clean = make_llm(tiny_dir).generate(prompts(), seeded)
    llm = make_llm(tiny_dir)
    sampler = llm.engine.sampler
    process = sampler.process_logits

    def faulty(logits, seqs):
        if culprit_id(llm, seqs) is not None:
            raise IndexError("injected sampler fault")
        return process(logits, seqs)
    sampler.process_logits = faulty
    check_isolated(clean, llm.generate(prompts(), seeded), "sampling", llm)


def test_a_detokenizer_fault_ends_only_its_request(tiny_dir):
    clean = make_llm(tiny_dir).generate(prompts(), GREEDY)
    llm = make_llm(tiny_dir)
    engine = llm.engine
    add_request = engine.add_request

    def add(request_id, prompt, params):
        add_request(request_id, prompt, params)
        if prompt == prompts()[CULPRIT]:
            detokenizer = engine.output_processor.requests[request_id].choices[0].detokenizer
            add_tokens, seen = detokenizer.add_tokens, []

            def faulty(ids):
                seen.extend(ids)
                if len(seen) > FAULT_AFTER:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
                return add_tokens(ids)
            detokenizer.add_tokens = faulty
    engine.add_request = add
    faulty = llm.generate(prompts(), GREEDY)
    for i, (a, b) in enumerate(zip(clean, faulty, strict=True)):
        if i != CULPRIT:
            assert (b.token_ids, b.text) == (a.token_ids, a.text)
    assert faulty[CULPRIT].finish_reason == "error"
    assert engine.stats().internal_errors == {"output": 1}
    assert_all_blocks_free(llm)


def test_nan_logits_in_one_row_end_that_request(tiny_dir):
    clean = make_llm(tiny_dir).generate(prompts(), GREEDY)
    llm = make_llm(tiny_dir)
    runner = llm.engine.runner
    execute = runner.execute

    def nan_row(seqs, input_ids=None):
        result = execute(seqs, input_ids)
        sampled = result.sampled_seqs
        if culprit_id(llm, sampled) is not None:
            row = [s.request_id for s in sampled].index(culprit_id(llm, sampled))
            logits = result.logits.clone()
            logits[row] = math.nan
            return dataclasses.replace(result, logits=logits)
        return result
    runner.execute = nan_row
    check_isolated(clean, llm.generate(prompts(), GREEDY), "no_admissible_token", llm)


def test_a_fault_of_the_whole_batch_runs_it_in_halves(tiny_dir):
    clean = make_llm(tiny_dir).generate(prompts(), GREEDY)
    llm = make_llm(tiny_dir)
    runner = llm.engine.runner
    execute, sizes = runner.execute, []

    def too_big(seqs, input_ids=None):   # as running out of memory at a batch size would
        sizes.append(len(seqs))
        if len(seqs) > 8:
            raise torch.OutOfMemoryError("injected: out of memory for a wide batch")
        return execute(seqs, input_ids)
    runner.execute = too_big
    out = llm.generate(prompts(), GREEDY)
    assert all(r.finish_reason == "length" and len(r.token_ids) == GREEDY.max_tokens for r in out)
    if llm.engine.dtype == torch.float32:   # halves of a batch give the same rows only in float32
        assert [r.token_ids for r in out] == [r.token_ids for r in clean]
    assert 8 in sizes and llm.engine.stats().internal_errors == {}
    assert_all_blocks_free(llm)


def test_a_device_error_stops_the_engine(tiny_dir):
    llm = make_llm(tiny_dir)
    wrap_execute(llm, RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(EngineUnrecoverable) as err:
        llm.generate(prompts(), GREEDY)
    assert err.value.reason == "device_error"


def test_out_of_memory_with_one_row_stops_the_engine(tiny_dir):
    llm = make_llm(tiny_dir)
    runner = llm.engine.runner

    def always(seqs, input_ids=None):
        raise torch.OutOfMemoryError("injected: out of memory")
    runner.execute = always
    with pytest.raises(EngineUnrecoverable) as err:
        llm.generate(prompts(2), GREEDY)
    assert err.value.reason == "out_of_memory"


def test_every_request_failing_stops_the_engine(tiny_dir):
    llm = make_llm(tiny_dir)
    sampler = llm.engine.sampler

    def broken(logits, seqs):
        raise IndexError("injected: the draw is broken for everyone")
    sampler.process_logits = broken
    with pytest.raises(EngineUnrecoverable) as err:
        llm.generate(prompts(40), GREEDY)
    assert err.value.reason == "every_request_failing"
    assert llm.engine.stats().internal_errors == {"sampling": 32}
