"""Reasoning output on every protocol, with a thinking template on a tiny random model (CPU).

The template opens `<think>` in the generation prompt (as Qwen3-Thinking's does), so the output
starts inside the thought; `</think>` is a token of its own (id 260, as in Qwen3) which a
logit_bias makes the sampler pick now and then, so a seeded reply has a thought and an answer.
The same engine behind a server with reasoning_parser = "none" gives the raw text to compare with.
"""
import json

import anthropic
import httpx
import openai
import pytest

from engine import AsyncEngine
from server.app.build import build_app
from server.openai.reasoning import ReasoningParser, ReasoningSplit, prompt_opens_thought, reasoning_split
from tests.support.server_harness import LiveServer, tiny_config
from tests.support.tiny_models import make_tiny_model

MODEL = "thinker"
THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is not defined or enable_thinking %}{{ '<think>\n' }}"
    "{% else %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)
CLOSE_TOKEN = 260
SAMPLED = {"seed": 1, "temperature": 1.0, "logit_bias": {str(CLOSE_TOKEN): 4}}
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("m") / MODEL, "qwen3", chat_template=THINK_TEMPLATE,
                                extra_tokens=("<think>", "</think>"))
    eng = AsyncEngine(tiny_config(model_dir))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(build_app(tiny_config(engine.config.model.name), engine)) as live:
        yield live


@pytest.fixture(scope="module")
def raw_server(engine):
    config = tiny_config(engine.config.model.name, **{"model.reasoning_parser": "none"})
    with LiveServer(build_app(config, engine)) as live:
        yield live


def chat(live, **kw):
    client = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)
    return client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=30, **kw)


# ----- the parser -----------------------------------------------------------------------------

@pytest.mark.parametrize("cuts", [1, 2, 3, 5, 100])
def test_parser_handles_tags_split_across_deltas(cuts):
    text = "<think>\nweigh it</think>\n\nthe answer <think> stays"
    for opens_inside, source, thought in ((False, text, "\nweigh it"), (True, text[len("<think>"):], "\nweigh it")):
        parser = ReasoningParser(ReasoningSplit(opens_inside))
        pieces = [parser.feed(source[i:i + cuts]) for i in range(0, len(source), cuts)] + [parser.finish()]
        reasoning = "".join(r for r, _ in pieces)
        content = "".join(c for _, c in pieces)
        assert reasoning == thought and content == "the answer <think> stays"
        first_content = next(i for i, (_, c) in enumerate(pieces) if c)
        assert all(not r for r, _ in pieces[first_content + 1:])


def test_parser_without_a_thought_and_cut_off_thought():
    parser = ReasoningParser(ReasoningSplit(False))
    assert parser.feed("  plain") == ("", "  plain") and parser.finish() == ("", "")
    parser = ReasoningParser(ReasoningSplit(True))
    assert parser.feed("still </thi") == ("still ", "") and parser.finish() == ("</thi", "")


