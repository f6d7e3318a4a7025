"""Shared test setup: offline hub, Triton's interpreter when there is no GPU."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass


def pytest_collection_modifyitems(config, items):
    """Tests marked `clients` run real client CLIs for minutes: only when selected with -m clients."""
    import pytest

    if "clients" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="runs a real client CLI; opt in with -m clients")
    for item in items:
        if "clients" in item.keywords:
            item.add_marker(skip)
