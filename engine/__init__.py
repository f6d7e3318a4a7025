"""fdserve's engine: everything between a request and a kernel call."""
from engine.config import ConfigError, FdserveConfig, load_config
from engine.request.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "ConfigError", "FdserveConfig", "LLM", "LLMEngine", "SamplingParams", "load_config"]


def __getattr__(name: str):
    # Lazy: importing the config or sampling params must not pull in torch and the model code.
    if name == "LLM":
        from engine.core.offline import LLM
        return LLM
    if name == "LLMEngine":
        from engine.core.llm_engine import LLMEngine
        return LLMEngine
    if name == "AsyncEngine":
        from engine.core.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
