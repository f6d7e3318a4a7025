"""Scheduler: token budget, decodes first, chunked prefill, preemption by recompute."""
from engine.core.block_manager import BlockManager
from engine.request.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.request.sequence import Sequence


def run_step(sched: Scheduler, next_token: int = 1) -> list[Sequence]:
    out = sched.schedule()
    for seq in out.scheduled:
        seq.num_computed_tokens += seq.num_scheduled_tokens
        sched.block_manager.register_full_blocks(seq)
        if seq.num_computed_tokens == len(seq):
            seq.append_token(next_token)
    return out.scheduled


def test_chunked_prefill_respects_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    seq = Sequence("a", list(range(25)), SamplingParams())
    sched.add(seq)
    sizes = []
    for _ in range(3):
        run_step(sched)
        sizes.append(seq.num_computed_tokens)
    assert sizes == [10, 20, 25]
    assert len(seq) == 26  # sampled once the prompt completed


def test_decodes_go_first_then_prefill_chunks():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    a = Sequence("a", list(range(3)), SamplingParams())
    sched.add(a)
    run_step(sched)  # a prefilled, now decoding
    b = Sequence("b", list(range(20)), SamplingParams())
    sched.add(b)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert a.num_scheduled_tokens == 1 and b.num_scheduled_tokens == 7


def test_preemption_when_blocks_run_out_and_everything_completes():
    bm = BlockManager(6, 4)  # 24 token slots
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [Sequence(str(i), list(range(i * 10, i * 10 + 7)), SamplingParams()) for i in range(3)]
    for s in seqs:
        sched.add(s)
    finished = set()
    for _ in range(200):
        for s in run_step(sched):
            if s.num_output_tokens >= 6 and s.num_computed_tokens == len(s) - 1:
                sched.finish(s)
                finished.add(s.request_id)
        if not sched.has_unfinished():
            break
    assert finished == {"0", "1", "2"}
    assert sched.num_preemptions > 0
    assert bm.num_free_blocks == bm.num_blocks


def test_max_num_seqs_limits_admission():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add(Sequence(str(i), [1, 2, 3], SamplingParams()))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2
