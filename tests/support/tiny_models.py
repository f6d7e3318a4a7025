"""Tiny random models and a byte-level tokenizer, built offline, for CPU tests."""
from __future__ import annotations

from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_byte_tokenizer(path: Path, chat_template: str = CHATML_TEMPLATE, extra_tokens: tuple[str, ...] = ()):
    """A byte-level BPE with no merges: exact round trip of any UTF-8 text; 256 + 3 tokens, then
    `extra_tokens` as ordinary (not special) added tokens, as Qwen3 has <think> and </think>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(list(extra_tokens))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return fast


FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "llama_tied", "qwen3_moe", "mixtral")


def make_tiny_model(path: Path, family: str = "llama", seed: int = 0, num_layers: int = 2,
                    max_position_embeddings: int = 2048, chat_template: str = CHATML_TEMPLATE,
                    extra_tokens: tuple[str, ...] = (), hidden_size: int = 64) -> Path:
    """Save a tiny random model of `family` (hidden 64 unless given, 4 q heads / 2 KV heads) plus
    tokenizer (`extra_tokens` get ids 259, 260, ...)."""
    import transformers as tf

    common = dict(vocab_size=259 + len(extra_tokens), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max_position_embeddings,
                  bos_token_id=257, eos_token_id=258, pad_token_id=256, rms_norm_eps=1e-6)
    if family in ("llama", "llama_tied"):
        config = tf.LlamaConfig(**common, tie_word_embeddings=family == "llama_tied", rope_theta=10000.0)
        cls = tf.LlamaForCausalLM
    elif family == "llama3":
        config = tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256})
        cls = tf.LlamaForCausalLM
    elif family == "mistral":
        config = tf.MistralConfig(**common, sliding_window=None)
        cls = tf.MistralForCausalLM
    elif family == "qwen2":
        config = tf.Qwen2Config(**common, tie_word_embeddings=False)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=hidden_size // 4, tie_word_embeddings=False)
        cls = tf.Qwen3ForCausalLM
    elif family == "qwen3_moe":  # layer 1 dense (mlp_only_layers), the others sparse
        config = tf.Qwen3MoeConfig(**common, head_dim=hidden_size // 4, tie_word_embeddings=False, num_experts=8,
                                   num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                                   decoder_sparse_step=1, mlp_only_layers=[1] if num_layers > 1 else [])
        cls = tf.Qwen3MoeForCausalLM
    elif family == "mixtral":
        config = tf.MixtralConfig(**{**common, "intermediate_size": 48}, num_local_experts=8,
                                  num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False)
        cls = tf.MixtralForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # make the random weights large enough that outputs differ per token
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(str(path))
    make_byte_tokenizer(path, chat_template, extra_tokens)
    return path


def quantize_to_blocks(path: Path) -> Path:
    """Rewrite a saved tiny model's projections as GGUF-style blocks would dequantize them: every q/k/v/o/gate/
    up/down weight on a 4-bit grid per 32 inputs (Q4_1: d u + min), the LM head on an int8 grid (Q8_0: d q),
    with d and min half-precision numbers, as a GGUF file holds them."""
    from safetensors.torch import load_file, save_file

    from kernels.gemm.int4_cpu import quantize_int4
    from kernels.gemm.int8_blocks import quantize_int8_blocks

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    for name, w in tensors.items():
        if w.dim() != 2 or "embed" in name:
            continue
        groups = w.float().reshape(w.shape[0], -1, 32)
        if "lm_head" in name:
            codes, scale = quantize_int8_blocks(w)
            value = codes.reshape(groups.shape).float() * scale.half().float()[..., None]
        else:
            codes, scale, zero = quantize_int4(w)
            value = (codes.reshape(groups.shape).float() * scale.half().float()[..., None]
                     + (zero - 8 * scale).half().float()[..., None])
        tensors[name] = value.reshape(w.shape).to(w.dtype).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path
