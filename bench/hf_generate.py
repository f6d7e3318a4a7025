"""The transformers `generate` baseline of `fdserve bench latency --transformers`.

The same model folder the engine serves (a synthetic preset gets transformers' own random
initialisation: the speed does not depend on the values), the same dtype and device, the same
prompt, greedy with a fixed number of new tokens. TTFT is a `generate` of one new token; the
per-token latency is (time of N tokens − TTFT) / (N − 1), as for the engine rows.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_hf_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.model.synthetic import synthetic_marker

    if synthetic_marker(model_dir) is not None:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    # transformers decorates `to` with functools.wraps(nn.Module.to): mypy reads it unbound, self as the device
    return model.to(device).eval()  # type: ignore[arg-type]


def time_generate(model: Any, prompt: list[int], new_tokens: int) -> float:
    device = model.device
    ids = torch.tensor([prompt], device=device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    _sync(device)
    if out.shape[1] - ids.shape[1] != new_tokens:
        raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    return time.perf_counter() - start


def measure_transformers(model_dir: Path, dtype: torch.dtype, device: torch.device,
                         prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """A latency row (same keys as the engine's) for transformers `generate`, one run per prompt."""
    model = load_hf_model(model_dir, dtype, device)
    try:
        time_generate(model, prompts[0], 2)   # warm-up at the measured length: kernels, allocator
        runs = []
        for prompt in prompts:
            ttft = time_generate(model, prompt, 1)
            total = time_generate(model, prompt, max_tokens)
            tpot = (total - ttft) / (max_tokens - 1) * 1e3 if max_tokens > 1 else None
            runs.append({"ttft_ms": ttft * 1e3, "total_ms": total * 1e3, "tpot_ms": tpot,
                         "tok_s": max_tokens / total, "wall_s": total})
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    tpots = sorted(r["tpot_ms"] for r in runs if r["tpot_ms"] is not None)
    tpot = statistics.median(tpots) if tpots else None
    mid = runs[len(runs) // 2]
    return {"name": "transformers", "available": True,
            "attention": f"transformers {__import__('transformers').__version__} generate ({dtype}, {device})",
            "overrides": {}, "counters": {}, "prefix_cache_hits": 0, "tokens": max_tokens,
            "ttft_ms": mid["ttft_ms"], "total_ms": mid["total_ms"], "tok_s": mid["tok_s"], "wall_s": mid["wall_s"],
            "decode_tok_s": 1e3 / tpot if tpot else None, "tpot_ms": tpot,
            "tpot_ms_range": [tpots[0], tpots[-1]] if tpots else None, "runs": runs}
