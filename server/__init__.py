"""fdserve's HTTP side: the OpenAI-compatible API, its CLI and client settings."""
from __future__ import annotations


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fdserve")
    except PackageNotFoundError:  # running from a source checkout
        return "0.1.0+source"


__version__ = _version()
