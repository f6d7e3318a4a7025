"""The official anthropic SDK against a live uvicorn + the real engine on a tiny random model (CPU):
the Messages API, count_tokens, its errors, Claude Code's billing block and the prefix cache,
model aliases and the unauthenticated reachability probe."""
import json

import anthropic
import httpx
import openai
import pytest

from server.app.build import build_app
from tests.server.test_server_openai import MAX_CONTEXT, MODEL, engine  # noqa: F401 - the shared tiny engine fixture
from tests.support.server_harness import FAILURE_MESSAGE, LiveServer, failing_server, named_sse_events, tiny_config

KEY = "messages-test-key"
ALIAS = "claude-sonnet-4-5"
SYSTEM = "You are a careful assistant. " * 12
WEATHER_TOOL = {"name": "get_weather", "description": "Weather in a city",
                "input_schema": {"type": "object",
                                 "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                                 "required": ["city"], "additionalProperties": False}}
HELLO = [{"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0}  # the SDK no longer has sampling arguments; the API still takes them


@pytest.fixture(scope="module")
def server(engine):  # noqa: F811
    config = tiny_config(engine.config.model.name, **{"model.max_context_len": MAX_CONTEXT, "api.api_key": KEY,
                                                      "model.aliases": ["claude-*"],
                                                      "server.max_body_bytes": 64 * 1024})
    with LiveServer(build_app(config, engine)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.root, api_key=KEY, max_retries=0, timeout=60,
                               default_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})


def billing_block(nonce: str) -> dict:
    return {"type": "text",
            "text": f"x-anthropic-billing-header: cc_version=2.1.197.abc; cc_entrypoint=cli; cch={nonce};"}


def sse_events(server, body: dict) -> list[tuple[str, dict]]:
    return named_sse_events(server.base_url + "/messages?beta=true", body,
                            {"x-api-key": KEY, "anthropic-version": "2023-06-01"})


# ----- happy paths ---------------------------------------------------------------------------

def test_create_message(client, server):
    reply = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=HELLO,
                                   metadata={"user_id": "u1"},
                                   extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 40})
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert reply.model == MODEL and reply.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in reply.content] in (["text"], [])
    assert 1 <= reply.usage.output_tokens <= 12 and reply.usage.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=HELLO).input_tokens
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted > len(SYSTEM)


def test_max_tokens_is_clamped_and_reported(client):
    reply = client.messages.create(model=MODEL, max_tokens=32000, messages=HELLO, stop_sequences=["\x00never"],
                                   extra_body=GREEDY)
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.output_tokens <= MAX_CONTEXT


def test_stop_sequence_reported(client):
    full = client.messages.create(model=MODEL, max_tokens=40, messages=HELLO, extra_body=GREEDY).content[0].text
    stop = next(c for c in full if c.isprintable() and c.strip() and c != "\ufffd" and full.index(c) > 0)
    reply = client.messages.create(model=MODEL, max_tokens=40, messages=HELLO, stop_sequences=[stop], extra_body=GREEDY)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == full[:full.index(stop)]


def test_stream_event_order_and_usage(server):
    events = sse_events(server, {"model": MODEL, "max_tokens": 10, "messages": HELLO})
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    body = names[2:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and 1 <= delta["usage"]["output_tokens"] <= 10
    assert text  # random weights: some text before the budget ends


def test_sdk_stream_helper_reassembles_text(client):
    with client.messages.stream(model=MODEL, max_tokens=16, messages=HELLO, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    plain = client.messages.create(model=MODEL, max_tokens=16, messages=HELLO, extra_body=GREEDY)
    assert "".join(pieces) == final.content[0].text == plain.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == plain.usage.input_tokens + plain.usage.cache_read_input_tokens)


def test_forced_tool_use_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.messages.create(model=MODEL, max_tokens=120, messages=messages, tools=[WEATHER_TOOL],
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert reply.stop_reason == "tool_use"
    call = next(b for b in reply.content if b.type == "tool_use")
    assert call.id.startswith("toolu_") and call.name == "get_weather" and call.input["city"] in ("Paris", "Tokyo")
    messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": [{"type": "text", "text": '{"temperature": 21}'}]},
                                              {"type": "text", "text": "Thanks."}]}]
    final = client.messages.create(model=MODEL, max_tokens=8, messages=messages, tools=[WEATHER_TOOL])
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the earlier call and its result are in the prompt: it is longer than the question alone
    question = client.messages.count_tokens(model=MODEL, messages=messages[:1], tools=[WEATHER_TOOL]).input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > question + len('{"temperature": 21}')


