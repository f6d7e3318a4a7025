"""Drive `engine.tools.calibration.calibrate` with the real engine over real text (`fdserve calibrate`).

The default corpus is text every install has offline: the source of a few standard-library
modules (prose docstrings and code, like what coding agents send). Pass files for your domain.
"""
from __future__ import annotations

import importlib
import inspect
import itertools
import logging
from pathlib import Path
from typing import Any

from engine.attention.backend import AttentionBackend
from engine.config import ConfigError, FdserveConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.tools.calibration import calibrate

logger = logging.getLogger(__name__)

DEFAULT_MODULES = ("argparse", "json.decoder", "textwrap", "difflib", "logging")


def default_texts() -> list[str]:
    return [inspect.getsource(importlib.import_module(name)) for name in DEFAULT_MODULES]


def run_calibration(config: FdserveConfig, output_path: Path, *, texts: list[str] | None = None,
                    prompt_tokens: int = 1024, decode_tokens: int = 16) -> dict[str, Any]:
    """Prefill `prompt_tokens` of each text and decode `decode_tokens` more; write the φ file (with
    the K/V maxima that FP8 pages take their scales from)."""
    if config.backend.tensor_parallel_size > 1:   # the recorder reads one process's pages
        raise ConfigError("fdserve calibrate runs in one process: set backend.tensor_parallel_size = 1 "
                          "(the file it writes holds every KV head, and each rank of a larger size takes its own)")
    # The recorder reads pages of the model dtype: calibrate at full precision whatever is served.
    backend = config.backend.model_copy(update={"kv_cache_dtype": "auto"})
    engine = LLMEngine(config.model_copy(update={"backend": backend}))
    texts = texts or default_texts()
    ids = itertools.count()
    limit = min(prompt_tokens, engine.max_context_len - decode_tokens - 1)

    def run_forward(backend: AttentionBackend) -> None:
        saved = engine.runner.backend
        engine.runner.backend = backend
        engine.runner.last_layer_sampled_rows_only = False   # every prompt row attends in every layer
        try:
            for text in texts:
                tokens = engine.tokenizer.encode(text)[:limit]
                if len(tokens) < 2:
                    continue
                params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
                engine.add_request(f"calibrate-{next(ids)}", tokens, params)
                while engine.has_unfinished():
                    engine.step()
        finally:
            engine.runner.backend = saved
            engine.runner.last_layer_sampled_rows_only = True

    result = calibrate(engine.model, run_forward, kv_dtype=engine.dtype, output_path=output_path,
                       model_name=engine.served_model_name)
    outside = sum(layer["rows_outside_window"] for layer in result["layers"])
    logger.info("wrote %s: φ for %d layers; %d recorded rows fall outside the safe window",
                output_path, len(result["phi"]), outside)
    return result
