"""Sampler: greedy, penalties, logit_bias, min_tokens, top-k/p, min-p, seeds and logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence
from engine.worker.sampler import Sampler, _top_k_, _top_p_, _top_p_sorted_

EOS = 7


def make_seq(prompt: list[int], output: list[int] = (), choice_index: int = 0, **params) -> Sequence:
    seq = Sequence("req", prompt, SamplingParams(**params), choice_index=choice_index)
    for t in output:
        seq.append_token(t)
    return seq


def test_greedy_is_exact_argmax():
    torch.manual_seed(0)
    logits = torch.randn(65, 300)
    seqs = [make_seq([1, 2], temperature=0.0) for _ in range(65)]
    results = Sampler({EOS}, 300)(logits, seqs)
    assert [r.token_id for r in results] == logits.argmax(-1).tolist()
    assert all(r.logprob is None for r in results)


def test_process_logits_leaves_input_alone_and_is_identity_without_options():
    logits = torch.randn(2, 10)
    before = logits.clone()
    sampler = Sampler({EOS}, 10)
    assert sampler.process_logits(logits, [make_seq([1]), make_seq([2])]) is logits
    sampler.process_logits(logits, [make_seq([1], repetition_penalty=2.0, logit_bias={3: 5.0}, min_tokens=4),
                                    make_seq([2])])
    assert torch.equal(logits, before)


def test_repetition_penalty_hf_semantics_over_prompt_and_output():
    logits = torch.tensor([[1.0, 2.0, -1.0, 3.0, 0.5, -0.5]])
    seq = make_seq([1], [2, 2], repetition_penalty=2.0)
    out = Sampler({EOS}, 6).process_logits(logits, [seq])
    # token 1 (prompt, positive) is divided, token 2 (output, negative) multiplied, once each
    assert out.tolist() == [[1.0, 1.0, -2.0, 3.0, 0.5, -0.5]]


def test_presence_and_frequency_penalties_count_output_only():
    logits = torch.zeros(1, 6)
    seq = make_seq([3, 5], [3, 3, 4], presence_penalty=1.0, frequency_penalty=0.5)
    out = Sampler({EOS}, 6).process_logits(logits, [seq])
    assert out.tolist() == [[0.0, 0.0, 0.0, -2.0, -1.5, 0.0]]  # 5 is only in the prompt


def test_penalty_statistics_follow_new_tokens_between_steps():
    sampler = Sampler({EOS}, 6)
    seq = make_seq([0], [1], frequency_penalty=1.0)
    assert sampler.process_logits(torch.zeros(1, 6), [seq]).tolist() == [[0, -1, 0, 0, 0, 0]]
    seq.append_token(1)
    seq.append_token(2)
    assert sampler.process_logits(torch.zeros(1, 6), [seq]).tolist() == [[0, -2, -1, 0, 0, 0]]
    sampler.release(seq.seq_id)  # rebuilt from the sequence's tokens: same answer
    assert sampler.process_logits(torch.zeros(1, 6), [seq]).tolist() == [[0, -2, -1, 0, 0, 0]]


def test_penalties_only_touch_rows_that_ask_for_them():
    logits = torch.ones(3, 6)
    seqs = [make_seq([1]), make_seq([1], presence_penalty=2.0), make_seq([1], [1])]
    seqs[1].append_token(1)
    out = Sampler({EOS}, 6).process_logits(logits, seqs)
    assert out[0].tolist() == [1.0] * 6 and out[2].tolist() == [1.0] * 6
    assert out[1].tolist() == [1, -1, 1, 1, 1, 1]


def test_logit_bias_forces_and_bans():
    logits = torch.tensor([[5.0, 0.0, -3.0, 1.0]])
    sampler = Sampler({EOS}, 4)
    for seed in range(5):
        forced = make_seq([0], logit_bias={2: 100.0}, seed=seed)
        assert sampler(logits, [forced])[0].token_id == 2
    banned = make_seq([0], temperature=0.0, logit_bias={0: -100.0})
    assert sampler(logits, [banned])[0].token_id == 3


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 50.0
    logits[0, 3] = 40.0
    logits[0, 5] = 1.0
    sampler = Sampler({EOS}, 10)
    early = make_seq([1], [2], temperature=0.0, min_tokens=3, stop_token_ids=[3])
    assert sampler(logits, [early])[0].token_id == 5
    done = make_seq([1], [2, 2, 2], temperature=0.0, min_tokens=3, stop_token_ids=[3])
    assert sampler(logits, [done])[0].token_id == EOS
    ignoring = make_seq([1], [2], temperature=0.0, min_tokens=3, stop_token_ids=[3], ignore_eos=True)
    assert sampler(logits, [ignoring])[0].token_id == EOS  # EOS is an ordinary token then
    # a positive bias cannot lift the mask
    biased = make_seq([1], [2], temperature=0.0, min_tokens=3, logit_bias={EOS: 100.0})
    assert sampler(logits, [biased])[0].token_id == 3


def test_top_k_mask():
    weights = torch.tensor([[1.0, 4.0, 3.0, 2.0], [4.0, 3.0, 2.0, 1.0]])
    out = _top_k_(weights.clone(), torch.tensor([[2], [3]]))
    assert out.tolist() == [[0.0, 4.0, 3.0, 0.0], [4.0, 3.0, 2.0, 0.0]]


def test_top_p_mask_boundaries():
    weights = torch.tensor([[5.0, 3.0, 1.5, 0.5]])  # unnormalised: shares .5 .3 .15 .05

    def kept(p: float) -> list[bool]:
        return (_top_p_(weights.clone(), torch.tensor([[p]])) > 0).tolist()[0]

    assert kept(0.79) == [True, True, False, False]
    assert kept(0.81) == [True, True, True, False]
    assert kept(0.1) == [True, False, False, False]
    assert kept(1.0 - 1e-6) == [True, True, True, True]


def test_top_p_matches_a_full_sort_on_a_wide_flat_vocabulary():
    torch.manual_seed(1)
    x = torch.randn(3, 5000) * 0.3  # rows 0 and 2: nucleus far beyond the first candidate round
    x[1, 17] = 12.0  # row 1: a one-token nucleus, resolved in the first round
    top_p = torch.tensor([[0.9], [0.5], [0.99]])
    got = _top_p_(x.exp(), top_p) > 0
    probs = torch.softmax(x, -1)
    for row in range(3):
        sorted_p, order = probs[row].sort(descending=True)
        n_keep = int(((sorted_p.cumsum(0) - sorted_p) < top_p[row]).sum())
        want = torch.zeros(5000, dtype=torch.bool)
        want[order[:n_keep]] = True
        assert torch.equal(got[row], want)
        assert n_keep == 1 if row == 1 else n_keep > 64


def test_top_p_by_one_sort_equals_the_incremental_search():
    """The GPU's sync-free nucleus (one sort) keeps exactly what the CPU's incremental search keeps,
    ties and one-token nuclei included."""
    torch.manual_seed(4)
    x = torch.randn(6, 3000) * torch.tensor([[0.2], [1.0], [3.0], [0.05], [8.0], [0.5]])
    x[3, :40] = 2.0                      # a block of exact ties at the top
    x[4, 7] = 50.0                       # one token holds everything
    for top_p in (0.05, 0.5, 0.9, 0.999):
        p = torch.full((6, 1), top_p)
        a, b = _top_p_(x.exp(), p), _top_p_sorted_(x.exp(), p)
        assert torch.equal(a > 0, b > 0), f"top_p={top_p}: {(a > 0).sum(1).tolist()} vs {(b > 0).sum(1).tolist()}"


def draws(sampler: Sampler, logits: torch.Tensor, seq: Sequence, n: int = 300) -> set[int]:
    return {sampler(logits, [seq])[0].token_id for _ in range(n)}


def test_top_k_top_p_min_p_restrict_what_is_drawn():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    sampler = Sampler({EOS}, 4)
    assert draws(sampler, logits, make_seq([0], top_k=2, seed=1)) == {0, 1}
    assert draws(sampler, logits, make_seq([0], top_p=0.79, seed=2)) == {0, 1}
    assert draws(sampler, logits, make_seq([0], min_p=0.4, seed=3)) == {0, 1}  # floor 0.2
    assert draws(sampler, logits, make_seq([0], seed=4)) == {0, 1, 2, 3}
    # low temperature sharpens: draws concentrate on the argmax
    sharp = [sampler(logits, [make_seq([0], temperature=0.05)])[0].token_id for _ in range(50)]
    assert sharp.count(0) >= 49


def stream(seq: Sequence, others: list[Sequence], steps: int, vocab: int = 50) -> list[int]:
    """Tokens drawn for `seq` while sampled in a batch with `others`, on a flat distribution."""
    sampler = Sampler({EOS}, vocab)
    logits = torch.zeros(1 + len(others), vocab)
    out = []
    for _ in range(steps):
        results = sampler(logits, others + [seq])
        out.append(results[-1].token_id)
    return out


def test_seed_reproducible_regardless_of_batch():
    alone = stream(make_seq([1], seed=1234), [], 30)
    crowded = stream(make_seq([1], seed=1234), [make_seq([1]), make_seq([2], seed=99), make_seq([3], seed=1234,
                                                                                           choice_index=1)], 30)
    assert alone == crowded
    assert len(set(alone)) > 5
    assert stream(make_seq([1], seed=1235), [], 30) != alone


def test_n_choices_of_a_seeded_request_differ():
    first = stream(make_seq([1], seed=7, choice_index=0), [], 20)
    second = stream(make_seq([1], seed=7, choice_index=1), [], 20)
    assert first != second
    assert stream(make_seq([1], seed=7, choice_index=1), [], 20) == second


def test_generator_continues_until_released():
    sampler = Sampler({EOS}, 50)
    seq = make_seq([1], seed=5)
    logits = torch.zeros(1, 50)
    first = [sampler(logits, [seq])[0].token_id for _ in range(10)]
    more = [sampler(logits, [seq])[0].token_id for _ in range(10)]  # e.g. after a preemption
    assert first != more
    sampler.release(seq.seq_id)
    assert [sampler(logits, [seq])[0].token_id for _ in range(10)] == first


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(3)
    logits = torch.randn(3, 40)
    seqs = [make_seq([1], logprobs=3, temperature=0.7, repetition_penalty=1.5, presence_penalty=1.0),
            make_seq([2]),
            make_seq([3], [4], temperature=0.0, logprobs=0, logit_bias={5: 30.0})]
    results = Sampler({EOS}, 40)(logits, seqs)
    ref = torch.log_softmax(logits, -1)
    first = results[0].logprob
    assert first.token_id == results[0].token_id
    assert math.isclose(first.logprob, ref[0, first.token_id].item(), rel_tol=1e-5, abs_tol=1e-6)
    top_v, top_i = ref[0].topk(3)
    assert [t for t, _ in first.top] == top_i.tolist()
    assert [v for _, v in first.top] == pytest.approx(top_v.tolist(), abs=1e-6)
    assert results[1].logprob is None
    third = results[2].logprob
    assert results[2].token_id == 5 and third.top == []
    assert math.isclose(third.logprob, ref[2, 5].item(), rel_tol=1e-5, abs_tol=1e-6)


def test_padded_lm_head_columns_are_never_chosen():
    logits = torch.zeros(2, 12)
    logits[:, 10:] = 100.0
    results = Sampler({EOS}, 10)(logits, [make_seq([1], temperature=0.0), make_seq([1], seed=0, logprobs=2)])
    assert all(r.token_id < 10 for r in results)
    assert all(t < 10 for t, _ in results[1].logprob.top)


def test_filters_apply_to_their_own_rows_in_a_mixed_batch():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(4, 1)
    sampler = Sampler({EOS}, 4)
    seqs = [make_seq([0], top_k=1, seed=1), make_seq([0], seed=2), make_seq([0], top_p=0.6, seed=3),
            make_seq([0], min_p=0.5, temperature=0.0), make_seq([0], min_p=0.5, seed=4)]
    seen = [set() for _ in seqs]
    for _ in range(300):
        for i, r in enumerate(sampler(torch.cat([logits, logits[:1]]), seqs)):
            seen[i].add(r.token_id)
    assert seen == [{0}, {0, 1, 2, 3}, {0, 1}, {0}, {0, 1}]
