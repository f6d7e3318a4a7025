"""Synthetic models: a real architecture with random weights, for benchmarks with no download.

`synthetic:<preset>` (e.g. `synthetic:llama-3.1-8b`) names a folder with a `config.json` of
that shape, a byte-level tokenizer and a marker file `synthetic.json`, but no weights: the
loader builds the model and calls `init_random_weights` instead of reading safetensors, so an
8B-shaped model costs seconds and no 16 GB of disk. The compute per token is the real one
(the LM head keeps the full vocabulary; the sampler only looks at the tokenizer's 259 ids).
Generated text is noise, so benchmarks run these with `ignore_eos`. Under tensor parallelism each rank
fills its own shard from the same seed: the same shapes and speed, but not the same weights as one process.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.model.causal_lm import CausalLM
from kernels.cache_dir import cache_root

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SYNTHETIC_PREFIX = "synthetic:"
MARKER_FILE = "synthetic.json"
# Bump when the folder contents change, so stale caches are rebuilt.
SYNTHETIC_VERSION = 1
# HF's default initializer_range: keeps activations bounded through 32 random layers in bf16.
INIT_STD = 0.02

# Byte-level tokenizer: ids 0..255 are bytes, then these three specials.
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_PAD_ID, _BOS_ID, _EOS_ID = 256, 257, 258
_CHATML = ("{% for message in messages %}"
           "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# HF config fields per preset (the architecture's own shapes; dtype as the real checkpoint ships).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=False, torch_dtype="bfloat16"),
    # ~141 GB of bf16 weights: two GPUs' worth (tensor_parallel_size = 2)
    "llama-3.1-70b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=False, torch_dtype="bfloat16"),
    # 128 experts, 8 active (~3.3B active of 30.5B parameters), q/k norm; every layer sparse.
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_theta=10000000.0, tie_word_embeddings=False, torch_dtype="bfloat16"),
    # A few MB, same code path (GQA 2:1, llama3 RoPE scaling): for CI and CPU smoke runs.
    "tiny": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=128,
        intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "original_max_position_embeddings": 1024},
        tie_word_embeddings=False, torch_dtype="float32"),
    "tiny-moe": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512, hidden_size=128,
        intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="float32"),
}


def is_synthetic_name(name: str | None) -> bool:
    return name is not None and name.startswith(SYNTHETIC_PREFIX)


def synthetic_marker(model_dir: Path) -> dict[str, Any] | None:
    """The marker's contents ({"preset", "seed", "version"}) if `model_dir` is synthetic, else None."""
    path = Path(model_dir) / MARKER_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _preset(name: str) -> tuple[str, int]:
    """`synthetic:<preset>[@seed]` -> (preset, seed)."""
    body = name.removeprefix(SYNTHETIC_PREFIX)
    preset, _, seed = body.partition("@")
    if preset not in PRESETS:
        raise ValueError(f"unknown synthetic model {name!r}; available: "
                         + ", ".join(SYNTHETIC_PREFIX + p for p in PRESETS))
    if seed and not seed.isdigit():
        raise ValueError(f"{name!r}: the seed after '@' must be a non-negative integer")
    return preset, int(seed or 0)


def synthetic_model_dir(name: str) -> Path:
    """The folder for `synthetic:<preset>[@seed]`, written once under the fdserve cache.

    Written to a temporary folder and renamed into place, so a crash never leaves a folder
    that looks complete (the same scheme as the GGUF conversion).
    """
    preset, seed = _preset(name)
    fields = PRESETS[preset]
    key = json.dumps([fields, seed, SYNTHETIC_VERSION], sort_keys=True)
    target = cache_root() / f"synthetic-{preset}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (target / MARKER_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_folder(tmp, fields, preset, seed)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp makes 0700; the cache is shareable
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / MARKER_FILE).is_file():  # not a concurrent writer winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_folder(folder: Path, fields: dict[str, Any], preset: str, seed: int) -> None:
    config = {**fields, "bos_token_id": _BOS_ID, "eos_token_id": _EOS_ID, "pad_token_id": _PAD_ID}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_byte_tokenizer(folder)
    # The marker goes last: its presence means the folder is complete.
    (folder / MARKER_FILE).write_text(json.dumps({"preset": preset, "seed": seed, "version": SYNTHETIC_VERSION}))


def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level BPE with no merges (every UTF-8 text round-trips; 256 + 3 ids) and ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(_SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=_SPECIAL_TOKENS[0],
                                   bos_token=_SPECIAL_TOKENS[1], eos_token=_SPECIAL_TOKENS[2])
    fast.chat_template = _CHATML
    fast.save_pretrained(str(folder))


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter in place: norms 1, biases 0, the rest N(0, INIT_STD²), seeded.

    One generator on the parameters' device, so an 8B model initialises on the GPU in seconds.
    """
    generator: torch.Generator | None = None
    for name, param in model.named_parameters():  # a tied LM head appears once
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if "norm" in name:
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, INIT_STD, generator=generator)


def build_synthetic_model(model_dir: Path, dtype: torch.dtype, device: torch.device,
                          hf_config: PretrainedConfig) -> CausalLM:
    """Our model class for `model_dir`'s config (`hf_config`, read from it), randomly initialised
    with the marker's seed."""
    from engine.model.registry import get_model_class

    marker = synthetic_marker(model_dir)
    if marker is None:
        raise ValueError(f"{model_dir} is not a synthetic model folder (no {MARKER_FILE})")
    with torch.device(device):
        model = get_model_class(hf_config)(hf_config, dtype)
    init_random_weights(model, int(marker["seed"]))
    return model.eval()
