"""The OpenAI API end to end (operations): errors, auth, disconnects, metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server_helpers import GREEDY, MODEL, PROMPT, Served, error_of, scrape_metrics, serve


@pytest.fixture(scope="module")
def served(tiny_dirs) -> Iterator[Served]:
    yield from serve(tiny_dirs)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 3.0}, "temperature"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"prompt": ""}, "prompt"),
        ({"max_tokens": 300}, "max_tokens"),
        ({"prompt": [5, 100_000]}, "prompt"),
        ({"top_p": 0.0}, "top_p"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 50}, "logprobs"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ],
)
def test_bad_requests_are_400s_in_openai_shape(served, kwargs, param):
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(**args)
    error = error_of(info.value)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_context_length_error_is_explained(served):
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=300)
    assert error_of(info.value)["code"] == "context_length_exceeded"
    assert "256" in str(info.value)


def test_unknown_model_and_auth_errors(served):
    with pytest.raises(openai.NotFoundError) as info:
        served.client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert error_of(info.value)["code"] == "model_not_found"
    wrong = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert error_of(info.value)["code"] == "invalid_api_key"
    with served.http(key=None) as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        odd = http.get("/v1/models", headers={"Authorization": "Bearer cl\xe9".encode("latin-1")})
    assert response.status_code == 401 and set(response.json()["error"]) >= {"message", "type"}
    assert odd.status_code == 401  # a non-ASCII key is just a wrong key, not a crash


def test_malformed_bodies_are_400s_in_openai_shape(served):
    with served.http() as http:
        bad_json = http.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        missing = http.post("/v1/chat/completions", json={"model": MODEL})
        wrong_type = http.post("/v1/completions", json={"model": MODEL, "prompt": {"a": 1}})
        no_route = http.get("/v1/nothing-here")
    for response in (bad_json, missing, wrong_type):
        assert response.status_code == 400
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert "JSON" in bad_json.json()["error"]["message"]
    assert missing.json()["error"]["param"] == "messages"
    assert no_route.status_code == 404 and "error" in no_route.json()


@pytest.mark.parametrize(
    ("endpoint", "kwargs", "param"),
    [
        ("completions", {"best_of": 2}, "best_of"),
        ("completions", {"suffix": "}"}, "suffix"),
        ("completions", {"extra_body": {"best_of_wishes": 1}}, "best_of_wishes"),
        ("chat", {"service_tier": "flex"}, "service_tier"),
        ("chat", {"metadata": {"team": "a"}}, "metadata"),
        ("chat", {"extra_body": {"best_of_wishes": 1}}, "best_of_wishes"),
        ("chat", {"response_format": {"type": "json_object", "mode": "x"}}, "response_format"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]}, "tools"),
    ],
)
def test_fields_the_server_does_not_implement_are_400s_naming_them(served, endpoint, kwargs, param):
    """Refused, not ignored: a client asking for something the server does not do hears so,
    in nested objects too (`param` is then the path to the key)."""
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "completions":
            served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **kwargs)
        else:
            served.client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=2, stream=False, **kwargs
            )
    error = error_of(info.value)
    assert error["type"] == "invalid_request_error" and "not supported" in error["message"]
    assert error["param"].split(".")[0].split("[")[0] == param, error


def test_harmless_metadata_and_the_extensions_are_accepted(served):
    """`user` is accepted and ignored (it changes no output); vLLM's extensions and Tandem's
    `speculation` are fields of their own; a chat message's extra keys go to its template."""
    out = served.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi", "reasoning_content": "x"}],
        max_tokens=2,
        user="someone",
        extra_body={"top_k": 5, "min_tokens": 1, "speculation": {"max_draft_tokens": 1}},
    )
    assert out.choices[0].message.content is not None
    served.wait_idle()


def test_closing_a_stream_aborts_the_request(served):
    stream = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=200, stream=True, **GREEDY
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)
        if received == 3:
            break
    assert served.engine.stats().num_running == 1
    stream.close()
    served.wait_idle(timeout=1.0)


