"""Server pieces without a server: tool-call parsing, grammars, errors, keys, client settings."""
import json
import random

import pytest
import torch

from engine import load_config
from server.app.auth import KeyChecker, presented_key
from server.cli.client_config import RENDERERS, client_settings
from server.core.errors import APIError, param_from_loc
from server.openai.protocol import ChatCompletionRequest
from server.openai.sampling import max_tokens_for
from server.openai.tool_parser import HERMES, LLAMA3_JSON, ToolCallParser
from server.openai.tools import TemplateInfo, ToolPlan, fallback_messages, forced_call_grammar, plan_tools
from tests.support.tiny_models import make_byte_tokenizer


def parse(style, text, sizes):
    parser = ToolCallParser(style)
    content, deltas, i = "", [], 0
    while i < len(text):
        n = next(sizes)
        piece, calls = parser.feed(text[i:i + n])
        content, deltas, i = content + piece, deltas + calls, i + n
    piece, calls = parser.finish()
    content, deltas = content + piece, deltas + calls
    calls = {}
    for delta in deltas:
        entry = calls.setdefault(delta["index"], {"name": None, "arguments": ""})
        if "id" in delta:  # the first delta of a call carries id, type and name
            assert entry["name"] is None and delta["type"] == "function" and delta["id"].startswith("call_")
            entry["name"] = delta["function"]["name"]
        else:
            assert set(delta) == {"index", "function"}
        entry["arguments"] += delta["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


CASES = [
    (HERMES, 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}\n'
             '</tool_call>', "Sure.", [("get_weather", {"city": "Paris", "n": [1, {"a": "}"}]})]),
    (HERMES, '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"arguments": {"x": 1}, '
             '"name": "b"}</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
    (HERMES, "plain text with < and <tool_ but no call", "plain text with < and <tool_ but no call", []),
    (HERMES, "bad <tool_call>not json</tool_call> end", "bad <tool_call>not json</tool_call> end", []),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"q\\": 2}"}</tool_call>', "", [("f", {"q": 2})]),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Tokyo"}}', "", [("get_weather", {"city": "Tokyo"})]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "",
     [("a", {"x": 1}), ("b", {})]),
    (LLAMA3_JSON, ' Hello {"name": "x"}', ' Hello {"name": "x"}', []),
    (LLAMA3_JSON, '{"answer": 42}', '{"answer": 42}', []),
]


@pytest.mark.parametrize("style,text,content,calls", CASES)
def test_tool_parser_streams_like_it_parses_whole(style, text, content, calls):
    rng = random.Random(0)
    for sizes in ([1] * 1000, [3] * 1000, [10_000], [rng.randint(1, 6) for _ in range(1000)]):
        got_content, got_calls = parse(style, text, iter(sizes))
        assert got_content == content
        assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls


def test_tool_parser_truncated_call_keeps_what_was_streamed():
    content, calls = parse(HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1', iter([2] * 100))
    assert content == "" and calls == [{"name": "f", "arguments": '{"a": 1'}]


def test_param_from_loc():
    assert param_from_loc(("body", "messages", 0, "content")) == "messages[0].content"
    assert param_from_loc(("messages", 1, "content", "list[TextPart]", 0, "type")) == "messages[1].content[0].type"
    assert param_from_loc(("temperature",)) == "temperature"


def test_key_checker_and_headers():
    checker = KeyChecker(["k1", "k2"])
    assert checker.accepts("k2") and not checker.accepts("k3") and not checker.accepts(None)
    assert not KeyChecker([]).enabled
    assert presented_key({b"authorization": b"Bearer abc"}) == "abc"
    assert presented_key({b"x-api-key": b"xyz"}) == "xyz"
    assert presented_key({b"authorization": b"Basic abc"}) is None


def test_max_tokens_clamped_and_context_checked():
    assert max_tokens_for(None, "max_tokens", 100, 512, 4096, None) == 412
    assert max_tokens_for(10_000, "max_tokens", 100, 512, 50, None) == 50
    assert max_tokens_for(None, "max_tokens", 10, 512, 4096, 16) == 16
    with pytest.raises(APIError) as err:
        max_tokens_for(5, "max_tokens", 512, 512, 4096, None)
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    assert "maximum context length is 512" in err.value.message
    with pytest.raises(APIError) as err:
        max_tokens_for(0, "max_completion_tokens", 5, 512, 4096, None)
    assert err.value.param == "max_completion_tokens"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}}, "required": ["city"],
    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]


