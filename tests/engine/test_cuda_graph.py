"""CUDA-graph bookkeeping that needs no GPU: bucket sizes, counter scaling, the CPU engine staying
eager. Capture and replay themselves are checked on the GPU (tests/engine/test_engine_gpu.py)."""
import pytest
import torch

from engine import LLM
from engine.worker.cuda_graph import graph_batch_sizes, scaled_counters
from tests.support.tiny_models import make_tiny_model


@pytest.mark.parametrize("max_batch, expected", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
    (48, [1, 2, 4, 8, 16, 32, 48]),
])
def test_graph_batch_sizes(max_batch, expected):
    assert graph_batch_sizes(max_batch) == expected


def test_every_batch_has_a_bucket():
    sizes = graph_batch_sizes(256)
    for batch in range(1, 257):
        bucket = next(b for b in sizes if b >= batch)
        assert bucket - batch < 16
    assert len(sizes) == 4 + 16


def test_counters_scale_host_floats_keep_device_tensors():
    device_count = torch.tensor(7)
    out = scaled_counters({"fdpp_rows_checked": 64.0, "ffd_blocks_kept": device_count}, 0.25)
    assert out["fdpp_rows_checked"] == 16.0
    assert out["ffd_blocks_kept"] is device_count


def test_cpu_engine_runs_eagerly_and_says_so(tmp_path):
    llm = LLM(model=make_tiny_model(tmp_path, "llama"), cuda_graphs=True, num_kv_blocks=64, gpu_vendor="cpu")
    assert llm.engine.runner.graphs is None
    assert "eager" in llm.engine.graphs_text and "cpu" in llm.engine.graphs_text
    with pytest.raises(ValueError, match="CUDA device"):
        llm.engine.runner.capture_decode_graphs(4, 128)


def _seq(seq_id_tokens: int, num_computed: int, table: list[int]):
    from engine.request.sampling_params import SamplingParams
    from engine.request.sequence import Sequence
    seq = Sequence("r", list(range(3, 3 + seq_id_tokens)), SamplingParams(max_tokens=1))
    seq.num_computed_tokens = num_computed
    seq.block_table = list(table)
    return seq


def test_staging_appends_pages_and_rebuilds_rows_that_change_owner():
    """A staging set's rows are only appended to while a row keeps its sequence; a new sequence in
    the row, or the same one after preemption, rewrites it."""
    from engine.worker.cuda_graph import _Staging

    st = _Staging(max_batch=4, max_blocks=8, pin=False)
    bs = 4
    a = _seq(10, 9, [5, 6, 7])          # position 9: page 7, row 1
    b = _seq(4, 3, [2])                  # position 3: page 2, row 3
    st.write([a, b], bs)
    assert st.np_tokens[:, :2].tolist() == [[a.token_ids[9], b.token_ids[3]], [9, 3], [7 * 4 + 1, 2 * 4 + 3]]
    assert st.np_seq_lens[:2].tolist() == [10, 4]
    assert st.np_block_tables[0, :3].tolist() == [5, 6, 7]
    # b grows a page; a keeps its row
    a.token_ids.append(11)
    a.num_computed_tokens = 10
    b.token_ids.append(12)
    b.num_computed_tokens = 4
    b.block_table.append(9)
    st.write([a, b], bs)
    assert st.np_block_tables[1, :2].tolist() == [2, 9]
    assert st.np_tokens[2, :2].tolist() == [7 * 4 + 2, 9 * 4 + 0]
    # rows swap owners: each row is rebuilt from its new sequence
    st.write([b, a], bs)
    assert st.np_block_tables[0, :2].tolist() == [2, 9]
    assert st.np_block_tables[1, :3].tolist() == [5, 6, 7]
    # a is preempted and recomputed into other pages: its row is rebuilt, not appended to
    a.num_preemptions += 1
    a.block_table = [1, 3, 0]
    st.write([b, a], bs)
    assert st.np_block_tables[1, :3].tolist() == [1, 3, 0]
    assert st.np_tokens[2, 1] == 0 * 4 + 2
    st.pad(2, 4)
    assert st.np_tokens[:, 2:4].tolist() == [[0, 0], [0, 0], [-1, -1]] and st.np_seq_lens[2:4].tolist() == [1, 1]