def test_disconnecting_during_a_plain_request_aborts_it(served):
    with served.http() as http, pytest.raises(httpx.ReadTimeout):
        http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True},
            # Far shorter than 200 tokens take even on a fast machine (dozens of engine steps),
            # so the client always leaves mid-generation.
            timeout=0.05,
        )
    served.wait_idle(timeout=1.0)


def test_metrics_move_with_traffic(served):
    before = scrape_metrics(served)
    start = time.perf_counter()
    served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, **GREEDY)
    wall = time.perf_counter() - start
    with pytest.raises(openai.BadRequestError):
        served.client.completions.create(model=MODEL, prompt=PROMPT, temperature=9)
    after = scrape_metrics(served)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("tandem_prompt_tokens_total") > 0
    assert delta("tandem_generation_tokens_total") == 6
    assert delta("tandem_spec_drafted_tokens_total") > 0
    assert delta("tandem_spec_drafted_tokens_by_position_total", position="0") > 0
    assert delta("tandem_time_to_first_token_seconds_count") == 1
    assert delta("tandem_inter_token_latency_seconds_count") == 5
    assert delta("tandem_e2e_request_latency_seconds_count") == 1
    assert delta("tandem_requests_finished_total", finish_reason="length") == 1
    assert delta("tandem_request_errors_total", status="400") == 1
    assert after[("tandem_requests_running", ())] == 0
    assert 0 <= after[("tandem_kv_cache_usage_ratio", ())] <= 1
    assert ("tandem_spec_mean_draft_length", ()) in after
    assert ("tandem_preemptions_total", ()) in after
    assert ("tandem_spec_blocks_released_total", ()) in after
    assert ("tandem_spec_tree_steps_total", ()) in after
    # Where step time went: every part moved (this server drafts), and the parts add up to
    # no more than the wall time the request took.
    parts = ("target_forward", "draft", "verify", "schedule")
    moved = {part: delta("tandem_step_seconds_total", part=part) for part in parts}
    assert all(seconds > 0 for seconds in moved.values()), moved
    assert sum(moved.values()) < wall


def test_a_body_over_the_limit_gets_413_before_it_is_parsed(served):
    """--max-body-bytes (8 MiB by default): declared or chunked, the answer is 413 in the
    OpenAI error shape; a body just under it is parsed as usual (here: 400, bad JSON)."""
    limit = served.settings.server.max_body_bytes
    headers = {"Authorization": f"Bearer {served.client.api_key}"}
    url = f"{served.url}/v1/completions"

    def chunks(total: int) -> Iterator[bytes]:
        for _ in range(total // (1 << 20)):
            yield b" " * (1 << 20)
        yield b" " * (total % (1 << 20))

    for body in (b" " * (limit + 1), chunks(limit + 1)):  # Content-Length, then chunked
        answer = httpx.post(url, content=body, headers=headers, timeout=30)
        assert answer.status_code == 413
        assert answer.json()["error"]["code"] == "request_too_large"
    under = httpx.post(url, content=b"{" + b" " * (limit - 1), headers=headers, timeout=30)
    assert under.status_code == 400


def test_the_key_scope_all_closes_every_path_but_health(tiny_dirs):
    """--api-key-scope all: /metrics, /version, /docs and /openapi.json need the key too (401,
    OpenAI shape); /health still answers the probes."""
    server = serve(tiny_dirs, server__api_key_scope="all")
    served = next(server)
    try:
        auth = {"Authorization": f"Bearer {served.client.api_key}"}
        for path in ("/metrics", "/version", "/docs", "/openapi.json"):
            refused = httpx.get(served.url + path, timeout=10)
            assert refused.status_code == 401, path
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(served.url + path, headers=auth, timeout=10).status_code == 200
        assert httpx.get(served.url + "/health", timeout=10).status_code == 200
    finally:
        server.close()


def test_the_default_key_scope_leaves_scrapers_and_docs_open(served):
    """--api-key-scope v1 (the default): only the API needs the key."""
    for path in ("/metrics", "/version", "/docs", "/openapi.json", "/health"):
        assert httpx.get(served.url + path, timeout=10).status_code == 200, path