def test_forced_tool_use_stream(client, server):
    with client.messages.stream(model=MODEL, max_tokens=120, messages=HELLO, tools=[WEATHER_TOOL],
                                tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    call = final.content[-1]
    assert final.stop_reason == "tool_use" and call.type == "tool_use" and call.input["city"] in ("Paris", "Tokyo")
    events = sse_events(server, {"model": MODEL, "max_tokens": 120, "messages": HELLO, "tools": [WEATHER_TOOL],
                                 "tool_choice": {"type": "tool", "name": "get_weather"}})
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial)["city"] in ("Paris", "Tokyo")
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_accepted_request_forms(client):
    """What Claude Code sends: system blocks with cache_control, a mid-conversation system message,
    thinking blocks echoed back, thinking / context_management / output effort settings, tool_choice none."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "sig"},
                                                  {"type": "redacted_thinking", "data": "xyz"},
                                                  {"type": "text", "text": "Hello."}]},
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Again?"}]
    reply = client.messages.create(
        model=ALIAS, max_tokens=4, messages=messages, tools=[WEATHER_TOOL], tool_choice={"type": "none"},
        system=[billing_block("1"), {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "low"}})
    assert reply.model == ALIAS and reply.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in reply.content)


# ----- prefix cache across Claude Code turns --------------------------------------------------

def test_second_turn_is_served_from_the_prefix_cache(client):
    system = [billing_block("3f9a1"), {"type": "text", "text": SYSTEM + "Turn test."}]
    first = client.messages.create(model=ALIAS, max_tokens=6, system=system, messages=HELLO, extra_body=GREEDY)
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    system[0] = billing_block("77c02")  # Claude Code's nonce changes on every request
    messages = HELLO + [{"role": "assistant", "content": first.content[0].text if first.content else ""},
                        {"role": "user", "content": "And now?"}]
    second = client.messages.create(model=ALIAS, max_tokens=6, system=system, messages=messages, extra_body=GREEDY)
    assert second.usage.cache_read_input_tokens >= 0.9 * first_prompt
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > first_prompt


def test_billing_block_is_not_in_the_prompt(client):
    plain = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=HELLO).input_tokens
    tagged = client.messages.count_tokens(model=MODEL, system=[billing_block("abc"), {"type": "text", "text": SYSTEM}],
                                          messages=HELLO).input_tokens
    assert tagged == plain


# ----- errors ---------------------------------------------------------------------------------

def test_authentication_error(server):
    bad = anthropic.Anthropic(base_url=server.root, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model=MODEL, max_tokens=4, messages=HELLO)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server.root, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 0
    # the OpenAI routes keep OpenAI's shape
    response = httpx.post(server.base_url + "/chat/completions", json={"messages": HELLO})
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"


def test_unknown_model_is_not_found(client, server):
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="gpt-unknown", max_tokens=4, messages=HELLO)
    assert err.value.body["error"]["type"] == "not_found_error" and "gpt-unknown" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="gpt-unknown", messages=HELLO)


def test_context_overflow_wording(client):
    long = [{"role": "user", "content": "x" * (MAX_CONTEXT + 50)}]
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=32000, messages=long)
    counted = client.messages.count_tokens(model=MODEL, messages=long).input_tokens
    assert err.value.body["error"] == {"type": "invalid_request_error",
                                       "message": f"prompt is too long: {counted} tokens > {MAX_CONTEXT} maximum"}
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        with client.messages.stream(model=MODEL, max_tokens=100, messages=long) as stream:
            stream.get_final_message()


def test_failure_mid_stream_is_an_error_event(engine):  # noqa: F811
    """Once the stream is open, a failure is an `error` event (the SDK raises on it) and the stream ends."""
    with failing_server(engine.config.model.name) as live:
        body = {"model": MODEL, "max_tokens": 200, "messages": HELLO, "stream": True,
                "stop_sequences": ["\x00never"]}
        with httpx.stream("POST", live.base_url + "/messages", json=body, timeout=60) as response:
            lines = [line for line in response.iter_lines() if line]
        assert response.status_code == 200 and lines[0] == "event: message_start"
        assert lines[-2] == "event: error" and "message_stop" not in "".join(lines)
        error = json.loads(lines[-1].removeprefix("data: "))
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert FAILURE_MESSAGE in error["error"]["message"]


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (403, "permission_error"), (404, "not_found_error"),
                                          (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"),
                                          (503, "overloaded_error"), (504, "api_error"),
                                          (422, "invalid_request_error")])
def test_error_types_follow_the_status(status, kind):
    from server.anthropic.errors import error_response
    from server.core.errors import APIError

    response = error_response(APIError(status, "why", headers={"Retry-After": "1"}))
    assert response.status_code == status and response.headers["retry-after"] == "1"
    assert json.loads(response.body) == {"type": "error", "error": {"type": kind, "message": "why"}}


@pytest.mark.parametrize("body, words", [
    ({"model": MODEL, "messages": HELLO}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "image"),
    ({"model": MODEL, "max_tokens": 4, "messages": []}, "messages"),
    ({"model": MODEL, "max_tokens": 0, "messages": HELLO}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "tool_choice": {"type": "tool", "name": "nope"},
      "tools": [WEATHER_TOOL]}, "tool_choice"),
    ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "temperature": -1}, "temperature"),
])
def test_bad_requests_are_invalid_request_errors(server, body, words):
    for path in ("/v1/messages", "/messages"):
        response = httpx.post(server.root + path, json=body, headers={"x-api-key": KEY})
        error = response.json()
        assert response.status_code == 400 and error["type"] == "error", error
        assert error["error"]["type"] == "invalid_request_error" and words in error["error"]["message"]


def test_request_too_large(server):
    response = httpx.post(server.base_url + "/messages", content=b"x" * (65 * 1024),
                          headers={"x-api-key": KEY, "content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["type"] == "request_too_large"


# ----- aliases and the probe ------------------------------------------------------------------

def test_aliases_on_every_protocol(server):
    chat = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    reply = chat.chat.completions.create(model="claude-haiku-4-5", messages=HELLO, max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert chat.completions.create(model=ALIAS, prompt="a", max_tokens=2).choices
    tokenized = httpx.post(server.root + "/tokenize", json={"model": ALIAS, "prompt": "ab"},
                           headers={"x-api-key": KEY})
    assert tokenized.status_code == 200
    with pytest.raises(openai.NotFoundError) as err:
        chat.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def test_root_answers_probes_without_a_key(server):
    for method in ("GET", "HEAD"):
        response = httpx.request(method, server.root + "/")
        assert response.status_code == 200, method
    info = httpx.get(server.root + "/").json()
    assert info["name"] == "fdserve" and info["version"]
    assert httpx.get(server.base_url + "/models").status_code == 401  # the API itself still needs the key