def test_when_the_split_applies():
    assert prompt_opens_thought("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thought("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert reasoning_split("auto", "{{ '<think>' }}", "x", constrained=False) == ReasoningSplit(False)
    assert reasoning_split("auto", "no tags", "x", constrained=False) is None
    assert reasoning_split("think", "no tags", "<think>", constrained=False) == ReasoningSplit(True)
    assert reasoning_split("none", "<think>", "<think>", constrained=False) is None
    assert reasoning_split("think", "<think>", "<think>", constrained=True) is None


def test_config_validates_the_parser_name(tmp_path):
    from engine.config import ConfigError, load_config

    assert load_config(None).model.reasoning_parser == "auto"
    with pytest.raises(ConfigError, match="reasoning_parser"):
        load_config(None, overrides={"model.reasoning_parser": "deepseek"})


# ----- chat completions -----------------------------------------------------------------------

def test_chat_message_reasoning_content(server, raw_server):
    raw = chat(raw_server, **SAMPLED).choices[0].message.content
    thought, sep, answer = raw.partition("</think>")
    assert sep and thought and answer.strip("\n"), raw  # the seeded reply has both
    message = chat(server, **SAMPLED).choices[0].message
    assert message.reasoning_content == thought and message.model_extra["reasoning"] == thought
    assert message.content == answer.lstrip("\n")


def test_chat_stream_reasoning_deltas_before_content(server, raw_server):
    raw = chat(raw_server, **SAMPLED).choices[0].message.content
    kinds, reasoning, content = [], [], []
    for chunk in chat(server, stream=True, **SAMPLED):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            kinds.append("reasoning")
            reasoning.append(extra["reasoning_content"])
        if delta.content:
            kinds.append("content")
            content.append(delta.content)
    assert "reasoning" in kinds and "content" in kinds
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    thought, _, answer = raw.partition("</think>")
    assert "".join(reasoning) == thought and "".join(content) == answer.lstrip("\n")


def closed_thought_tokens(live) -> int:
    """What enable_thinking false adds to the prompt: the template closes the thought at once."""
    return httpx.post(live.root + "/tokenize", json={"prompt": "\n</think>\n\n"}).json()["count"]


def test_thinking_off_by_template_kwargs(server):
    never_opens = {str(CLOSE_TOKEN - 1): -100}  # the model may open a thought itself: not this time
    off = chat(server, temperature=0, logit_bias=never_opens,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert not (off.choices[0].message.model_extra or {}).get("reasoning_content") and off.choices[0].message.content
    on = chat(server, temperature=0, logit_bias=never_opens)
    assert on.choices[0].message.model_extra["reasoning_content"] and not on.choices[0].message.content
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + closed_thought_tokens(server)


def test_constrained_output_is_not_split(server):
    reply = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=200, response_format={"type": "json_object"})
    assert not (reply.choices[0].message.model_extra or {}).get("reasoning_content")
    assert reply.choices[0].message.content.lstrip().startswith("{")


# ----- Anthropic Messages ---------------------------------------------------------------------

def test_messages_thinking_block(server):
    client = anthropic.Anthropic(base_url=server.root, api_key="unused", max_retries=0, timeout=60)
    reply = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO, extra_body={"temperature": 0})
    block = reply.content[0]
    assert block.type == "thinking" and block.thinking and block.signature
    with client.messages.stream(model=MODEL, max_tokens=12, messages=HELLO, extra_body={"temperature": 0}) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert final.content[0].thinking == block.thinking and final.content[0].signature == block.signature
    assert deltas[-1] == "signature_delta" and set(deltas[:-1]) == {"thinking_delta"}
    on = client.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens
    off = client.messages.count_tokens(model=MODEL, messages=HELLO, thinking={"type": "disabled"}).input_tokens
    assert off == on + closed_thought_tokens(server)  # thinking disabled: enable_thinking false


# ----- Responses ------------------------------------------------------------------------------

def test_responses_reasoning_item(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    reply = client.responses.create(model=MODEL, input="hi", max_output_tokens=12, temperature=0)
    item = reply.output[0]
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.content[0].type == "reasoning_text"
    assert item.content[0].text and reply.output_text == ""
    assert 0 < reply.usage.output_tokens_details.reasoning_tokens <= reply.usage.output_tokens
    events = []
    with httpx.stream("POST", server.base_url + "/responses", timeout=60,
                      json={"model": MODEL, "input": "hi", "max_output_tokens": 12, "temperature": 0,
                            "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    names = [e["type"] for e in events]
    assert names[2] == "response.output_item.added" and events[2]["item"]["type"] == "reasoning"
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert streamed == item.content[0].text
    assert names.index("response.reasoning_text.done") < names.index("response.output_item.done")
    off = client.responses.create(model=MODEL, input="hi", max_output_tokens=12, temperature=0,
                                  reasoning={"effort": "none"})
    assert off.usage.input_tokens == reply.usage.input_tokens + closed_thought_tokens(server)
