"""Every error case: right status, OpenAI's nested shape, the SDK's exception class, no 4xx retry."""
import logging
import threading
import time

import httpx
import openai
import pytest

from engine import AsyncEngine
from server.app.build import build_app
from tests.support.server_harness import FAILURE_MESSAGE, LiveServer, fail_after_steps, metric, tiny_config, wait_until
from tests.support.tiny_models import make_tiny_model

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / MODEL, "llama")


def start_engine(model_dir, **overrides):
    engine = AsyncEngine(tiny_config(model_dir, **overrides))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = start_engine(model_dir, **{"model.max_context_len": 256})
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine, model_dir):
    config = tiny_config(model_dir, **{"model.max_context_len": 256, "server.max_body_bytes": 16 * 1024})
    with LiveServer(build_app(config, engine)) as live:
        yield live


def client_for(base_url, **kw):
    kw.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=base_url, api_key=kw.pop("api_key", "unused"), timeout=30, **kw)


def assert_error_shape(body, code=None, param=None):
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("fields,param", [
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"stream": "yes please"}, "stream"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_field_is_400_naming_it(server, fields, param):
    body = {"model": MODEL, "messages": MESSAGES, **fields}
    for stream in (False, True):
        response = httpx.post(server.base_url + "/chat/completions",
                              json={**body, "stream": body.get("stream", stream)})
        assert response.status_code == 400, response.text
        assert_error_shape(response.json(), param=param)


def test_invalid_json_body_is_400(server):
    response = httpx.post(server.base_url + "/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert_error_shape(response.json())


def test_sdk_raises_bad_request_and_does_not_retry(server):
    before = metric(server.root, "fdserve_requests_total", '{route="chat",status="400"}')
    client = client_for(server.base_url, max_retries=2)  # the SDK's default
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=9)
    assert err.value.status_code == 400 and err.value.param == "temperature"
    assert metric(server.root, "fdserve_requests_total", '{route="chat",status="400"}') == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_context_length_exceeded_before_the_stream(server, stream):
    long = [{"role": "user", "content": "word " * 300}]
    with pytest.raises(openai.BadRequestError) as err:
        client_for(server.base_url).chat.completions.create(model=MODEL, messages=long, stream=stream)
    assert err.value.code == "context_length_exceeded"
    assert "maximum context length is 256 tokens" in err.value.message
    response = httpx.post(server.base_url + "/completions", json={"model": MODEL, "prompt": "x" * 400})
    assert response.status_code == 400
    assert_error_shape(response.json(), code="context_length_exceeded")


def test_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError) as err:
        client_for(server.base_url).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.code == "model_not_found" and "gpt-4o" in err.value.message
    assert httpx.get(server.base_url + "/models/gpt-4o").status_code == 404
    assert httpx.get(server.base_url + "/no/such/route").status_code == 404


def test_body_over_limit_is_413(server):
    huge = [{"role": "user", "content": "x" * 20_000}]
    with pytest.raises(openai.APIStatusError) as err:
        client_for(server.base_url).chat.completions.create(model=MODEL, messages=huge)
    assert err.value.status_code == 413 and err.value.code == "request_too_large"


def test_suffix_and_best_of_are_400(server):
    client = client_for(server.base_url)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="a", suffix="b")
    assert err.value.param == "suffix"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="a", best_of=3)


def test_api_key(engine, model_dir, caplog):
    config = tiny_config(model_dir, **{"api.api_key": ["sekret-1", "sekret-2"]})
    with caplog.at_level(logging.DEBUG), LiveServer(build_app(config, engine)) as live:
        for key in (None, "wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = httpx.post(live.base_url + "/chat/completions", headers=headers,
                                  json={"model": MODEL, "messages": MESSAGES})
            assert response.status_code == 401
            assert_error_shape(response.json(), code="invalid_api_key")
        with pytest.raises(openai.AuthenticationError):
            client_for(live.base_url, api_key="wrong", max_retries=2).models.list()
        ok = client_for(live.base_url, api_key="sekret-2").chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2)
        assert ok.choices[0].finish_reason in ("stop", "length")
        assert httpx.post(live.root + "/v1/models").status_code == 401  # wrong method, still guarded
        assert httpx.get(live.root + "/health").status_code == 200  # probes need no key
        assert httpx.get(live.root + "/models", headers={"x-api-key": "sekret-1"}).status_code == 200
    assert "sekret" not in caplog.text


