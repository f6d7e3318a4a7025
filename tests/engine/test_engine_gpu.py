"""The engine on a GPU: every decode variant's Triton path against the torch reference inside a
real model (paged, mixed prefill/decode steps), and the whole engine (batching, prefix cache,
chunked prefill) end to end. Skipped without CUDA."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")

VARIANTS = {
    "standard": dict(enable=False),
    "flash": dict(enable=True, kernel="flash"),
    "fdpp": dict(enable=True, kernel="flash", async_softmax=True),
}


def fd_settings(**kw):
    base = dict(enable=True, kernel="flash", async_softmax=False, fixed_max_value=False,
                fallback_on_overflow=True, num_splits=0, calibration_file=None)
    return SimpleNamespace(**{**base, **kw})


def hf_config(head_dim: int):
    import transformers as tf
    heads = 1024 // head_dim
    return tf.LlamaConfig(vocab_size=259, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                          num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                          max_position_embeddings=8192, bos_token_id=257, eos_token_id=258, pad_token_id=256)


def random_model(head_dim: int):
    from engine.model.llama import LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(hf_config(head_dim), torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_reference_in_model(variant, head_dim):
    from engine.attention.select import make_attention_backend
    from engine.attention.torch_reference import ReferenceBackend
    from tests.support.model_driver import PagedModelDriver

    model = random_model(head_dim)
    backend = make_attention_backend(fd_settings(**VARIANTS[variant]), torch.device("cuda"), "auto")
    ours = PagedModelDriver(model, num_blocks=512, block_size=16, backend=backend, seed=1)
    ref = PagedModelDriver(model, num_blocks=512, block_size=16, backend=ReferenceBackend(), seed=1)
    gen = torch.Generator().manual_seed(2)
    lengths = {0: 1000, 1: 2049, 2: 333}
    steps = [{s: torch.randint(3, 250, (n,), generator=gen).tolist() for s, n in lengths.items()},
             {0: [5], 1: torch.randint(3, 250, (100,), generator=gen).tolist(), 2: [7]}]
    for _ in range(8):
        steps.append({s: [int(torch.randint(3, 250, (1,), generator=gen))] for s in lengths})
    for batch in steps:
        a, b = ours.step(batch), ref.step(batch)
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 2e-2, f"{variant} D={head_dim}: relative logits error {rel:.3e}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    import transformers as tf

    from engine.model.llama import LlamaForCausalLM  # noqa: F401  (import check)
    from tests.support.tiny_models import make_byte_tokenizer
    path = tmp_path_factory.mktemp("gpu_model")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(hf_config(64))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(path))
    make_byte_tokenizer(path)
    return path


def assert_equal_or_near_tie(a, b, tol: float = 0.05) -> None:
    """Greedy outputs agree, or first differ where the two candidates were within `tol` nats in
    run `a` (a near-tie that float rounding, e.g. atomics' summation order, may flip)."""
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):  # the lengths are compared below
        if x != y:
            top = dict(a.outputs[0].logprobs[i].top)
            assert y in top and top[x] - top[y] < tol, (
                f"outputs diverge at token {i} without a near-tie: {x} ({top.get(x)}) vs {y} ({top.get(y)})")
            return
    assert len(a.token_ids) == len(b.token_ids)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_end_to_end_on_gpu(model_dir, variant):
    from engine import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", block_size=16, max_num_batched_tokens=512,
              num_kv_blocks=2048, **VARIANTS[variant])
    assert "triton" in llm.engine.backend.name
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (int(n),), generator=gen).tolist() for n in (5, 17, 300, 1025, 64, 2000, 129, 900)]
    together = llm.generate(prompts, params)
    alone = [llm.generate(p, params)[0] for p in prompts]  # now with prefix-cache hits
    for a, b in zip(together, alone, strict=True):
        assert_equal_or_near_tie(a, b)
    exact = sum(a.token_ids == b.token_ids for a, b in zip(together, alone, strict=True))
    assert exact >= len(prompts) - 2, f"only {exact}/{len(prompts)} outputs identical"
    assert sum(r.num_cached_tokens for r in alone) > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_cudnn_prefix_prefill_matches_the_kernel_alone(model_dir, monkeypatch):
    """bf16, prompts chunked at 1024 tokens: later chunks attend their prefix through cuDNN (where this GPU
    has it; the threshold lowered to 1024 keys for this model's 8K positions) and continue in the paged
    kernel; the greedy tokens are those of the kernel alone."""
    import dataclasses

    from engine import LLM, SamplingParams
    from kernels import vendor

    nvidia = vendor._CONFIGS["nvidia"]
    monkeypatch.setitem(vendor._CONFIGS, "nvidia", dataclasses.replace(
        nvidia, prefill=dataclasses.replace(nvidia.prefill, prefix_min_keys=1024)))

    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 250, (int(n),), generator=gen).tolist() for n in (2100, 4099, 3000)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    runs = {}
    for choice in ("auto", "kernel"):
        llm = LLM(model=model_dir, dtype="bfloat16", block_size=16, max_num_batched_tokens=1024,
                  num_kv_blocks=2048, enable_prefix_caching=False, prefill_prefix=choice)
        runs[choice] = (llm.generate(prompts, params), llm.engine.backend.name)
        del llm
    from kernels.attention.prefix import cudnn_prefix_available
    if cudnn_prefix_available(torch.bfloat16, torch.bfloat16, 64, torch.device("cuda")):
        assert "cuDNN" in runs["auto"][1] and "1024 keys" in runs["auto"][1]
    assert "cuDNN" not in runs["kernel"][1]
    for a, b in zip(runs["auto"][0], runs["kernel"][0], strict=True):
        assert_equal_or_near_tie(a, b)


