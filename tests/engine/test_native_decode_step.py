"""A CPU decode step in one C++ call (`engine/model/native_decode.py`): on a model whose projections are the
checkpoint's own 4-bit / int8 blocks (the embedded default's case), "auto" weights in float32 take the block
kernel and the decode stack, and their greedy tokens and log-probabilities follow the dense float32 model's,
one sequence or several, up to the stack's 8 rows and past them (the torch forward). Where it does not apply
the startup text says why."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.cpu_weights import BlockDecodeWeight, block_weight_for
from engine.model.native_decode import NativeDecodeStep
from kernels.native import block_gemv, decode_stack
from kernels.native.build import NativeBuildError
from tests.support.tiny_models import make_tiny_model, quantize_to_blocks


def _builds() -> str | None:
    try:
        decode_stack.max_rows()
        return None
    except NativeBuildError as err:
        return str(err).splitlines()[0]


pytestmark = pytest.mark.skipif(_builds() is not None, reason=f"C++ decode stack: {_builds()}")

SETTINGS = dict(block_size=16, max_num_batched_tokens=256, cpu_kv_cache_bytes=32 << 20, seed=0)
PROMPTS = [list(range(40, 40 + n)) for n in (5, 17, 31, 16, 9, 45, 3, 22, 12)]   # pages full, part-full, odd


@pytest.fixture(scope="module")
def block_dir(tmp_path_factory):
    return quantize_to_blocks(make_tiny_model(tmp_path_factory.mktemp("blocks"), "llama", num_layers=3))


@pytest.fixture(scope="module")
def native(block_dir):
    return LLM(model=str(block_dir), dtype="float32", cpu_weight_dtype="auto", cpu_product_inputs="float32",
               **SETTINGS)


@pytest.fixture(scope="module")
def dense(block_dir):
    return LLM(model=str(block_dir), cpu_weight_dtype="float32", **SETTINGS)


def test_the_stack_runs_where_the_weights_are_blocks(native, dense):
    assert isinstance(native.engine.runner.native_decode, NativeDecodeStep)
    assert "one C++ call a step for the 3 decoder layers" in native.engine.graphs_text
    assert "4-bit in 12 layers" in native.engine.cpu_weights_text
    layers = [m for m in native.engine.model.modules() if getattr(m, "decode_weight", None) is not None]
    assert all(isinstance(m.decode_weight, BlockDecodeWeight) for m in layers)
    assert dense.engine.runner.native_decode is None
    assert "eager" in dense.engine.graphs_text and "no block decode weight" in dense.engine.graphs_text


@pytest.mark.parametrize("batch", [1, 3, 8, 9])
def test_greedy_tokens_follow_the_dense_model(native, dense, batch):
    """Nine prompts run as 1, 3, 8 or 9 at once: up to 8 decode rows through the stack, 9 through the torch
    forward; the tokens are the dense float32 model's and so are their log-probabilities (float32 rounding)."""
    calls = {"n": 0}
    step = native.engine.runner.native_decode
    forward = step.forward

    def counted(*args, **kwargs):
        calls["n"] += 1
        return forward(*args, **kwargs)

    step.forward = counted
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    try:
        ours = [r for i in range(0, len(PROMPTS), batch) for r in native.generate(PROMPTS[i:i + batch], params)]
    finally:
        step.forward = forward
    ref = dense.generate(PROMPTS, params)
    for a, b in zip(ours, ref, strict=True):
        assert a.token_ids == b.token_ids
        gaps = [abs(x.logprob - y.logprob) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)]
        assert len(gaps) == 24
        assert max(gaps) < 1e-4
    assert (calls["n"] > 0) == (batch <= 8)


