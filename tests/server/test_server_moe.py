"""A mixture-of-experts model behind the HTTP server: OpenAI and Anthropic clients, concurrent
streams, greedy output as the offline engine gives it."""
import asyncio

import anthropic
import openai
import pytest

from engine import LLM, AsyncEngine, SamplingParams
from server.app.build import build_app
from tests.support.server_harness import LiveServer, tiny_config
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny-moe", "qwen3_moe", num_layers=3)
    engine = AsyncEngine(tiny_config(model_dir, **{"backend.cpu_kv_cache_bytes": 16 * 1024 * 1024}))
    engine.start()
    with LiveServer(build_app(engine.config, engine)) as live:
        yield live, model_dir
    engine.shutdown()


def test_completions_equal_the_offline_engine(moe_server) -> None:
    live, model_dir = moe_server
    client = openai.OpenAI(base_url=live.base_url, api_key="x")
    prompt = "Mixture of experts, routed per token: "
    got = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    llm = LLM(model=model_dir, cpu_kv_cache_bytes=16 << 20)
    ids = llm.engine.tokenizer.encode(prompt)
    want = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert got.usage.completion_tokens == 12
    assert got.choices[0].text == want.text


def test_concurrent_streams_and_anthropic_messages(moe_server) -> None:
    live, _ = moe_server

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.chat.completions.create(
            model="tiny-moe", messages=[{"role": "user", "content": f"request {i}"}], max_tokens=8,
            temperature=0.7, seed=i, stream=True, extra_body={"ignore_eos": True})
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return "".join(parts)

    async def many() -> list[str]:
        client = openai.AsyncOpenAI(base_url=live.base_url, api_key="x")
        return await asyncio.gather(*(one(client, i) for i in range(12)))

    texts = asyncio.run(many())
    assert len(texts) == 12 and all(texts)
    message = anthropic.Anthropic(base_url=live.root, api_key="x").messages.create(
        model="tiny-moe", max_tokens=6, messages=[{"role": "user", "content": "hello"}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
