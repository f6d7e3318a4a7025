"""The real openai SDK against a live uvicorn + the real engine on a tiny random model (CPU)."""
import json
import re

import httpx
import openai
import pytest

from engine import AsyncEngine
from server.app.build import build_app
from tests.support.server_harness import TOOLS_TEMPLATE, LiveServer, metric, tiny_config, wait_until
from tests.support.tiny_models import make_tiny_model

MODEL = "tiny"
MAX_CONTEXT = 1024
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("m") / MODEL, "llama", chat_template=TOOLS_TEMPLATE)
    eng = AsyncEngine(tiny_config(model_dir, **{"model.max_context_len": MAX_CONTEXT}))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    config = tiny_config(engine.config.model.name, **{"model.max_context_len": MAX_CONTEXT,
                                                      "server.max_body_bytes": 64 * 1024})
    with LiveServer(build_app(config, engine)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def chat(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", MESSAGES)
    return client.chat.completions.create(**kw)


def count_tokens(server, messages):
    return httpx.post(server.root + "/tokenize", json={"messages": messages}).json()["count"]


# ----- happy paths ---------------------------------------------------------------------------

def test_chat_non_stream_usage_and_logprobs(client, server):
    reply = chat(client, max_tokens=12, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str)
    assert reply.usage.prompt_tokens == count_tokens(server, MESSAGES)
    assert reply.usage.completion_tokens == 12 == len(choice.logprobs.content)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


def test_chat_stream_with_usage(client, server):
    chunks = list(chat(client, max_tokens=9, stream=True, stream_options={"include_usage": True},
                       logprobs=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    *body, last_choice, usage_chunk = chunks
    assert last_choice.choices[0].finish_reason == "length" and all(
        c.choices[0].finish_reason is None for c in body)
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    streamed_tokens = sum(len(c.choices[0].logprobs.content) for c in body if c.choices[0].logprobs)
    assert usage_chunk.usage.completion_tokens == streamed_tokens == 9
    assert usage_chunk.usage.prompt_tokens == count_tokens(server, MESSAGES)


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(chat(client, max_tokens=4, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_n_2_stream_and_not(client):
    reply = chat(client, n=2, max_tokens=5, temperature=1.0, seed=3)
    assert [c.index for c in reply.choices] == [0, 1]
    finished = {}
    for chunk in chat(client, n=2, max_tokens=5, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert set(finished) == {0, 1}


def test_max_tokens_1_gives_length(client):
    reply = chat(client, max_tokens=1, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 1
    reply = chat(client, max_completion_tokens=1, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"


def test_stop_string(client):
    full = chat(client, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}).choices[0].message.content
    printable = [i for i in range(5, len(full) - 2) if full[i:i + 2].isprintable() and "\ufffd" not in full[i:i + 2]]
    assert printable, full
    cut = printable[0]
    stop = full[cut:cut + 2]
    reply = chat(client, max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == full[:full.index(stop)]


def test_seed_reproducible(client):
    kw = dict(max_tokens=16, temperature=1.0, top_p=0.95,
              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    first = chat(client, seed=1234, **kw).choices[0].message.content
    assert chat(client, seed=1234, **kw).choices[0].message.content == first
    others = {chat(client, seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert others != {first}


def test_sampling_fields_and_content_forms_accepted(client):
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    reply = chat(client, messages=messages, max_tokens=3, presence_penalty=0.5, frequency_penalty=0.5,
                 logit_bias={"65": 2.0}, tools=[WEATHER_TOOL], parallel_tool_calls=False, user="u1",
                 extra_body={"repetition_penalty": 1.1, "top_k": 5, "min_p": 0.05, "unknown_field": {"x": 1},
                             "reasoning_effort": "low"})
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_json_object_output_parses(client, engine):
    # A random model rarely closes a JSON string; a bias towards "}" ends the object early, and
    # the grammar still decides what is legal (unconstrained, the bias alone would give "}}}}").
    close_brace = str(engine.tokenizer.encode("}")[0])
    for stream in (False, True):
        kw = dict(max_tokens=64, response_format={"type": "json_object"}, logit_bias={close_brace: 8.0})
        if stream:
            chunks = list(chat(client, stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            reply = chat(client, **kw)
            text = reply.choices[0].message.content
            assert reply.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(text), dict)


def test_json_schema_output_matches(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    reply = chat(client, max_tokens=64, temperature=1.0, seed=5,
                 response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    value = json.loads(reply.choices[0].message.content)
    assert isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)


def test_tool_call_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = chat(client, messages=messages, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=120)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Tokyo")
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    final = chat(client, messages=messages, tools=[WEATHER_TOOL], max_tokens=8, extra_body={"ignore_eos": True})
    assert final.choices[0].finish_reason in ("length", "stop")


def test_tool_call_stream_deltas(client):
    chunks = list(chat(client, tools=[WEATHER_TOOL], max_tokens=120, stream=True,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id and first.type == "function" and first.function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments)["city"] in ("Paris", "Tokyo")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_completions_endpoint(client):
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, logprobs=2, echo=True,
                                      extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.text.startswith("Hello") and choice.finish_reason == "length"
    # echo: the prompt's tokens first (the first without a logprob), then the 5 generated ones
    num_prompt = reply.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == num_prompt + 5 and len(choice.logprobs.top_logprobs[-1]) == 2
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    # offsets index the returned text, which starts with the echoed prompt
    generated = slice(num_prompt, None)
    assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.text_offset[generated][0] == len("Hello")
    assert all(choice.text[o:o + len(t)] == t for o, t in zip(choice.logprobs.text_offset[generated],
                                                              choice.logprobs.tokens[generated], strict=True))
    batch = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=3)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    chunks = list(client.completions.create(model=MODEL, prompt=[65, 66, 67], max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"



def test_completions_echo_scores_the_prompt(client, engine):
    """echo + logprobs: the prompt's tokens come first with the logprobs and top entries the engine's
    prompt_logprobs give them (the first null), text_offset from 0; max_tokens = 0 scores the prompt
    alone, in a stream too. max_tokens = 0 without echo is a 400 naming max_tokens."""
    from engine import LLM, SamplingParams
    ids = [65, 66, 67, 68, 69, 70, 71, 72, 73]
    offline = LLM(model=engine.config.model.name, block_size=16, cpu_kv_cache_bytes=16 << 20)
    want = offline.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=2))[0].prompt_logprobs
    texts = [offline.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    choice, scored = reply.choices[0], reply.choices[0].logprobs
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 0
    assert scored.tokens == texts and choice.text == offline.tokenizer.decode(ids)
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    assert scored.token_logprobs[1:] == pytest.approx([e.logprob for e in want[1:]], abs=1e-5)
    # top_logprobs is keyed by token text, as OpenAI's legacy format is (two ids may share a text)
    assert [set(t) for t in scored.top_logprobs[1:]] == [{texts_of(offline, i) for i, _ in e.top} for e in want[1:]]
    assert scored.text_offset == [sum(len(t) for t in texts[:k]) for k in range(len(ids))]
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0,
                                            stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in streamed for t in p.tokens] == texts
    assert [v for p in streamed for v in p.token_logprobs][1:] == pytest.approx(scored.token_logprobs[1:], abs=1e-5)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=0)
    assert err.value.body["param"] == "max_tokens" and "echo" in err.value.body["message"]


def texts_of(llm, token_id):
    return llm.tokenizer.decode([token_id], skip_special_tokens=False)

def test_models_health_tokenize_and_both_prefixes(server):
    for base in (server.root, server.base_url):
        models = openai.OpenAI(base_url=base, api_key="x").models.list()
        assert [m.id for m in models.data] == [MODEL]
        card = httpx.get(base + "/models").json()["data"][0]
        assert card["max_model_len"] == MAX_CONTEXT == card["context_length"]
        assert httpx.get(base + "/health").status_code == 200
    tokens = httpx.post(server.root + "/tokenize", json={"prompt": "héllo"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_CONTEXT
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "héllo"
    assert httpx.post(server.root + "/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_metrics_exported(server, client):
    chat(client, max_tokens=3)
    text = httpx.get(server.root + "/metrics").text
    for name in ("fdserve_requests_total", "fdserve_prompt_tokens_total", "fdserve_generation_tokens_total",
                 "fdserve_time_to_first_token_seconds_bucket", "fdserve_time_per_output_token_seconds_bucket",
                 "fdserve_inter_token_latency_seconds_bucket", "fdserve_num_requests_waiting",
                 "fdserve_kv_cache_usage_ratio", "fdserve_prefix_cache_hit_rate", "fdserve_preemptions_total",
                 "fdserve_attention_path_info", "fdserve_decode_graph_steps_total"):
        assert name in text, name
    # on the CPU the decode path is eager (no CUDA graph), and says so
    assert 'fdserve_decode_path_info{path="eager' in text and "asynchronous scheduling" in text
    assert re.search(r'fdserve_kv_cache_info\{dtype="(bfloat16|float32)"\}', text)   # the pages: the model dtype
    assert metric(server.root, "fdserve_decode_graph_steps_total") == 0
    assert metric(server.root, "fdserve_requests_total", '{route="chat",status="200"}') >= 1


# ----- lifecycle -----------------------------------------------------------------------------

def test_disconnect_mid_stream_frees_blocks(server):
    total = metric(server.root, "fdserve_kv_blocks_total")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(server.root, "fdserve_kv_blocks_free") < total  # the request holds blocks now
    assert wait_until(lambda: metric(server.root, "fdserve_kv_blocks_free") == total
                      and metric(server.root, "fdserve_num_requests_running") == 0)
    assert wait_until(lambda: metric(server.root, "fdserve_requests_total", '{route="chat",status="499"}') >= 1)


def test_disconnect_during_a_non_streaming_request_aborts_it(server):
    total = metric(server.root, "fdserve_kv_blocks_total")
    before = metric(server.root, "fdserve_requests_total", '{route="chat",status="499"}')
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/chat/completions", json=body, timeout=0.3)
    assert wait_until(lambda: metric(server.root, "fdserve_requests_total", '{route="chat",status="499"}')
                      == before + 1)
    assert wait_until(lambda: metric(server.root, "fdserve_kv_blocks_free") == total)
