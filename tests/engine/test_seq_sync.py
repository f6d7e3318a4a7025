"""The ranks' copies of the scheduled sequences follow rank 0's from updates that carry only what changed."""
from __future__ import annotations

from engine.parallel.seq_sync import SeqEncoder, SeqMirror
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence


def _seq(prompt: list[int], prompt_logprobs: int | None = None) -> Sequence:
    return Sequence("r", prompt, SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs))


def _same(mirror: Sequence, seq: Sequence) -> None:
    assert mirror.seq_id == seq.seq_id
    assert (mirror.token_ids, mirror.block_table, mirror.num_prompt_tokens, len(mirror)) == \
        (seq.token_ids, seq.block_table, seq.num_prompt_tokens, len(seq))
    assert (mirror.num_computed_tokens, mirror.num_scheduled_tokens, mirror.num_preemptions) == \
        (seq.num_computed_tokens, seq.num_scheduled_tokens, seq.num_preemptions)
    assert mirror.needs_prompt_logprobs == seq.needs_prompt_logprobs


def test_decode_steps_send_only_the_new_token_and_page() -> None:
    encoder, mirror = SeqEncoder(), SeqMirror()
    seq = _seq(list(range(20)))
    seq.block_table = [7, 3]
    seq.num_scheduled_tokens = 20
    (update,) = encoder.encode([seq])
    assert update.new and update.new_table and update.token_ids == list(range(20)) and update.block_ids == [7, 3]
    (copy,) = mirror.apply([update])
    _same(copy, seq)
    for step in range(14):   # decode: one token a step, a page every 16 tokens
        seq.num_computed_tokens = len(seq)
        seq.append_token(100 + step)
        seq.num_scheduled_tokens = 1
        if len(seq) > 16 * len(seq.block_table):
            seq.block_table.append(40 + step)
        (update,) = encoder.encode([seq])
        assert not update.new and update.token_ids == [100 + step]
        assert update.block_ids == ([40 + step] if len(seq.block_table) == 3 and len(seq) == 33 else [])
        (copy,) = mirror.apply([update])
        _same(copy, seq)


def test_preemption_and_a_step_sat_out_resend_the_whole_sequence() -> None:
    encoder, mirror = SeqEncoder(), SeqMirror()
    a, b = _seq([1, 2, 3]), _seq([4, 5, 6, 7], prompt_logprobs=2)
    a.block_table, b.block_table = [0], [1]
    b.prompt_logprobs.append(None)   # one prompt position scored so far: still needs prompt logprobs
    mirror.apply(encoder.encode([a, b]))
    a.block_table = []               # the block manager frees a preempted sequence's pages: a new list
    a.block_table.append(5)
    a.num_preemptions, a.num_computed_tokens = 1, 0
    (update,) = encoder.encode([a])  # b sits this step out
    assert update.new_table and update.block_ids == [5] and not update.new
    (copy,) = mirror.apply([update])
    _same(copy, a)
    b.append_token(9)
    updates = encoder.encode([a, b])
    assert updates[1].new and updates[1].token_ids == [4, 5, 6, 7, 9]   # b was forgotten: sent whole
    copies = mirror.apply(updates)
    _same(copies[0], a)
    _same(copies[1], b)
    assert copies[1].needs_prompt_logprobs


def test_an_update_for_a_sequence_the_rank_does_not_hold_is_an_error() -> None:
    import pytest

    encoder, mirror = SeqEncoder(), SeqMirror()
    seq = _seq([1, 2])
    seq.block_table = [0]
    encoder.encode([seq])             # the ranks never received this message
    with pytest.raises(RuntimeError, match="does not hold"):
        mirror.apply(encoder.encode([seq]))