def test_sampling_features_on_gpu(model_dir):
    """Every sampler feature runs with GPU logits; seeded requests repeat; greedy is argmax."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", num_kv_blocks=512)
    prompt = [list(range(3, 40))]
    rich = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, presence_penalty=0.5,
                          frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={7: 3.0}, seed=11,
                          logprobs=3, max_tokens=12, min_tokens=4, ignore_eos=True, n=2)
    first = llm.generate(prompt, rich)[0]
    again = llm.generate(prompt, rich)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert all(len(c.token_ids) == 12 and len(c.logprobs) == 12 for c in first.outputs)
    assert all(len(lp.top) == 3 and lp.logprob <= 0.0 for c in first.outputs for lp in c.logprobs)
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True))[0]
    assert all(lp.top[0][0] == t for lp, t in zip(greedy.outputs[0].logprobs, greedy.token_ids, strict=True))


# "auto" with a crossover of 1024 tokens: steps whose tables are <= 7 pages replay the Flash-Decoding graphs
GRAPH_VARIANTS = {**VARIANTS, "ffd": dict(enable=True, kernel="ffd", delta=5.0),
                  "auto": dict(enable=True, kernel="auto", delta=5.0, ffd_crossover_tokens=1024)}


@pytest.mark.parametrize("variant", list(GRAPH_VARIANTS))
def test_cuda_graph_decode_equals_eager(model_dir, variant):
    """Graph replay (padded buckets, batches above the largest graph run eagerly) gives the eager
    engine's greedy tokens; every decode step that fits a graph is served by one."""
    from engine import LLM, SamplingParams

    settings = dict(model=model_dir, dtype="float32", max_num_batched_tokens=512, num_kv_blocks=1024,
                    cuda_graph_max_batch=6, **GRAPH_VARIANTS[variant])
    graphed = LLM(cuda_graphs=True, **settings)
    eager = LLM(cuda_graphs=False, **settings)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 6]
    assert graphs.widths == ([7, graphs.max_blocks] if variant == "auto" else [graphs.max_blocks])
    assert eager.engine.runner.graphs is None
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    gen = torch.Generator().manual_seed(5)
    lengths = (3, 129, 700, 1100, 16, 255, 257, 64, 2000)   # 9 > 6: the first steps run eagerly
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths]
    a, b = graphed.generate(prompts, params), eager.generate(prompts, params)
    for x, y in zip(a, b, strict=True):
        assert_equal_or_near_tie(x, y)
    assert sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True)) >= len(prompts) - 1
    runner = graphed.engine.runner
    assert runner.num_graph_steps > 0
    # bucket 1 (for "auto": the 7-page Flash-Decoding graph), after wider batches used the buffers
    single = graphed.generate(prompts[2], params)[0]
    assert_equal_or_near_tie(single, b[2])
    counters = graphed.engine.stats().attention_counters
    if variant == "ffd":
        assert counters["ffd_blocks_total"] > 0 and counters["ffd_blocks_kept"] <= counters["ffd_blocks_total"]
    bm = graphed.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_async_scheduling_on_gpu_equals_synchronous(model_dir):
    """Graph replay fed by the previous step's device-side tokens (pinned copy + event) gives the
    synchronous engine's tokens, including requests that stop early and one that joins late."""
    from engine import LLM, SamplingParams

    settings = dict(model=model_dir, dtype="float32", max_num_batched_tokens=512, num_kv_blocks=1024,
                    cuda_graph_max_batch=8, enable=True, kernel="flash")
    on, off = LLM(async_scheduling=True, **settings), LLM(async_scheduling=False, **settings)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (7, 300, 1030, 64, 129)]
    for params in (SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[100, 101, 102, 103]),
                   SamplingParams(temperature=0.9, seed=4, max_tokens=20, ignore_eos=True)):
        a, b = on.generate(prompts, params), off.generate(prompts, params)
        assert [x.token_ids for x in a] == [y.token_ids for y in b]
    assert on.engine.runner.num_graph_steps > 0
    bm = on.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
