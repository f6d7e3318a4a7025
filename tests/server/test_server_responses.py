"""The official openai SDK's Responses client against a live uvicorn + the real engine on a tiny random
model (CPU): create, the stream helper and the raw event order, forced function and custom tool
calls and their outputs on the next turn, a Codex-style resent history, ignored tool types,
text.format, input_tokens and the errors as the SDK's exception classes."""
import json

import httpx
import openai
import pytest

from server.app.build import build_app
from server.responses.custom_tools import custom_input
from tests.server.test_server_openai import MAX_CONTEXT, MODEL, engine  # noqa: F401 - the shared tiny engine fixture
from tests.support.server_harness import FAILURE_MESSAGE, LiveServer, failing_server, named_sse_events, tiny_config

KEY = "responses-test-key"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                          "required": ["city"], "additionalProperties": False}}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark",
                          "definition": 'start: "*** Begin Patch" /(.|\\n)*/ "*** End Patch"'}}
HOSTED = [{"type": "web_search"}, {"type": "local_shell"}, {"type": "file_search", "vector_store_ids": ["vs_1"]},
          {"type": "namespace", "name": "mcp__docs", "tools": [{"type": "function", "name": "lookup"}]},
          {"type": "image_generation"}]


@pytest.fixture(scope="module")
def server(engine):  # noqa: F811
    config = tiny_config(engine.config.model.name, **{"model.max_context_len": MAX_CONTEXT, "api.api_key": KEY,
                                                      "server.max_body_bytes": 64 * 1024})
    with LiveServer(build_app(config, engine)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def input_tokens(server, **body) -> int:
    response = httpx.post(server.base_url + "/responses/input_tokens", json={"model": MODEL, **body},
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200 and response.json()["object"] == "response.input_tokens"
    return response.json()["input_tokens"]


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    return named_sse_events(server.base_url + "/responses", {"model": MODEL, **body},
                            {"Authorization": f"Bearer {KEY}"})


def check_event_order(events: list[tuple[str, dict]]) -> dict:
    """Sequence numbers 0, 1, 2, ...; created and in_progress first; every delta inside its item's
    added / done; completed last. Returns the completed response."""
    names = [name for name, _ in events]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    assert names.count("response.completed") == 1
    open_items: dict[int, str] = {}
    done: set[int] = set()
    for name, data in events[2:-1]:
        if name == "response.output_item.added":
            assert data["output_index"] not in open_items and data["output_index"] not in done
            open_items[data["output_index"]] = data["item"]["id"]
        elif name == "response.output_item.done":
            assert open_items.pop(data["output_index"]) == data["item"]["id"]
            done.add(data["output_index"])
        else:  # every other event belongs to an item that is open
            assert open_items.get(data["output_index"]) == data["item_id"], (name, data)
    assert not open_items
    response = events[-1][1]["response"]
    assert response["id"].startswith("resp_") and response["id"] == events[0][1]["response"]["id"]
    assert len(response["output"]) == len(done)
    return response


# ----- happy paths ---------------------------------------------------------------------------

def test_create_text_usage_and_output_text(client, server):
    reply = client.responses.create(model=MODEL, input="Say something.", instructions="You are terse.",
                                    max_output_tokens=12, temperature=0, store=False,
                                    reasoning={"effort": "low", "summary": "auto"},
                                    include=["reasoning.encrypted_content"],
                                    prompt_cache_key="k1", metadata={"run": "1"}, user="u1", service_tier="auto",
                                    truncation="disabled", extra_body={"client_metadata": {"x": "y"}})
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == MODEL
    assert reply.status in ("completed", "incomplete")
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens" and reply.usage.output_tokens == 12
    message = reply.output[0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and reply.output_text == message.content[0].text
    assert 1 <= reply.usage.output_tokens <= 12 and reply.usage.output_tokens_details.reasoning_tokens == 0
    counted = input_tokens(server, input="Say something.", instructions="You are terse.")
    assert reply.usage.input_tokens == counted and reply.usage.total_tokens == counted + reply.usage.output_tokens
    again = client.responses.create(model=MODEL, input="Say something.", instructions="You are terse.",
                                    max_output_tokens=12, temperature=0)
    assert again.output_text == reply.output_text  # greedy: the same text
    assert again.usage.input_tokens_details.cached_tokens > 0  # the prompt's blocks are in the prefix cache


def test_max_output_tokens_is_clamped(client):
    reply = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Hi"}],
                                    max_output_tokens=10_000_000, temperature=0)
    assert reply.usage.output_tokens <= MAX_CONTEXT


def test_stream_helper_and_raw_event_order(client, server):
    with client.responses.stream(model=MODEL, input="Say something.", max_output_tokens=10, temperature=0) as stream:
        seen = [event.type for event in stream]
        final = stream.get_final_response()
    plain = client.responses.create(model=MODEL, input="Say something.", max_output_tokens=10, temperature=0)
    assert final.output_text == plain.output_text and final.usage.output_tokens == plain.usage.output_tokens
    assert seen[0] == "response.created" and seen[-1] == "response.completed"
    events = raw_events(server, {"input": "Say something.", "max_output_tokens": 10, "temperature": 0})
    names = [name for name, _ in events]
    assert names[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    response = check_event_order(events)
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert text == response["output"][0]["content"][0]["text"] == plain.output_text
    assert response["usage"]["output_tokens"] == plain.usage.output_tokens
    assert response["usage"]["input_tokens"] == plain.usage.input_tokens
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None


def test_create_stream_true_yields_typed_events(client):
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=6, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed" and events[-1].response.usage.output_tokens >= 1


def test_forced_function_call_and_its_output(client, server):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.responses.create(model=MODEL, input=question, tools=[WEATHER, *HOSTED], max_output_tokens=120,
                                    tool_choice={"type": "function", "name": "get_weather"})
    call = reply.output[-1]
    assert reply.status == "completed" and call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Tokyo")
    history = question + [call.model_dump(exclude_none=True),
                          {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}]
    final = client.responses.create(model=MODEL, input=history, tools=[WEATHER], max_output_tokens=6)
    assert final.status in ("completed", "incomplete")
    assert final.usage.input_tokens > input_tokens(server, input=question, tools=[WEATHER]) + len('{"temperature": 21}')
    events = raw_events(server, {"input": question, "tools": [WEATHER], "tool_choice": "required",
                                 "max_output_tokens": 120})
    response = check_event_order(events)
    arguments = "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta")
    done = next(d for n, d in events if n == "response.function_call_arguments.done")
    assert arguments == done["arguments"] == response["output"][-1]["arguments"]
    assert json.loads(arguments)["city"] in ("Paris", "Tokyo")


def test_custom_tool_call_and_its_output(client, server):
    reply = client.responses.create(model=MODEL, input="Fix the bug.", tools=[WEATHER, APPLY_PATCH],
                                    tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=40)
    call = reply.output[-1]
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.call_id.startswith("call_")
    assert isinstance(call.input, str) and not call.input.startswith('{"input"')
    events = raw_events(server, {"input": "Fix the bug.", "tools": [APPLY_PATCH], "max_output_tokens": 40,
                                 "tool_choice": {"type": "custom", "name": "apply_patch"}})
    response = check_event_order(events)
    streamed = "".join(d["delta"] for n, d in events if n == "response.custom_tool_call_input.delta")
    done = next(d for n, d in events if n == "response.custom_tool_call_input.done")
    assert streamed == done["input"] == response["output"][-1]["input"]
    history = [{"role": "user", "content": "Fix the bug."}, call.model_dump(exclude_none=True),
               {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}]
    final = client.responses.create(model=MODEL, input=history, tools=[APPLY_PATCH], max_output_tokens=4)
    assert final.usage.input_tokens > input_tokens(server, input="Fix the bug.", tools=[APPLY_PATCH])


def test_custom_input_unwraps_the_string_argument():
    assert custom_input('{"input": "*** Begin Patch\\n*** End Patch"}') == "*** Begin Patch\n*** End Patch"
    assert custom_input('{"input": "*** Begin') == "*** Begin"  # cut off by the output budget
    assert custom_input("not json") == "not json" and custom_input('{"input": 3}') == "3"


def test_codex_style_history_is_accepted(client, server):
    """What Codex resends every turn: developer and user messages, a reasoning item, the assistant's
    output_text message, a function call with its output; tools of every kind; store false."""
    history = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions>...</permissions>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context/>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Use ls."}],
         "content": None, "encrypted_content": "opaque"},
        {"type": "message", "role": "assistant", "id": "msg_1",
         "content": [{"type": "output_text", "text": "Listing.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
         "arguments": '{"command": ["ls"]}'},
        {"type": "function_call_output", "call_id": "call_1",
         "output": [{"type": "input_text", "text": "README.md\nsrc"}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "user", "content": "Thanks."},
    ]
    shell = {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {
        "command": {"type": "array", "items": {"type": "string"}}}, "required": ["command"]}, "strict": False}
    reply = client.responses.create(model=MODEL, instructions="You are Codex.", input=history,
                                    tools=[shell, *HOSTED], tool_choice="auto", parallel_tool_calls=False,
                                    store=False, stream=False, max_output_tokens=6, reasoning={"effort": "medium"},
                                    text={"verbosity": "low"})
    assert reply.status in ("completed", "incomplete") and reply.output
    counted = input_tokens(server, instructions="You are Codex.", input=history, tools=[shell, *HOSTED])
    assert reply.usage.input_tokens == counted
    without_hosted = input_tokens(server, instructions="You are Codex.", input=history, tools=[shell])
    assert counted == without_hosted  # hosted and namespaced tools are not shown to the model
    without_reasoning = input_tokens(server, instructions="You are Codex.", input=[h for h in history
                                                                                  if h.get("type") != "reasoning"],
                                     tools=[shell])
    assert counted == without_reasoning  # echoed reasoning stays out of the prompt
    # the call's output reached the prompt
    shorter = [h for h in history if h.get("type") != "function_call_output"]
    assert counted > input_tokens(server, instructions="You are Codex.", input=shorter,
                                  tools=[shell]) + len("README.md")


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = client.responses.create(model=MODEL, input="Answer in JSON.", max_output_tokens=40,
                                    text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                     "strict": True}})
    assert isinstance(json.loads(reply.output_text)["ok"], bool)


