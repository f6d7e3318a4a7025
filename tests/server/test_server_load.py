"""Load on CPU: 64 concurrent streaming clients x 4 requests, a quarter of them hanging up early."""
import asyncio
import re

import httpx
import openai
import pytest

from engine import AsyncEngine
from server.app.build import build_app
from tests.support.server_harness import LiveServer, metric, tiny_config, wait_until
from tests.support.tiny_models import make_tiny_model

CLIENTS, ROUNDS, MAX_TOKENS = 64, 4, 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", "llama")
    engine = AsyncEngine(tiny_config(model_dir, **{"backend.cpu_kv_cache_bytes": 16 * 1024 * 1024}))
    engine.start()
    with LiveServer(build_app(engine.config, engine)) as live:
        yield live
    engine.shutdown()


async def one_client(client, index, results):
    for round_ in range(ROUNDS):
        hang_up = (index + round_) % 4 == 0
        # Shared system prompt (prefix cache) and a per-client question, as agents send them.
        messages = [{"role": "system", "content": "You are a coding assistant. " * 4},
                    {"role": "user", "content": f"client {index} round {round_}: " + "why? " * (index % 7)}]
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0.8, seed=index,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": index % 2 == 0})
        finish, usage, chunks = None, None, 0
        async for chunk in stream:
            chunks += 1
            if hang_up and chunks == 3:
                break
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
        await stream.close()
        results.append((hang_up, finish, usage))


async def run_load(base_url):
    results = []
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120,
                                  http_client=openai.DefaultAsyncHttpxClient(
                                      limits=httpx.Limits(max_connections=CLIENTS * 2))) as client:
        await asyncio.gather(*(one_client(client, i, results) for i in range(CLIENTS)))
    return results


def test_64_streaming_clients_with_early_disconnects(server):
    results = asyncio.run(run_load(server.base_url))
    assert len(results) == CLIENTS * ROUNDS
    completed = [(finish, usage) for hang_up, finish, usage in results if not hang_up]
    assert len(completed) == CLIENTS * ROUNDS * 3 // 4
    for finish, usage in completed:
        assert finish in ("stop", "length")
        assert usage is not None and 1 <= usage.completion_tokens <= MAX_TOKENS
    assert wait_until(lambda: metric(server.root, "fdserve_kv_blocks_free")
                      == metric(server.root, "fdserve_kv_blocks_total")
                      and metric(server.root, "fdserve_num_requests_running") == 0
                      and metric(server.root, "fdserve_num_requests_waiting") == 0, timeout=30)
    text = httpx.get(server.root + "/metrics").text
    assert not re.search(r'fdserve_requests_total\{route="chat",status="5\d\d"\}', text)
    ok = metric(server.root, "fdserve_requests_total", '{route="chat",status="200"}')
    gone = metric(server.root, "fdserve_requests_total", '{route="chat",status="499"}')
    # A client that hangs up right as its (short) answer ends may still count as answered.
    assert ok + gone == CLIENTS * ROUNDS and ok >= len(completed)
    assert metric(server.root, "fdserve_requests_in_flight") == 0
