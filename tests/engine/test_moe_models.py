"""Mixture-of-experts families (Qwen3-MoE, Mixtral) on CPU against transformers: greedy generation,
stacked-expert checkpoints, GGUF files, and load errors. Logits per step are in test_models.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.model.loader import gguf_to_hf, load_model
from engine.model.moe import FusedExperts, SparseMoeBlock
from tests.support.model_driver import PagedModelDriver
from tests.support.tiny_models import make_tiny_model

MOE_FAMILIES = ("qwen3_moe", "mixtral")
ATOL = 1e-4


def _hf(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def tiny_moe(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / request.param, request.param, num_layers=3)


def test_layers_are_sparse_where_the_config_says(tiny_moe: Path) -> None:
    model = load_model(tiny_moe, torch.float32, torch.device("cpu"))
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    # Qwen3-MoE's tiny config keeps layer 1 dense (mlp_only_layers); Mixtral is sparse throughout.
    want = ["SparseMoeBlock", "LlamaMLP", "SparseMoeBlock"] if "qwen3" in tiny_moe.name else ["SparseMoeBlock"] * 3
    assert kinds == want
    experts = next(m for m in model.modules() if isinstance(m, FusedExperts))
    assert tuple(experts.w13_weight.shape) == (8, 96, 64) and tuple(experts.w2_weight.shape) == (8, 64, 48)


def test_greedy_tokens_equal_transformers_generate(tiny_moe: Path) -> None:
    hf = _hf(tiny_moe)
    llm = LLM(model=tiny_moe, block_size=16, cpu_weight_dtype="float32", cpu_kv_cache_bytes=16 << 20)
    prompts = [_tokens(23, seed=1), _tokens(5, seed=2), _tokens(40, seed=3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        assert out.token_ids == want.tolist()


def test_stacked_expert_checkpoint_loads_the_same(tiny_moe: Path, tmp_path: Path) -> None:
    """Experts saved as [E, 2I, H] / [E, H, I] tensors (transformers' in-memory layout) load alike."""
    state = load_file(str(tiny_moe / "model.safetensors"))
    stacked: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in state.items():
        parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
        if ".experts." in name.replace(".block_sparse_moe.", ".mlp."):
            prefix = ".".join(parts[:parts.index("experts")])
            experts.setdefault(prefix, {}).setdefault(int(parts[parts.index("experts") + 1]), {})[parts[-2]] = tensor
        else:
            stacked[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
    for prefix, per_expert in experts.items():
        order = sorted(per_expert)
        gate = [per_expert[e].get("gate_proj", per_expert[e].get("w1")) for e in order]
        up = [per_expert[e].get("up_proj", per_expert[e].get("w3")) for e in order]
        down = [per_expert[e].get("down_proj", per_expert[e].get("w2")) for e in order]
        stacked[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up, strict=True)])
        stacked[f"{prefix}.experts.down_proj"] = torch.stack(down)
    folder = tmp_path / "stacked"
    folder.mkdir()
    shutil.copy(tiny_moe / "config.json", folder / "config.json")
    save_file(stacked, str(folder / "model.safetensors"))
    a = load_model(tiny_moe, torch.float32, torch.device("cpu"))
    b = load_model(folder, torch.float32, torch.device("cpu"))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_missing_and_misshapen_experts_are_named(tiny_moe: Path, tmp_path: Path) -> None:
    state = load_file(str(tiny_moe / "model.safetensors"))
    block = "block_sparse_moe" if "mixtral" in tiny_moe.name else "mlp"
    up = "w3" if "mixtral" in tiny_moe.name else "up_proj"
    dropped = f"model.layers.0.{block}.experts.3.{up}.weight"
    model = load_model(tiny_moe, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"experts\.w13_weight \(shards .*'up', 3"):
        model.load_weights((n, t) for n, t in state.items() if n != dropped)
    bad = {**state, dropped: torch.zeros(47, 64)}
    with pytest.raises(ValueError, match=rf"{dropped}: expert 3 up"):
        model.load_weights(bad.items())


def test_paged_decode_of_a_moe_model_follows_transformers(tiny_moe: Path) -> None:
    """Two sequences, one mixed prefill+decode step, then decodes: every token's logits as transformers'."""
    model = load_model(tiny_moe, torch.float32, torch.device("cpu"))
    assert any(isinstance(m, SparseMoeBlock) for m in model.modules())
    hf = _hf(tiny_moe)
    driver = PagedModelDriver(model, num_blocks=16, block_size=16)
    a, b = _tokens(20, seed=4), _tokens(30, seed=5)
    steps = [{0: a[:12]}, {0: a[12:13], 1: b[:25]}] + [{0: [a[13 + i]], 1: [b[25 + i]]} for i in range(5)]
    got_a, got_b = [], []
    for step in steps:
        logits = driver.step(step)
        got_a.append(logits[:len(step[0])])
        got_b.append(logits[len(step[0]):])
    torch.testing.assert_close(torch.cat(got_a), _hf_logits(hf, a[:18]), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), _hf_logits(hf, b), atol=ATOL, rtol=0)


# --- GGUF: a file written from the tiny checkpoint converts back to the same model --------------

def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter: per head, the two rotary halves interleaved row by row."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _write_gguf(model_dir: Path, path: Path) -> None:
    """A GGUF with llama.cpp's names and layout (stacked experts [E, out, in]) for the tiny model."""
    import gguf
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    state = load_file(str(model_dir / "model.safetensors"))
    mixtral = cfg.model_type == "mixtral"
    arch = "llama" if mixtral else "qwen3moe"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_expert_count(cfg.num_local_experts if mixtral else cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_feed_forward_length(cfg.intermediate_size)
    if not mixtral:
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
             "block_sparse_moe.gate": "ffn_gate_inp"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    stacks: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        if name in top:
            writer.add_tensor(top[name], tensor.numpy())
            continue
        parts = name.split(".")
        layer, rest = int(parts[2]), ".".join(parts[3:-1])
        if ".experts." in name:
            proj = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
                    "w2": "down"}[parts[-2]]
            stacks.setdefault((layer, proj), {})[int(parts[-3])] = tensor
            continue
        if mixtral and rest == "self_attn.q_proj":
            tensor = _llama_cpp_permute(tensor, cfg.num_attention_heads)
        elif mixtral and rest == "self_attn.k_proj":
            tensor = _llama_cpp_permute(tensor, cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{layer}.{names[rest]}.weight", tensor.numpy())
    for (layer, proj), per_expert in stacks.items():
        stacked = torch.stack([per_expert[e] for e in sorted(per_expert)]).numpy()
        writer.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", np.ascontiguousarray(stacked))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_moe_converts_to_the_same_model(tiny_moe: Path, tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny.gguf"
    _write_gguf(tiny_moe, path)
    config, tensors = gguf_to_hf(gguf.GGUFReader(str(path)), path.name)
    folder = tmp_path / "converted"
    config.save_pretrained(str(folder))
    save_file(tensors, str(folder / "model.safetensors"))
    ours = load_model(folder, torch.float32, torch.device("cpu"))
    tokens = _tokens(21, seed=6)
    got = PagedModelDriver(ours, num_blocks=8, block_size=16).step({0: tokens})
    torch.testing.assert_close(got, _hf_logits(_hf(tiny_moe), tokens), atol=ATOL, rtol=0)
    # transformers reads the converted folder too: it is an ordinary HF checkpoint.
    torch.testing.assert_close(_hf_logits(_hf(folder), tokens), _hf_logits(_hf(tiny_moe), tokens), atol=ATOL, rtol=0)
