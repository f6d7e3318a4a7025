"""Keep-alive for streams: a marker whenever a source is silent for a while.

A long prefill (a 20K-token agent prompt on CPU takes minutes) keeps a stream silent between
its first event and its first token; clients and proxies drop streams that stay quiet too
long, so writers send a keep-alive event (Anthropic's `ping`) at each marker.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

T = TypeVar("T")

KEEPALIVE_INTERVAL_S = 10.0


async def with_keepalive(source: AsyncGenerator[T, None], interval: float = KEEPALIVE_INTERVAL_S
                         ) -> AsyncIterator[T | None]:
    """`source`'s items, and None each time `interval` seconds pass without one. The wait never
    cancels the step in progress; closing this generator cancels it and closes `source`."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            step, pending = pending, None
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await source.aclose()
