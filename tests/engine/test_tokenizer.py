"""Tokenizer wrapper, chat templates and the incremental detokenizer with stop strings."""
from __future__ import annotations

import json
import random

import pytest

from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import ChatTemplateError, Tokenizer
from tests.support.tiny_models import make_byte_tokenizer

SAMPLES = [
    "Hello, world! Plain ASCII.",
    "naïve café — déjà vu; ß, Ω, ж",
    "混合テキスト：中文、日本語、한국어。",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 end",
    "math ∑∫√ ≠ ≤ and tabs\tnewlines\n\nspaces   end",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("byte_tok")
    make_byte_tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 256]}))
    return Tokenizer.from_pretrained(path)


def run(tok: Tokenizer, output: list[int], stop: list[str] = (), chunks: list[int] | None = None,
        prompt: list[int] = (), **kw) -> tuple[list[str], str | None, str]:
    """Feed `output` in chunks; returns the emitted pieces, the stop string, and the flushed tail."""
    detok = IncrementalDetokenizer(tok, list(prompt), list(stop), **kw)
    pieces, i = [], 0
    sizes = iter(chunks) if chunks else None
    while i < len(output):
        n = next(sizes) if sizes else 1
        step = detok.add_tokens(output[i:i + n])
        pieces.append(step.text)
        i += n
        if step.stop_str is not None:
            return pieces, step.stop_str, detok.flush()
    return pieces, None, detok.flush()


# -- Tokenizer --

def test_tokenizer_basics(tok):
    assert tok.vocab_size == 259
    assert tok.eos_token_ids == {258, 256}  # tokenizer's eos plus generation_config.json's
    text = SAMPLES[3]
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # bytes, no BOS
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("<|im_end|>x")) == "x"
    assert tok.decode(tok.encode("<|im_end|>x"), skip_special_tokens=False) == "<|im_end|>x"


# -- Detokenizer: UTF-8 --

@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_equals_full_decode(tok, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(SAMPLES) for _ in range(4))
    ids = tok.encode(text)
    chunks = [rng.randint(1, 5) for _ in ids] if seed % 2 else None
    pieces, stop, tail = run(tok, ids, chunks=chunks, prompt=tok.encode("prompt: 😀"))
    assert stop is None
    assert "".join(pieces) + tail == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_incomplete_character_is_held_then_flushed(tok):
    ids = tok.encode("a€")  # € is three bytes
    pieces, _, tail = run(tok, ids[:-1])
    assert pieces == ["a", "", ""] and tail == "\ufffd"  # an unfinished char only at the very end


def test_prompt_ending_inside_a_character(tok):
    ids = tok.encode("x😀b")
    prompt, output = ids[:3], ids[3:]  # the emoji's first two bytes are in the prompt
    pieces, _, tail = run(tok, output, prompt=prompt)
    assert "".join(pieces) + tail == tok.decode(output)


def test_prefix_space_of_sentencepiece_tokens():
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel(vocab={"<unk>": 0, "▁The": 1, "▁Hello": 2, "▁world": 3, "!": 4},
                                        unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    sp = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>"))
    pieces, _, _ = run(sp, [2, 3, 4])
    assert pieces == ["Hello", " world", "!"]  # decoding tokens one by one would lose the spaces
    pieces, _, _ = run(sp, [2, 3], prompt=[1])
    assert pieces == [" Hello", " world"]  # the space the first token carries after the prompt


# -- Detokenizer: stop strings --

def test_stop_string_spanning_tokens_is_held_back_and_cut(tok):
    ids = tok.encode("Hello. STOP and more")
    detok = IncrementalDetokenizer(tok, [], ["STOP"])
    emitted = "".join(detok.add_tokens([t]).text for t in ids[:9])  # "Hello. ST"
    assert emitted == "Hello. "  # "ST" might begin the stop string
    step = detok.add_tokens(ids[9:11])
    assert (step.text, step.stop_str) == ("", "STOP")
    assert detok.add_tokens(ids[11:]).text == "" and detok.flush() == ""


def test_false_start_is_released(tok):
    pieces, stop, tail = run(tok, tok.encode("STOOD STOP"), ["STOP"])
    assert ("".join(pieces), stop, tail) == ("STOOD ", "STOP", "")


def test_stop_at_the_very_start(tok):
    pieces, stop, _ = run(tok, tok.encode("###rest"), ["###"])
    assert "".join(pieces) == "" and stop == "###"


def test_held_prefix_is_flushed_at_a_normal_finish(tok):
    pieces, stop, tail = run(tok, tok.encode("almost ST"), ["STOP"])
    assert stop is None and "".join(pieces) == "almost " and tail == "ST"


@pytest.mark.parametrize("stops,text,want,hit", [
    (["abc", "bcd"], "xabcd", "x", "abc"),
    (["bcd", "abc"], "xabcd", "x", "abc"),
    (["xyz", "y"], "axyz", "ax", "y"),  # "y" is complete before "xyz" is
    (["ab", "abc"], "zabc", "z", "ab"),
    (["世界", "界"], "你好世界", "你好", "世界"),
])
def test_overlapping_stop_strings_do_not_depend_on_chunking(tok, stops, text, want, hit):
    ids = tok.encode(text)
    for chunks in (None, [len(ids)], [2] * len(ids)):
        pieces, stop, tail = run(tok, ids, stops, chunks=chunks)
        assert ("".join(pieces), stop, tail) == (want, hit, "")


def test_include_stop_str_in_output(tok):
    pieces, stop, _ = run(tok, tok.encode("answer: 42</s>junk"), ["</s>"], include_stop_str_in_output=True)
    assert "".join(pieces) == "answer: 42</s>" and stop == "</s>"


@pytest.mark.parametrize("seed", range(6))
def test_random_stops_match_decode_truncated_at_the_stop(tok, seed):
    rng = random.Random(100 + seed)
    text = "".join(rng.choice(SAMPLES) for _ in range(3))
    start = rng.randrange(len(text) - 4)
    stop_str = text[start:start + rng.randint(1, 4)]
    ids = tok.encode(text)
    include = bool(seed % 2)
    pieces, stop, tail = run(tok, ids, [stop_str, "never-there"], chunks=[rng.randint(1, 4) for _ in ids],
                             include_stop_str_in_output=include)
    full = tok.decode(ids)
    cut = full.index(stop_str) + (len(stop_str) if include else 0)
    assert stop == stop_str and "".join(pieces) + tail == full[:cut]


def test_special_tokens_are_skipped_or_kept(tok):
    ids = tok.encode("hi") + [258]
    assert "".join(run(tok, ids)[0]) == "hi"
    assert "".join(run(tok, ids, skip_special_tokens=False)[0]) == "hi<|im_end|>"


# -- Chat templates --

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TOOL_CONVERSATION = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
]