def test_routes_without_v1_and_tool_choice_none(server):
    response = httpx.post(server.root + "/responses", headers={"Authorization": f"Bearer {KEY}"},
                          json={"input": "Hi", "tools": [WEATHER], "tool_choice": "none", "max_output_tokens": 3})
    assert response.status_code == 200 and [i["type"] for i in response.json()["output"]] == ["message"]


# ----- errors ---------------------------------------------------------------------------------

def test_authentication_error(server):
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.responses.create(model=MODEL, input="Hi", max_output_tokens=2)


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="gpt-5-codex", input="Hi", max_output_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "gpt-5-codex" in err.value.body["message"]


def test_context_overflow(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="x" * (MAX_CONTEXT + 50), max_output_tokens=10)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError):
        with client.responses.stream(model=MODEL, input="x" * (MAX_CONTEXT + 50)) as stream:
            stream.get_final_response()


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "temperature": "hot"}, "temperature"),
    ({"input": 3}, "input"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input[0].message.role"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
])
def test_bad_requests_name_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, **body)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    assert err.value.body["type"] == "invalid_request_error"


def test_request_too_large(server):
    response = httpx.post(server.base_url + "/responses", content=b"x" * (65 * 1024),
                          headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_failure_mid_stream_is_response_failed(engine):  # noqa: F811
    """Once the stream is open, a failure is response.failed carrying the response's error, and the stream ends."""
    with failing_server(engine.config.model.name) as live:
        body = {"input": "Hi", "max_output_tokens": 200, "stream": True}
        with httpx.stream("POST", live.base_url + "/responses", json=body, timeout=60) as response:
            lines = [line for line in response.iter_lines() if line]
        assert response.status_code == 200 and lines[0] == "event: response.created"
        assert lines[-2] == "event: response.failed" and "response.completed" not in "".join(lines)
        failed = json.loads(lines[-1].removeprefix("data: "))["response"]
        assert failed["status"] == "failed" and FAILURE_MESSAGE in failed["error"]["message"]


def test_client_config_codex_is_a_responses_provider():
    import tomllib

    from engine import load_config
    from server.cli.client_config import RENDERERS, client_settings

    settings = client_settings(load_config(None, overrides={"server.port": 9100, "model.max_context_len": 32768}))
    text = RENDERERS["codex"](settings)
    provider = tomllib.loads(text.split("(or $CODEX_HOME/config.toml):\n", 1)[1].split("# and in the shell", 1)[0])
    assert provider["model"] == settings.model and provider["model_provider"] == "fdserve"
    block = provider["model_providers"]["fdserve"]
    assert block["base_url"] == "http://127.0.0.1:9100/v1" and block["wire_api"] == "responses"
    assert f"export {block['env_key']}=fdserve" in text and "Warning" not in text
    cc_switch = RENDERERS["cc-switch"](settings)
    stored = json.loads(cc_switch[cc_switch.rindex("{\n  \"name\": \"fdserve\",\n  \"settingsConfig\""):])
    assert tomllib.loads(stored["settingsConfig"]["config"])["model_providers"]["fdserve"]["wire_api"] == "responses"
