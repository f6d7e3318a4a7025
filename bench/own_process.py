"""Run one measurement in a fresh process and return its (picklable) result.

On the H200 the second engine built in one process decoded ~8 % slower per token than the same engine
alone (bench/RESULTS.md, MoE section), so side-by-side rows measured in one process would favour
whichever variant runs first. Each row gets a process of its own instead.
"""
from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def in_own_process(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """fn(*args, **kwargs) in a spawned process (a module-level `fn`; CUDA cannot be forked)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()