def test_chatml_template_with_developer_merge_and_list_content(tok):
    messages = [{"role": "system", "content": "A"}, {"role": "developer", "content": "B"},
                {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    original = json.dumps(messages)
    prompt = tok.apply_chat_template(messages)
    assert prompt == ("<|im_start|>system\nA\n\nB<|im_end|>\n<|im_start|>user\none\ntwo<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert json.dumps(messages) == original  # the caller's messages are not modified
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def test_tool_calls_and_tools_reach_the_template(tmp_path):
    template = (
        "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}call {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
        "{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}{% endfor %}"
        "{% if flag %}!{% endif %}"
    )
    make_byte_tokenizer(tmp_path, chat_template=template)
    tok = Tokenizer.from_pretrained(tmp_path)
    prompt = tok.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, flag=True)
    assert prompt == ("[tool get_weather]<system>Be brief.<user>Weather in\nParis?"
                      "<assistant>call get_weather(Paris)<tool>18C for call_1!")


def test_unparsable_arguments_stay_a_string(tmp_path):
    make_byte_tokenizer(tmp_path, chat_template="{{ messages[0].tool_calls[0].function.arguments }}")
    tok = Tokenizer.from_pretrained(tmp_path)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    assert tok.apply_chat_template([{"role": "assistant", "content": None, "tool_calls": [call]}],
                                   add_generation_prompt=False) == "{not json"


def test_template_errors_become_chat_template_error(tmp_path):
    make_byte_tokenizer(tmp_path, chat_template=(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}"
        "{% endif %}ok"))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="Conversation must start with user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])


def test_fallback_chatml_without_a_template(tmp_path):
    make_byte_tokenizer(tmp_path, chat_template=None)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert not tok.hf.chat_template
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    prompt = tok.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n") and '"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\n<tool_response>\n18C\n</tool_response><|im_end|>" in prompt
    assert prompt.count("Be brief.") == 1


# -- The embedded default model's tokenizer --

@pytest.mark.slow
def test_default_model_tokenizer_streams_exactly():
    try:
        from engine.model.loader import resolve_model_dir
    except ImportError as exc:
        pytest.skip(f"engine.model.loader.resolve_model_dir is not available yet ({exc})")
    try:
        tok = Tokenizer.from_pretrained(resolve_model_dir(None))
    except Exception as exc:  # noqa: BLE001 - an absent embedded model is an environment matter here
        pytest.skip(f"the embedded default model could not be resolved here: {exc}")
    text = " ".join(SAMPLES)
    ids = tok.encode(text)
    pieces, _, tail = run(tok, ids, prompt=tok.encode("Say: "))
    assert "".join(pieces) + tail == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    pieces, stop, _ = run(tok, ids, ["日本"])
    assert stop == "日本" and "".join(pieces) == text[:text.index("日本")]
    prompt = tok.apply_chat_template([{"role": "developer", "content": "Be brief."},
                                      {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert "Be brief." in prompt and "Hi" in prompt