def test_a_step_replays_the_narrowest_captured_width_that_holds_it():
    """Backends may ask for graphs at several block-table widths (FFD's "auto"): a step takes the
    smallest batch bucket and the narrowest width that hold it; widths must ascend to the widest."""
    from engine.attention.torch_reference import ReferenceBackend
    from engine.worker.cuda_graph import DecodeGraphs

    class TwoWidths(ReferenceBackend):
        def decode_graph_widths(self, max_blocks: int) -> list[int]:
            return [3, max_blocks]

    graphs = DecodeGraphs(torch.nn.Identity(), TwoWidths("two"), torch.device("cpu"), max_batch=4, max_blocks=8)
    assert graphs.widths == [3, 8]
    graphs.graphs = {(b, w): None for b in graphs.batch_sizes for w in graphs.widths}
    assert graphs.bucket_for(3, 2) == (4, 3) and graphs.bucket_for(1, 3) == (1, 3)
    assert graphs.bucket_for(2, 4) == (2, 8) and graphs.bucket_for(1, 9) is None and graphs.bucket_for(5, 1) is None

    class Unordered(ReferenceBackend):
        def decode_graph_widths(self, max_blocks: int) -> list[int]:
            return [max_blocks, 3]

    with pytest.raises(ValueError, match="ascend"):
        DecodeGraphs(torch.nn.Identity(), Unordered("bad"), torch.device("cpu"), max_batch=4, max_blocks=8)


def test_graphs_alternate_staging_sets():
    """Consecutive steps stage into different pinned sets: with asynchronous scheduling step N+1 is
    written while step N's copies may still be pending."""
    from engine.worker.cuda_graph import DecodeGraphs

    graphs = DecodeGraphs(torch.nn.Identity(), None, torch.device("cpu"), max_batch=4, max_blocks=8)
    a = _seq(10, 9, [5, 6, 7])
    graphs.stage([a], 4)
    first = graphs.current
    a.token_ids.append(11)
    a.num_computed_tokens = 10
    graphs.stage([a], 4)
    assert graphs.current != first
    assert graphs.staging[first].np_tokens[1, 0] == 9 and graphs.staging[graphs.current].np_tokens[1, 0] == 10


def test_run_copies_the_staged_set_pads_and_overrides_token_ids():
    """`run` (with a stand-in graph: the copies and padding are what is checked) fills the static
    inputs from the current staging set, pads rows past the batch, and takes device token ids."""
    from engine.worker.cuda_graph import DecodeGraphs

    class Replayed:
        calls = 0

        def replay(self):
            Replayed.calls += 1

    graphs = DecodeGraphs(torch.nn.Identity(), None, torch.device("cpu"), max_batch=4, max_blocks=8)
    graphs.graphs, graphs.counters = {(2, 8): Replayed()}, {(2, 8): {"rows": 8.0}}
    graphs.logits = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    a = _seq(10, 9, [5, 6, 7])
    graphs.input_ids.fill_(99)   # stale values from an earlier, wider step
    graphs.stage([a], 4)
    logits, counters = graphs.run(1, 3, (2, 8), input_ids=torch.tensor([42]))
    assert Replayed.calls == 1 and logits.shape == (1, 5) and counters == {"rows": 4.0}
    assert graphs.input_ids[:2].tolist() == [42, 0] and graphs.positions[:2].tolist() == [9, 0]
    assert graphs.slot_mapping[:2].tolist() == [7 * 4 + 1, -1] and graphs.seq_lens[:2].tolist() == [10, 1]
    assert graphs.block_tables[0, :3].tolist() == [5, 6, 7] and graphs.block_tables[1, 0] == 0
