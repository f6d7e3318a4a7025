"""`config.toml` into typed, validated settings.

Every section of the file maps to a pydantic model that forbids unknown keys. `${VAR}` and
`${VAR:-default}` are interpolated from the environment before validation; a missing variable
is a startup error naming it. Every error names the key path and how to fix it.
"""
from __future__ import annotations

import difflib
import fnmatch
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration problem, with the key path and the fix in its message."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerConfig(_Section):
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    request_timeout: float = Field(600.0, gt=0, description="seconds before a request ends with an error")
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0, description="larger request bodies get 413")
    max_queued_requests: int = Field(1024, ge=1, description="waiting requests beyond this get 503")
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class RopeScaling(_Section):
    """Rotary-embedding scaling, with the keys transformers uses for rope_scaling / rope_parameters."""

    type: Literal["linear", "dynamic", "yarn"]
    factor: float = Field(gt=1.0, description="how many times the original context the positions stretch to")
    original_max_position_embeddings: int | None = Field(
        None, ge=16, description="the context the checkpoint was trained for; default: its max_position_embeddings")
    beta_fast: float = Field(32.0, gt=0, description="yarn only")
    beta_slow: float = Field(1.0, gt=0, description="yarn only")
    attention_factor: float | None = Field(None, gt=0, description="yarn only; default 0.1 ln(factor) + 1")


class ModelConfig(_Section):
    name: str | None = Field(None, description="local HF folder, .gguf file, or None for the embedded default")
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    max_context_len: int | None = Field(None, ge=16, description="default: the model's own")
    max_new_tokens: int = Field(4096, ge=1, description="cap and default for max_tokens")
    seed: int = Field(0, description="seeds the sampler's shared RNG at startup (requests without a seed)")
    aliases: list[str] = Field(default_factory=list, description="more model ids (or globs such as "
                               "\"claude-*\") that requests may send for the served model")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE scaling applied over the checkpoint's "
                                             "own; lets max_context_len go up to factor x the original length")
    reasoning_parser: Literal["auto", "none", "think"] = Field(
        "auto", description="split <think>...</think> out of the answer as reasoning: auto = when the chat "
                            "template contains <think>, think = always, none = never")

    @field_validator("aliases")
    @classmethod
    def _alias_patterns(cls, value: list[str]) -> list[str]:
        for alias in value:
            if not alias.strip() or alias != alias.strip():
                raise ValueError(f"model ids must be non-empty and without surrounding spaces, got {alias!r}")
        return value

    def matches_alias(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, alias) for alias in self.aliases)


class FlashDecodingConfig(_Section):
    enable: bool = True
    kernel: Literal["flash", "ffd", "auto"] = "flash"
    async_softmax: bool = False
    fixed_max_value: bool | float = False
    fallback_on_overflow: bool = True
    double_buffer: bool = True
    adaptive_matmul: bool = True
    num_splits: int = Field(0, ge=0, description="0 = wave-efficiency heuristic")
    calibration_file: str | None = Field(None, description="per-layer φ written by `fdserve calibrate`")
    delta: float = Field(5.0, gt=0)
    delta_units: Literal["e", "2"] = "e"
    sink_tokens: int = Field(4, ge=0)
    local_window: int = Field(128, ge=0)
    ffd_block_size: Literal[64, 128, 256] = 128
    ffd_crossover_tokens: int | None = Field(None, ge=1, description="kernel = \"auto\": the context length "
                                             "from which FFD runs; default: the one measured for this GPU")


CpuWeightDtype = Literal["auto", "float32", "bfloat16", "int4"]
CpuAttention = Literal["auto", "native", "fused", "reference"]
CpuMatmul = Literal["auto", "native", "torch"]
CpuProductInputs = Literal["auto", "float32", "int16"]
PrefillPrefix = Literal["auto", "kernel"]
KvCacheDtype = Literal["auto", "bfloat16", "fp8_e4m3", "fp8_e5m2"]


