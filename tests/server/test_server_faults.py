"""One request never takes the server down: odd sampling values get answers, a request that fails
inside the engine gets an OpenAI-shaped error while the others complete, an engine that cannot
continue says so on /health and asks the process to exit, and the OpenAPI document shows the
real request bodies."""
import json
import threading

import httpx
import pytest

from engine import AsyncEngine
from server.app.build import build_app
from server.core.state import EXIT_ENGINE_FAILED
from tests.support.server_harness import LiveServer, metric, tiny_config, wait_until
from tests.support.tiny_models import make_tiny_model

MODEL = "tiny"
MARKER = "FAULT"   # a prompt with this text fails inside the engine once injected


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / MODEL, "llama")


@pytest.fixture(scope="module")
def live(model_dir):
    engine = AsyncEngine(tiny_config(model_dir))
    engine.start()
    with LiveServer(build_app(tiny_config(model_dir), engine)) as server:
        yield server, engine
    engine.shutdown()


def chat(base_url, content="Hi", stream=False, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 12,
            "stream": stream, **fields}
    return httpx.post(base_url + "/chat/completions", json=body, timeout=60)


def stream_events(response):
    return [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]


ODD_SAMPLING = [{"top_p": 1e-154}, {"temperature": 2, "top_p": 1e-300}, {"top_p": 5e-324},
                {"top_k": -7}, {"top_k": 10**30}, {"min_p": 1.0}, {"temperature": 1e-300},
                {"repetition_penalty": 5e-324}, {"presence_penalty": -2, "frequency_penalty": 2},
                {"logit_bias": {str(t): -100 for t in range(258)}}]


@pytest.mark.parametrize("sampling", ODD_SAMPLING)
def test_valid_extreme_sampling_values_answer_on_both_routes(live, sampling):
    server, _ = live
    for stream in (False, True):
        response = chat(server.base_url, stream=stream, **sampling)
        assert response.status_code == 200, response.text
        if stream:
            events = stream_events(response)
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        else:
            assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
        completion = httpx.post(server.base_url + "/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 6, "stream": stream, **sampling})
        assert completion.status_code == 200, completion.text
    assert chat(server.base_url).status_code == 200
    assert httpx.get(server.root + "/health").status_code == 200


def test_a_logit_bias_that_bans_every_token_is_a_400(live):
    server, _ = live
    response = chat(server.base_url, logit_bias={str(t): -100 for t in range(259)})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logit_bias"


def inject_forward_fault(engine, fault, after_tokens=3):
    """Make forwards that include a MARKER prompt with `after_tokens` output tokens raise `fault`
    (so streams are open by then); returns the undo."""
    runner = engine.engine.runner
    execute = runner.execute
    decode = engine.tokenizer.decode

    def faulty(seqs, input_ids=None):
        if any(MARKER in decode(s.token_ids[:s.num_prompt_tokens]) and s.num_output_tokens >= after_tokens
               for s in seqs):
            raise fault
        return execute(seqs, input_ids)
    runner.execute = faulty
    return lambda: setattr(runner, "execute", execute)


def test_a_failing_request_gets_an_error_and_fifteen_others_complete(live):
    server, engine = live
    before = metric(server.root, "fdserve_request_internal_errors_total", '{stage="forward"}')
    undo = inject_forward_fault(engine, ValueError("injected"))
    results: dict[int, httpx.Response] = {}
    barrier = threading.Barrier(16)

    def send(i):
        barrier.wait()
        content = f"{MARKER} please" if i in (4, 11) else f"request {i}"
        results[i] = chat(server.base_url, content, stream=i % 2 == 1, max_tokens=16, temperature=0,
                          ignore_eos=True)
    threads = [threading.Thread(target=send, args=(i,)) for i in range(16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        undo()
    plain_failure = results[4]       # not streamed (odd indices stream)
    assert plain_failure.status_code == 500
    error = plain_failure.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error") and "injected" in error["message"]
    streamed_failure = stream_events(results[11])
    assert streamed_failure[-1] == "[DONE]"
    assert json.loads(streamed_failure[-2])["error"]["code"] == "internal_error"
    for i, response in results.items():
        if i in (4, 11):
            continue
        assert response.status_code == 200, (i, response.text)
        if i % 2:
            assert stream_events(response)[-1] == "[DONE]"
            assert not any('"error"' in e for e in stream_events(response))
        else:
            assert response.json()["usage"]["completion_tokens"] == 16
    assert metric(server.root, "fdserve_request_internal_errors_total", '{stage="forward"}') == before + 2
    assert wait_until(lambda: metric(server.root, "fdserve_kv_blocks_free") == metric(server.root,
                                                                                      "fdserve_kv_blocks_total"))
    assert chat(server.base_url, MARKER, ignore_eos=True).status_code == 200   # the fault is gone: so is the error
    assert httpx.get(server.root + "/health").status_code == 200


def test_an_engine_that_cannot_continue_reports_it_and_asks_to_exit(model_dir):
    engine = AsyncEngine(tiny_config(model_dir))
    engine.start()
    app = build_app(tiny_config(model_dir), engine)
    state = app.state.fdserve
    asked_to_exit = threading.Event()
    state.on_failure = asked_to_exit.set
    inject_forward_fault(engine, RuntimeError("CUDA error: an illegal memory access was encountered"))
    try:
        with LiveServer(app) as server:
            assert chat(server.base_url).status_code == 200
            response = chat(server.base_url, MARKER, stream=True, max_tokens=64, ignore_eos=True)
            events = stream_events(response)
            assert events[-1] == "[DONE]" and "illegal memory access" in json.loads(events[-2])["error"]["message"]
            assert asked_to_exit.wait(10) and state.exit_code == EXIT_ENGINE_FAILED
            health = httpx.get(server.root + "/health")
            assert health.status_code == 503 and health.json()["status"] == "failed"
            assert chat(server.base_url).status_code == 503
            assert metric(server.root, "fdserve_engine_exits_total", '{reason="device_error"}') == 1
    finally:
        engine.shutdown()


def test_the_openapi_document_shows_every_request_body(live):
    server, _ = live
    document = httpx.get(server.root + "/openapi.json").json()
    schemas = document["components"]["schemas"]
    posts = {path: item["post"] for path, item in document["paths"].items() if "post" in item}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/tokenize", "/v1/detokenize"} <= set(posts)
    for path, operation in posts.items():
        ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        name = ref.rsplit("/", 1)[-1]
        assert name in schemas and schemas[name]["properties"], path
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    refs = set()

    def collect(node):
        if isinstance(node, dict):
            refs.update(v for k, v in node.items() if k == "$ref")
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)
    collect(document)
    assert all(r.rsplit("/", 1)[-1] in schemas for r in refs)
    assert httpx.get(server.root + "/docs").status_code == 200


def test_the_openapi_document_needs_no_key_and_the_api_still_does(model_dir, live):
    _, engine = live
    config = tiny_config(model_dir, **{"api.api_key": "secret"})
    with LiveServer(build_app(config, engine)) as server:
        assert httpx.get(server.root + "/openapi.json").status_code == 200
        assert chat(server.base_url).status_code == 401
        assert httpx.post(server.base_url + "/chat/completions", headers={"Authorization": "Bearer secret"},
                          json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).status_code == 200