def test_plan_tools_validates_choice():
    info = TemplateInfo(True, HERMES)
    base = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    assert plan_tools(ChatCompletionRequest(**base), info).mode == "auto"
    assert plan_tools(ChatCompletionRequest(**base, tool_choice="none"), info).tools is None
    forced = {"type": "function", "function": {"name": "get_time"}}
    named = plan_tools(ChatCompletionRequest(**base, tool_choice=forced), info)
    assert named.mode == "named" and named.named == "get_time"
    for bad in ({"type": "function", "function": {"name": "nope"}}, ):
        with pytest.raises(APIError) as err:
            plan_tools(ChatCompletionRequest(**base, tool_choice=bad), info)
        assert err.value.param == "tool_choice"
    with pytest.raises(APIError):
        plan_tools(ChatCompletionRequest(messages=base["messages"], tool_choice="required"), info)


def test_fallback_messages_put_tools_in_the_system_prompt():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = fallback_messages(messages, TOOLS)
    assert out[0]["content"].startswith("Be brief.") and "<tools>" in out[0]["content"]
    listed = out[0]["content"].split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert listed == [json.dumps(t["function"], separators=(",", ":")) for t in TOOLS]   # one compact line each
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert "tool_calls" not in out[2]
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    return make_byte_tokenizer(tmp_path_factory.mktemp("tok"))


def sample_constrained(processor, tokenizer, eos, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        logits = processor(out, torch.randn(len(tokenizer), generator=gen) * 3)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if token == eos:
            return tokenizer.decode(out), True
        out.append(token)
    return tokenizer.decode(out), False


@pytest.mark.parametrize("style", [HERMES, LLAMA3_JSON])
def test_forced_call_grammar_always_yields_a_parsable_call(byte_tokenizer, style):
    from engine.text.structured import GrammarLogitsProcessor, lark_grammar

    eos = byte_tokenizer.eos_token_id
    plan = ToolPlan(TOOLS, "required", None, style)
    processor = GrammarLogitsProcessor(lark_grammar(forced_call_grammar(plan)), byte_tokenizer, {eos},
                                       len(byte_tokenizer))
    for seed in range(4):
        text, finished = sample_constrained(processor, byte_tokenizer, eos, 200, seed)
        assert finished, text
        _, calls = parse(style, text, iter([4] * 100))
        assert len(calls) == 1 and calls[0]["name"] in ("get_weather", "get_time")
        assert isinstance(json.loads(calls[0]["arguments"]), dict)


def test_json_processor_prefixes_are_valid_and_choices_are_independent(byte_tokenizer):
    from engine.text.structured import GrammarLogitsProcessor, json_schema_grammar

    eos = byte_tokenizer.eos_token_id
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    processor = GrammarLogitsProcessor(json_schema_grammar(schema), byte_tokenizer, {eos}, len(byte_tokenizer))
    # One processor serves every choice of a request (and re-calls after preemption).
    for seed in range(6):
        text, finished = sample_constrained(processor, byte_tokenizer, eos, 100, seed)
        assert finished and json.loads(text) in ({"ok": True}, {"ok": False})


def test_client_config_uses_the_model_folder_context(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    config = load_config(None, overrides={"model.name": str(tmp_path), "server.port": 9001,
                                          "model.max_new_tokens": 512})
    settings = client_settings(config)
    assert settings.context_window == 4096 and settings.max_tokens == 512
    assert settings.base_url == "http://127.0.0.1:9001/v1" and settings.model == tmp_path.name
    for render in RENDERERS.values():
        text = render(settings)
        assert settings.base_url in text and settings.model in text
    assert '"contextWindow": 4096' in RENDERERS["cline"](settings)
    embedded = client_settings(load_config(None, overrides={"api.api_key": "secret"}))
    assert embedded.context_window == 8192 and embedded.model == "SmolLM2-135M-Instruct"
    assert "secret" not in RENDERERS["openai"](embedded)


class _StubTokenizer:
    def __init__(self, render):
        self.render = render

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        return self.render(messages, tools)


def test_template_info_detects_tool_support_and_style():
    def llama3(messages, tools):
        head = "<|start_header_id|>user<|end_header_id|>\n\n"
        return head + (json.dumps(tools) if tools else "") + messages[0]["content"]

    def hermes(messages, tools):
        return ("<tools>" + json.dumps(tools) + "</tools> reply with <tool_call>" if tools else "") + "x"

    assert TemplateInfo.detect(_StubTokenizer(llama3)) == TemplateInfo(True, LLAMA3_JSON)
    assert TemplateInfo.detect(_StubTokenizer(hermes)) == TemplateInfo(True, HERMES)
    assert TemplateInfo.detect(_StubTokenizer(lambda m, t: "same")) == TemplateInfo(False, HERMES)