def test_the_stack_writes_the_pages_the_torch_forward_reads(native, dense):
    """A prompt decoded through the stack, then extended: the extension's prefill (torch) attends the K/V the
    stack stored, and still gives the dense model's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    first = native.generate(PROMPTS[2], params)[0]
    longer = PROMPTS[2] + first.token_ids + [7, 8, 9]
    assert native.generate(longer, params)[0].token_ids == dense.generate(longer, params)[0].token_ids


def test_bfloat16_pages(block_dir):
    """`kv_cache_dtype = "bfloat16"` for the float32 model: the stack stores and reads bf16 pages as the torch
    forward over the same pages does."""
    native = LLM(model=str(block_dir), dtype="float32", cpu_weight_dtype="auto", kv_cache_dtype="bfloat16",
                 cpu_product_inputs="float32", **SETTINGS)
    dense = LLM(model=str(block_dir), cpu_weight_dtype="float32", kv_cache_dtype="bfloat16", **SETTINGS)
    assert native.engine.runner.k_cache.dtype == torch.bfloat16 and native.engine.runner.native_decode is not None
    assert dense.engine.runner.native_decode is None
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    for a, b in zip(native.generate(PROMPTS[:5], params), dense.generate(PROMPTS[:5], params), strict=True):
        assert a.token_ids == b.token_ids
        gaps = [abs(x.logprob - y.logprob) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)]
        assert max(gaps) < 1e-3


@pytest.mark.skipif(not block_gemv.int16_inputs_available(), reason="no AVX2 / F16C in this build")
def test_int16_inputs_follow_the_dense_model(block_dir, dense):
    """`cpu_product_inputs = "int16"` (what "auto" runs on AVX2): the stack's products over inputs rounded to 16
    bits per group give the dense float32 model's greedy tokens on these prompts, log-probabilities within that
    rounding (1.4e-4 and 2.2e-4 were measured where float32 inputs stay under 1e-4)."""
    rounded = LLM(model=str(block_dir), dtype="float32", cpu_weight_dtype="auto", cpu_product_inputs="int16",
                  **SETTINGS)
    step = rounded.engine.runner.native_decode
    assert step is not None and step.stack.int16_inputs
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    for a, b in zip(rounded.generate(PROMPTS, params), dense.generate(PROMPTS, params), strict=True):
        assert a.token_ids == b.token_ids
        gaps = [abs(x.logprob - y.logprob) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)]
        assert max(gaps) < 1e-2


def test_why_not_is_said(tmp_path):
    qwen2 = LLM(model=str(quantize_to_blocks(make_tiny_model(tmp_path / "q", "qwen2"))), dtype="float32",
                cpu_weight_dtype="auto", **SETTINGS)
    assert qwen2.engine.runner.native_decode is None and "biases" in qwen2.engine.graphs_text
    fp8 = LLM(model=str(quantize_to_blocks(make_tiny_model(tmp_path / "l", "llama"))), dtype="float32",
              cpu_weight_dtype="auto", kv_cache_dtype="fp8_e4m3", **SETTINGS)
    assert fp8.engine.runner.native_decode is None and "float32 over float32 or bfloat16" in fp8.engine.graphs_text


def test_only_weights_the_blocks_give_back_are_replaced():
    gen = torch.Generator().manual_seed(0)
    assert block_weight_for(torch.randn(64, 128, generator=gen)) is None   # on no grid: stays dense
    codes = torch.randint(-127, 128, (64, 128), generator=gen).float()
    codes[:, ::32] = 127   # Q8_0's d is a group's largest |w| / 127: its largest weight is code 127
    scale = (torch.rand(64, 4, generator=gen) * 0.01).half().float()
    q8 = (codes.reshape(64, 4, 32) * scale[..., None]).reshape(64, 128)
    block = block_weight_for(q8)
    assert block is not None and block.packed.bits == 8
    x = torch.randn(3, 128, generator=gen)
    ref = x.double() @ q8.double().T
    assert float((block(x).double() - ref).norm() / ref.norm()) < 1e-6
    assert block_weight_for(q8 + 1e-3 * torch.randn(64, 128, generator=gen)) is None   # off the grid a little