class BackendConfig(_Section):
    gpu_vendor: Literal["auto", "nvidia", "amd", "cpu"] = "auto"
    kv_cache_ratio: float = Field(0.85, gt=0.0, le=1.0)
    cpu_kv_cache_bytes: int = Field(2 * 1024**3, gt=0, description="KV budget when running on CPU")
    num_kv_blocks: int | None = Field(None, ge=1, description="override the computed number of KV blocks")
    block_size: int = Field(16, ge=1, le=1024)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = Field(256, ge=1, description="largest decode batch replayed from a graph")
    async_scheduling: bool = Field(True, description="launch decode step N+1 before reading step N's tokens")
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = Field(1, ge=1, description="ranks (one process per GPU) the model is split over")
    cpu_threads: int | None = Field(None, ge=1)
    cpu_weight_dtype: CpuWeightDtype = Field(
        "auto", description="CPU weights: auto = bfloat16 where a startup probe finds it fast, int4 decode "
                           "weights where the checkpoint is already 4-bit, an int8 LM head for decode; "
                           "int4 = bf16 plus int4 layers and the int8 LM head for decode")
    cpu_matmul: CpuMatmul = Field(
        "auto", description="CPU decode products of the int4 / int8 decode weights: native = the C++ kernel built "
                            "for this CPU (AVX512-BF16); torch = torch's int4 / int8 kernels; auto = native where "
                            "it builds, else torch, with the reason logged")
    cpu_product_inputs: CpuProductInputs = Field(
        "auto", description="inputs of the float32 decode products over the checkpoint's own blocks: float32 = "
                            "the dense weights' numbers; int16 = each input rounded to 16 bits per group of 32 "
                            "and multiplied as integers (faster; AVX2 and F16C); auto = int16 where it builds")
    cpu_attention: CpuAttention = Field(
        "auto", description="CPU attention: native = decode through the C++ paged kernel built for this CPU, "
                            "prefill through the C++ bf16 kernel on AVX512-BF16 CPUs with bf16 pages (else torch "
                            "SDPA); fused = torch SDPA for both; auto = native where the "
                            "kernel builds and takes the cache (float32/bf16 pages), else fused; reference = "
                            "the paged oracle")
    prefill_prefix: PrefillPrefix = Field(
        "auto", description="GPU prefill over a long cached prefix: auto = cuDNN's attention over the prefix, then "
                            "the paged kernel (NVIDIA compute 9.0+, bf16/fp16 pages, head_dim 64/128); "
                            "kernel = the paged kernel for every key")
    kv_cache_dtype: KvCacheDtype = Field(
        "auto", description="KV pages: auto = the model dtype; bfloat16 = two bytes per value for a float32 model "
                            "on the CPU (half the bytes a decode step reads); fp8_e4m3 / fp8_e5m2 = one byte per "
                            "value, scaled per (layer, KV head) (the fnuz variants on AMD)")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two (16, 32, 64, ...), got {value}")
        return value


class DistributedConfig(_Section):
    """Where the ranks of `tensor_parallel_size > 1` meet (torch.distributed's env:// rendezvous)."""

    nnodes: int = Field(1, ge=1, description="machines the ranks are spread over, the same number on each")
    node_rank: int = Field(0, ge=0, description="this machine's index; node 0 serves HTTP")
    master_addr: str = Field("127.0.0.1", description="address of node 0, reachable from every node")
    master_port: int = Field(0, ge=0, le=65535, description="rendezvous port on node 0; 0: a free one (one node)")
    timeout_s: float = Field(60.0, gt=0, description="a rank that dies or stops answering is found within this")
    startup_timeout_s: float = Field(1800.0, gt=0, description="how long the ranks wait for each other to load")


class ApiConfig(_Section):
    api_key: str | list[str] | None = None
    base_url: str | None = None

    @property
    def api_keys(self) -> list[str]:
        if self.api_key is None:
            return []
        keys = [self.api_key] if isinstance(self.api_key, str) else list(self.api_key)
        return [k for k in keys if k]


class FdserveConfig(_Section):
    server: ServerConfig = Field(default_factory=ServerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    flashdecoding: FlashDecodingConfig = Field(default_factory=FlashDecodingConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate_env(value: Any, path: str = "", env: Mapping[str, str] | None = None) -> Any:
    """Replace `${VAR}` / `${VAR:-default}` in every string of a parsed TOML tree."""
    env = os.environ if env is None else env
    if isinstance(value, dict):
        return {k: interpolate_env(v, f"{path}.{k}" if path else k, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate_env(v, f"{path}[{i}]", env) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        raise ConfigError(f"{path}: environment variable {name} is not set "
                          f"(export {name}=... or write ${{{name}:-default}} in the config)")

    return _VAR.sub(substitute, value)


def _known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        loc = tuple(item["loc"])
        path = ".".join(str(p) for p in loc)
        if item["type"] == "extra_forbidden":
            known = _known_keys(FdserveConfig, loc)
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
            lines.append(f"{path}: unknown key; {hint}")
        else:
            given = item.get("input")
            lines.append(f"{path}: {item['msg']} (got {given!r})")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
    node[parts[-1]] = value


def _toml_value(text: str) -> Any:
    """`--set` values are TOML (`true`, `8`, `"x"`); anything else is taken as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """`--set SECTION.KEY=VALUE` items as dotted overrides for `load_config`."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        overrides[key.strip()] = _toml_value(value.strip())
    return overrides


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                env: dict[str, str] | None = None) -> FdserveConfig:
    """Read `path` (None: built-in defaults), apply dotted `overrides` (CLI flags), validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist (pass --config with an existing file)")
        try:
            tree = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    tree = interpolate_env(tree, env=env)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, dotted, value)
    try:
        return FdserveConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def find_default_config() -> Path | None:
    """`$FDSERVE_CONFIG`, else ./config.toml when present."""
    env_path = os.environ.get("FDSERVE_CONFIG")
    if env_path:
        return Path(env_path)
    local = Path("config.toml")
    return local if local.is_file() else None
