"""The sampler at every value the API admits: whatever the sampling fields (at their bounds or
random), greedy or sampled, it never raises and always returns a valid token id that respects
the request's bans; a row with no admissible token is reported, not drawn."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine.request.sampling_params import BANNED_BIAS, SamplingParams, SamplingParamsError
from engine.request.sequence import Sequence
from engine.worker.sampler import Sampler

EOS = 2
FLOAT_MAX = torch.finfo(torch.float32).max
TINY = [5e-324, 1e-300, 1e-154, 1e-45, 1e-38]


def bounded(lo: float, hi: float, extremes: list[float]) -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([lo, hi, *extremes]), st.floats(lo, hi, allow_nan=False))


temperature = bounded(0.0, 2.0, [1e-300, 1e-6, 1e-5, 1.0000001e-5, 1.999999])
top_p = st.one_of(st.sampled_from([1.0, 0.5, *TINY]), st.floats(0.0, 1.0, exclude_min=True))
top_k = st.one_of(st.sampled_from([-(2**70), -1, 0, 1, 2, 2**31, 2**70]), st.integers(-5, 400))
min_p = bounded(0.0, 1.0, TINY)
penalty = bounded(-2.0, 2.0, [-1e-300, 1e-300])
repetition = st.one_of(st.sampled_from([10.0, 1.0, *TINY]), st.floats(0.0, 10.0, exclude_min=True))


@st.composite
def requests(draw, vocab: int) -> tuple[SamplingParams, list[int], list[int]]:
    bias_value = st.one_of(st.sampled_from([-100.0, 100.0, -99.999]), st.floats(-100.0, 100.0))
    logit_bias = draw(st.dictionaries(st.integers(0, vocab - 1), bias_value, max_size=min(vocab, 12)))
    if draw(st.booleans()):   # ban all but a few tokens, the case OpenAI documents -100 for
        keep = draw(st.sets(st.integers(0, vocab - 1), min_size=1, max_size=3))
        logit_bias.update({t: BANNED_BIAS for t in range(vocab) if t not in keep})
    fields = dict(
        temperature=draw(temperature), top_p=draw(top_p), top_k=draw(top_k), min_p=draw(min_p),
        presence_penalty=draw(penalty), frequency_penalty=draw(penalty), repetition_penalty=draw(repetition),
        logit_bias=logit_bias, min_tokens=draw(st.integers(0, 3)), ignore_eos=draw(st.booleans()),
        seed=draw(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1))),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))), max_tokens=16)
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8))
    output = draw(st.lists(st.integers(0, vocab - 1), max_size=4))
    return SamplingParams(**fields), prompt, output


@st.composite
def batches(draw):
    vocab = draw(st.sampled_from([1, 2, 3, 17, 300]))
    rows = draw(st.lists(requests(vocab), min_size=1, max_size=5))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e30, 3e38]))
    return vocab, rows, scale


def make_seqs(rows) -> list[Sequence]:
    seqs = []
    for params, prompt, output in rows:
        seq = Sequence("r", prompt, params)
        for token in output:
            seq.append_token(token)
        seqs.append(seq)
    return seqs


def banned(params: SamplingParams) -> set[int]:
    return {t for t, bias in params.logit_bias.items() if bias <= BANNED_BIAS}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), seed=st.integers(0, 2**32 - 1))
def test_sampler_never_raises_and_returns_valid_tokens(batch, seed):
    vocab, rows, scale = batch
    for params, _, _ in rows:
        try:
            params.validate_for_vocab(vocab)
        except SamplingParamsError:
            assume(False)   # the server answers these 400 (tested in test_server_faults.py)
    torch.manual_seed(seed)
    # finite logits (a model's), up to float32's largest; the LM head may be wider than the vocabulary
    logits = (torch.randn(len(rows), vocab + 3, dtype=torch.float64) * scale).clamp(-FLOAT_MAX, FLOAT_MAX).float()
    seqs = make_seqs(rows)
    results = Sampler({EOS}, vocab)(logits, seqs)
    assert len(results) == len(rows)
    for result, (params, _, _) in zip(results, rows, strict=True):
        assert result.error is None
        assert 0 <= result.token_id < vocab
        assert result.token_id not in banned(params)
        if result.logprob is not None:
            assert math.isfinite(result.logprob.logprob) or result.logprob.logprob == -math.inf
            assert all(0 <= t < vocab for t, _ in result.logprob.top)


@settings(max_examples=200, deadline=None)
@given(batch=batches(), seed=st.integers(0, 2**32 - 1),
       poison=st.sampled_from([math.nan, math.inf, -math.inf]), fraction=st.floats(0.0, 1.0))
def test_nan_and_inf_logits_never_reach_a_draw(batch, seed, poison, fraction):
    vocab, rows, _ = batch
    for params, _, _ in rows:
        try:
            params.validate_for_vocab(vocab)
        except SamplingParamsError:
            assume(False)
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), vocab, generator=generator)
    logits[torch.rand(logits.shape, generator=generator) < fraction] = poison
    results = Sampler({EOS}, vocab)(logits, make_seqs(rows))
    for row, (result, (params, _, _)) in enumerate(zip(results, rows, strict=True)):
        assert 0 <= result.token_id < vocab
        values = logits[row].tolist()
        admissible = {t for t, v in enumerate(values) if not math.isnan(v) and v != -math.inf} - banned(params)
        assert (result.error is None) == bool(admissible)
        if result.error is None:
            assert result.token_id in admissible


@pytest.mark.parametrize("tiny", TINY)
@pytest.mark.parametrize("temperature", [2.0, 1.0, 1e-5 * 1.01])
def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(tiny, temperature):
    torch.manual_seed(0)
    logits = torch.randn(4, 49152)
    seqs = [Sequence("r", [1], SamplingParams(temperature=temperature, top_p=tiny, seed=i)) for i in range(4)]
    tokens = [r.token_id for r in Sampler({EOS}, 49152)(logits, seqs)]
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_above_the_vocabulary_is_the_vocabulary():
    logits = torch.zeros(1, 5)
    drawn = set()
    sampler = Sampler({EOS}, 5)
    for seed in range(200):
        seq = Sequence("r", [1], SamplingParams(top_k=2**70, seed=seed))
        drawn.add(sampler(logits, [seq])[0].token_id)
    assert drawn == set(range(5))


def test_every_token_banned_but_one_samples_that_one():
    vocab = 300
    bias = {t: -100.0 for t in range(vocab) if t != 123}
    logits = torch.randn(8, vocab) * 30
    logits[:, 123] = -1e4
    seqs = [Sequence("r", [1], SamplingParams(temperature=2.0, logit_bias=bias, seed=i)) for i in range(8)]
    assert {r.token_id for r in Sampler({EOS}, vocab)(logits, seqs)} == {123}


def test_min_tokens_yields_when_it_would_leave_no_token():
    bias = {t: -100.0 for t in range(10) if t != EOS}   # only EOS left, but min_tokens bans it
    seq = Sequence("r", [1], SamplingParams(temperature=0.0, logit_bias=bias, min_tokens=5))
    result = Sampler({EOS}, 10)(torch.randn(1, 10), [seq])[0]
    assert (result.token_id, result.error) == (EOS, None)


def test_a_row_with_nothing_admissible_is_reported_not_drawn():
    logits = torch.randn(3, 10)
    logits[1] = math.nan
    seqs = [Sequence("r", [1], SamplingParams(temperature=t, seed=1)) for t in (0.0, 1.0, 0.0)]
    results = Sampler({EOS}, 10)(logits, seqs)
    assert [r.error is None for r in results] == [True, False, True]
    assert results[0].token_id == logits[0].argmax().item()


def test_banning_the_whole_vocabulary_is_a_parameter_error():
    params = SamplingParams(logit_bias={t: -100.0 for t in range(10)})
    with pytest.raises(SamplingParamsError) as err:
        params.validate_for_vocab(10)
    assert err.value.param == "logit_bias"
    SamplingParams(logit_bias={t: -100.0 for t in range(9)}).validate_for_vocab(10)