def test_overloaded_is_503_with_retry_after(model_dir):
    # Room for 2 requests in flight (1 running + 1 queued); the third is refused at once.
    engine = start_engine(model_dir, **{"backend.max_num_seqs": 1, "server.max_queued_requests": 1})
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    try:
        with LiveServer(build_app(engine.config, engine)) as live, httpx.Client(timeout=30) as http:
            streams = [http.stream("POST", live.base_url + "/chat/completions", json=body) for _ in range(2)]
            readers = []  # keep the line iterators alive: dropping one closes its connection
            for stream in streams:  # the queued one opens too, after a short grace period
                response = stream.__enter__()
                assert response.status_code == 200
                readers.append(response.iter_lines())
                next(readers[-1])
            with pytest.raises(openai.InternalServerError) as err:
                client_for(live.base_url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
            assert err.value.status_code == 503 and err.value.code == "server_overloaded"
            assert err.value.response.headers["retry-after"] == "1"
            for stream in streams:
                stream.__exit__(None, None, None)
            assert wait_until(lambda: metric(live.root, "fdserve_kv_blocks_free")
                              == metric(live.root, "fdserve_kv_blocks_total"))
    finally:
        engine.shutdown()


def test_request_timeout_ends_with_an_error(model_dir):
    engine = start_engine(model_dir, **{"server.request_timeout": 0.3})
    try:
        with LiveServer(build_app(engine.config, engine)) as live:
            client = client_for(live.base_url, max_retries=2)
            kw = dict(model=MODEL, messages=MESSAGES, max_tokens=1900, extra_body={"ignore_eos": True})
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as err:
                client.chat.completions.create(**kw)
            assert err.value.status_code == 504 and err.value.code == "request_timeout"
            assert time.monotonic() - started < 5  # not retried (x-should-retry: false)
            with pytest.raises(openai.APIError) as err:
                for _ in client.chat.completions.create(stream=True, **kw):
                    pass
            assert "request_timeout" in str(err.value.message) or "timeout" in str(err.value.message)
            assert wait_until(lambda: metric(live.root, "fdserve_kv_blocks_free")
                              == metric(live.root, "fdserve_kv_blocks_total"))
    finally:
        engine.shutdown()


def test_engine_failure_mid_stream_is_an_in_band_error(model_dir):
    engine = start_engine(model_dir)
    fail_after_steps(engine)
    try:
        with LiveServer(build_app(engine.config, engine)) as live:
            stream = client_for(live.base_url).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=100, stream=True, extra_body={"ignore_eos": True})
            received = []
            with pytest.raises(openai.APIError) as err:
                for chunk in stream:
                    received.append(chunk)
            assert received and FAILURE_MESSAGE in err.value.message
            assert httpx.get(live.root + "/health").status_code == 503
            response = httpx.post(live.base_url + "/chat/completions", json={"model": MODEL, "messages": MESSAGES})
            assert response.status_code == 503
    finally:
        engine.shutdown()


def test_health_is_503_while_loading(model_dir):
    release = threading.Event()

    def slow_factory(config):
        release.wait(20)
        return AsyncEngine(config)

    app = build_app(tiny_config(model_dir), engine_factory=slow_factory)
    with LiveServer(app) as live:
        response = httpx.get(live.root + "/health")
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert_error_shape(response.json(), code="model_loading")
        with pytest.raises(openai.InternalServerError) as err:
            client_for(live.base_url).chat.completions.create(model=MODEL, messages=MESSAGES)
        assert err.value.status_code == 503
        release.set()
        assert wait_until(lambda: httpx.get(live.root + "/health").status_code == 200)
        reply = client_for(live.base_url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert reply.choices
    app.state.fdserve.engine.shutdown()


def test_load_failure_is_reported(tmp_path):
    app = build_app(tiny_config(tmp_path / "missing"))
    with LiveServer(app) as live:
        assert wait_until(lambda: app.state.fdserve.phase == "failed")
        response = httpx.get(live.root + "/health")
        assert response.status_code == 503 and response.json()["status"] == "failed"


def test_chunked_body_over_limit_is_413(server):
    def chunks():
        for _ in range(40):
            yield b"x" * 1024

    response = httpx.post(server.base_url + "/chat/completions", content=chunks(),
                          headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert_error_shape(response.json(), code="request_too_large")
