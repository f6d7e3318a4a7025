"""kernel = "ffd" in the engine on CPU (torch rule): it really prunes, and every serving path
(chunked prefill, prefix-cache hit, multi-turn, preemption + recompute, mixed batches) gives the
tokens of a cold, unchunked, solo run."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.select import make_attention_backend
from engine.config import FlashDecodingConfig
from tests.support.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0)
# A random tiny model attends almost uniformly; a small δ still prunes ~5 % of its blocks, and
# FFD's output then differs from dense attention, so the equalities below are not vacuous.
FFD = dict(kernel="ffd", ffd_block_size=64, delta=0.5, sink_tokens=4, local_window=64)
# The tiny model's head_dim (16) is below the FFD Triton kernel's minimum (64), which the engine
# refuses at startup on a GPU; the kernel itself is checked on the GPU by tests/kernels/test_ffd_kernels.py.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tiny model head_dim 16 < FFD kernel minimum 64")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from safetensors.torch import load_file, save_file
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_ffd"), "llama", num_layers=2)
    weights = load_file(path / "model.safetensors")
    for name in weights:                                      # sharper attention: larger logits
        if "q_proj" in name or "k_proj" in name:
            weights[name] = weights[name] * 3
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def same(a, b):
    """Same tokens, and logprobs equal up to float32 rounding of different reduction orders."""
    assert a.token_ids == b.token_ids
    la = [x.logprob for x in a.outputs[0].logprobs]
    lb = [x.logprob for x in b.outputs[0].logprobs]
    assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 1e-4


def make_llm(tiny_dir, **overrides):
    # float32: these tests compare logits across batch shapes to 1e-4, which bf16's rounding breaks
    settings = dict(max_num_batched_tokens=1024, cpu_kv_cache_bytes=64 << 20, cpu_weight_dtype="float32", **FFD)
    return LLM(model=tiny_dir, **{**settings, **overrides})


def prompt(n, salt=0):
    return [(7 * j + 13 * salt + j * j % 11) % 250 + 3 for j in range(n)]


def test_ffd_engine_prunes_and_names_itself(tiny_dir):
    llm = make_llm(tiny_dir)
    assert "Faster Flash Decoding" in llm.engine.backend.name and "torch reference" in llm.engine.backend.name
    assert llm.engine.block_manager.block_size == 64              # a page is one quantization block
    llm.generate(prompt(300), GREEDY)
    counters = llm.engine.stats().attention_counters
    total, kept = counters["ffd_blocks_total"], counters["ffd_blocks_kept"]
    assert total > 0 and 0 < kept < total, counters


def test_chunked_prefill_and_mixed_batch_equal_solo_cold_runs(tiny_dir):
    prompts = [prompt(300, 1), prompt(190, 2), prompt(65, 3), prompt(7, 4)]
    solo = [make_llm(tiny_dir, enable_prefix_caching=False).generate(p, GREEDY)[0] for p in prompts]
    batched = make_llm(tiny_dir, enable_prefix_caching=False).generate(prompts, GREEDY)
    chunked = make_llm(tiny_dir, enable_prefix_caching=False, max_num_batched_tokens=48).generate(prompts, GREEDY)
    for a, b, c in zip(solo, batched, chunked, strict=True):
        same(a, b)
        same(a, c)
    dense = LLM(model=tiny_dir, cpu_kv_cache_bytes=64 << 20, cpu_weight_dtype="float32").generate(prompts[0], GREEDY)[0]
    assert dense.token_ids != solo[0].token_ids                 # pruning really changed the output


def test_prefix_hit_and_multi_turn_equal_cold_runs(tiny_dir):
    llm = make_llm(tiny_dir)
    first = prompt(200, 5)
    long_answer = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=0)
    turn1 = llm.generate(first, long_answer)[0]
    # turn 2 = turn 1 prompt + its answer + a new message; page 3 (tokens 192..255) was filled by
    # decode steps and is reused from the prefix cache
    second = first + turn1.token_ids + prompt(30, 6)
    warm = llm.generate(second, GREEDY)[0]
    assert warm.num_cached_tokens == 256
    cold = make_llm(tiny_dir, enable_prefix_caching=False).generate(second, GREEDY)[0]
    same(warm, cold)
    again = llm.generate(first, long_answer)[0]                  # a pure prefix hit
    assert again.num_cached_tokens == 192
    same(again, turn1)


def test_preemption_and_recompute_equal_an_undisturbed_run(tiny_dir):
    prompts = [prompt(150 + 20 * i, 10 + i) for i in range(4)]
    reference = make_llm(tiny_dir, enable_prefix_caching=False).generate(prompts, GREEDY)
    small = make_llm(tiny_dir, enable_prefix_caching=False, num_kv_blocks=9)
    results = small.generate(prompts, GREEDY)
    assert small.engine.scheduler.num_preemptions > 0
    for a, b in zip(results, reference, strict=True):
        same(a, b)


def test_auto_needs_a_measured_crossover_and_ffd_units_are_explicit():
    with pytest.raises(ValueError, match="crossover"):
        make_attention_backend(FlashDecodingConfig(kernel="auto"), torch.device("cpu"), "cpu")
    e = make_attention_backend(FlashDecodingConfig(kernel="ffd", delta=5.0), torch.device("cpu"), "cpu")
    two = make_attention_backend(FlashDecodingConfig(kernel="ffd", delta=5.0, delta_units="2"),
                                 torch.device("cpu"), "cpu")
    assert "natural log" in e.name and "7.213 in log2" in e.name and "log2 units" in two.name
    off = make_attention_backend(FlashDecodingConfig(kernel="ffd", enable=False), torch.device("cpu"), "cpu")
    assert "standard attention" in off.name                     # enable = false wins, as documented


def test_auto_crossover_from_config_and_its_error_names_the_key():
    """`ffd_crossover_tokens` serves a device with no stored measurement (here the CPU); without it
    the startup error says which key to set and how to measure it; 0 is refused."""
    with pytest.raises(ValueError, match="ffd_crossover_tokens.*--crossover|--crossover.*ffd_crossover_tokens"):
        make_attention_backend(FlashDecodingConfig(kernel="auto"), torch.device("cpu"), "cpu")
    backend = make_attention_backend(FlashDecodingConfig(kernel="auto", ffd_crossover_tokens=3000),
                                     torch.device("cpu"), "cpu")
    assert backend.params.min_ffd_len == 3000 and "dense Flash-Decoding below 3000" in backend.name
    with pytest.raises(ValueError, match="ffd_crossover_tokens"):
        FlashDecodingConfig(kernel="auto", ffd_crossover_tokens=0)


def test_auto_with_crossover_switches_per_sequence(tiny_dir):
    backend = make_attention_backend(FlashDecodingConfig(kernel="auto", ffd_block_size=64, delta=1.0),
                                     torch.device("cpu"), "cpu", crossover=256)
    assert backend.params.min_ffd_len == 256 and "dense Flash-Decoding below 256" in backend.name


def test_auto_steps_below_the_crossover_run_the_flash_backend(tiny_dir):
    """kernel = "auto": a step whose block table is too narrow for any row to reach the crossover
    runs the Flash-Decoding backend, prefill and decode (the tokens of kernel = "flash"); a wider
    step runs the FFD rule (it prunes) and never calls it. Graphs are captured at that width too."""
    auto = make_llm(tiny_dir, kernel="auto", ffd_crossover_tokens=256)
    backend = auto.engine.backend
    assert backend.dense is not None and "Flash-Decoding split-KV" in backend.dense.name
    assert backend.dense_width == 3                              # (256 - 1) // 64: rows of <= 192 tokens
    assert backend.decode_graph_widths(10) == [3, 10] and backend.decode_graph_widths(3) == [3]
    widths: dict[str, list[int]] = {"decode": [], "prefill": []}

    def spy(kind, fn):
        def call(layer_idx, q, k_cache, v_cache, metadata, **kwargs):
            widths[kind].append(metadata.block_tables.shape[1])
            return fn(layer_idx, q, k_cache, v_cache, metadata, **kwargs)
        return call

    backend.dense.decode = spy("decode", backend.dense.decode)
    backend.dense.prefill = spy("prefill", backend.dense.prefill)
    short = prompt(150)                                           # 150 + 30 tokens: 3 pages
    same(auto.generate(short, GREEDY)[0], make_llm(tiny_dir, kernel="flash").generate(short, GREEDY)[0])
    assert widths == {"decode": [3] * (2 * 29), "prefill": [3, 3]}   # 2 layers; every decode step
    assert auto.engine.stats().attention_counters.get("ffd_blocks_total", 0) == 0
    auto.generate(prompt(300, salt=1), GREEDY)                    # 5+ pages: the FFD rule, which prunes here
    counters = auto.engine.stats().attention_counters
    assert len(widths["decode"]) == 2 * 29 and len(widths["prefill"]) == 2
    assert 0 < counters["ffd_blocks_kept"] < counters["ffd_blocks_total"]
    ffd = make_llm(tiny_dir).engine.backend
    assert ffd.dense is None and ffd.dense_width == 0 and ffd.decode_graph_widths(10) == [10]


def test_auto_where_ffd_never_won_is_flash_decoding():
    from engine.attention.dense import DenseBackend
    from engine.attention.ffd import NEVER
    backend = make_attention_backend(FlashDecodingConfig(kernel="auto"), torch.device("cpu"), "cpu", crossover=NEVER)
    assert "Flash-Decoding split-KV" in backend.name and isinstance(backend, DenseBackend)


def test_quality_harness_runs_dense_and_ffd_over_one_cache(tiny_dir):
    """bench/ffd_quality.py's Runner (a chunked prefill over its own full-layout cache) with the dense
    rule and with FFD at δ = ∞: the same logits up to the quantized keys' error, and not identical
    (the FFD rule really ran over the 2-bit + residual keys of the full blocks)."""
    from bench.ffd_quality import Runner, ffd_config
    from engine.attention.torch_reference import ReferenceBackend
    from engine.model.loader import load_model

    model = load_model(tiny_dir, torch.float32, torch.device("cpu"))
    runner = Runner(model)
    ids = torch.randint(3, 250, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    dense, kv = runner.run(ids, ReferenceBackend("dense"), logits_from=200, chunk=128)
    ffd, _ = runner.run(ids, make_attention_backend(ffd_config(1e9), torch.device("cpu"), "cpu"), logits_from=200,
                        chunk=128)
    assert dense.shape == ffd.shape == (100, model.compute_logits(torch.zeros(1, 64)).shape[-1])
    assert kv.shape[2] == 3                                   # 300 tokens in pages of 128
    err = float((ffd - dense).norm() / dense.norm())
    assert 0 < err < 5e-2, err


def test_quality_harness_scores_free_running_agreement_per_position():
    """bench/ffd_quality.py's free-running score: position-wise agreement per prompt, the common
    prefix (where the two continuations part), and their mean / minimum over prompts."""
    from bench.ffd_quality import generated_agreement
    got = generated_agreement([0, 7], [[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert got["per_prompt"] == [{"start": 0, "agreement": 0.75, "common_prefix": 2},
                                 {"start": 7, "agreement": 1.0, "common_prefix": 4}]
    assert got["agreement"] == 0.875 and got["common_prefix"] == 2
