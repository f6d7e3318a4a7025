"""with_keepalive: markers while the source is silent, its items in order, clean cancellation."""
import asyncio

from server.core.keepalive import with_keepalive


async def _slow(delays, closed):
    try:
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            yield i
    finally:
        closed.append(True)


def test_markers_while_silent_and_items_in_order():
    async def main():
        closed = []
        seen = [item async for item in with_keepalive(_slow([0.0, 0.35, 0.0], closed), interval=0.1)]
        return seen, closed

    seen, closed = asyncio.run(main())
    assert [s for s in seen if s is not None] == [0, 1, 2]
    assert seen[0] == 0 and 2 <= seen.count(None) <= 4 and seen.index(1) > 1 and closed == [True]


def test_errors_pass_through_and_closing_cancels_the_wait():
    async def failing():
        yield 1
        await asyncio.sleep(0.05)
        raise ValueError("boom")

    async def main():
        got = []
        try:
            async for item in with_keepalive(failing(), interval=0.01):
                got.append(item)
        except ValueError as exc:
            got.append(str(exc))
        closed = []
        stream = with_keepalive(_slow([10.0], closed), interval=0.01)
        assert await stream.__anext__() is None
        await stream.aclose()  # the 10 s step is cancelled, the source closed
        return got, closed

    got, closed = asyncio.run(main())
    assert got[0] == 1 and got[-1] == "boom" and None in got and closed == [True]
