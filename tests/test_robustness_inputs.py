"""Hand-written nasty inputs: each gets a 4xx in the OpenAI shape or a valid 200, never a 5xx.

A request the server cannot refuse cheaply (a 1 MB prompt) is timed as well: a refusal must not
take the server down with it or leave anything in the engine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.robustness_helpers import GREEDY_BODY, HEADERS, openai_error, sse_data, stream_text
from tests.server_helpers import MODEL, PROMPT, Served, serve

MAX_MODEL_LEN = 64
MAX_REQUEST_TOKENS = 512
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def served(tiny_dirs) -> Iterator[Served]:
    yield from serve(
        tiny_dirs,
        model__max_model_len=MAX_MODEL_LEN,
        server__max_request_tokens=MAX_REQUEST_TOKENS,
    )


@pytest.fixture(scope="module")
def http(served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, headers=HEADERS, timeout=30) as client:
        yield client


def _server_errors(url: str) -> list[str]:
    """The 5xx lines of tandem_request_errors_total."""
    text = httpx.get(f"{url}/metrics").text
    prefix = 'tandem_request_errors_total{status="5'
    return [ln for ln in text.splitlines() if ln.startswith(prefix)]


@pytest.fixture(scope="module")
def startup_errors(served) -> list[str]:
    """The 5xx counted before any test: /health answers 503 while the server is loading, and
    the harness polls it until it is ready."""
    return _server_errors(served.url)


@pytest.fixture(autouse=True)
def no_server_errors(served, startup_errors) -> Iterator[None]:
    """After every test of this module, whatever order they run in: no request so far was
    answered with a 5xx."""
    yield
    assert _server_errors(served.url) == startup_errors


def _completion(**fields: object) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


def _chat(content: object = "hi", **fields: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def _raw(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": "application/json"})


def _refused(response: httpx.Response, param: str | None = None, code: str | None = None) -> dict:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = openai_error(response.status_code, response.json())
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def _with_text(path: str, literal: bytes, rest: bytes = b"") -> bytes:
    """A body whose prompt (or only chat message) is the raw JSON `literal`, plus `rest`."""
    if path == COMPLETIONS:
        return b'{"prompt": ' + literal + rest + b"}"
    return b'{"messages": [{"role": "user", "content": ' + literal + b"}]" + rest + b"}"


BAD_BODIES = {
    "not json": lambda path: b"{not json",
    "truncated": lambda path: _with_text(path, b'"abc')[:-1],
    "empty body": lambda path: b"",
    "json null": lambda path: b"null",
    "json list": lambda path: b"[1, 2, 3]",
    "json string": lambda path: b'"prompt"',
    "NaN temperature": lambda path: _with_text(path, b'"a"', b', "temperature": NaN'),
    "Infinity penalty": lambda path: _with_text(path, b'"a"', b', "presence_penalty": Infinity'),
    "invalid UTF-8": lambda path: _with_text(path, b'"\xff\xfe\xc3\x28 abc"'),
    "lone surrogate": lambda path: _with_text(path, b'"abc \\ud800 def"'),
    "lone surrogate key": lambda path: _with_text(path, b'"abc"', b', "\\udfff": 1'),
    "lone surrogate model": lambda path: _with_text(path, b'"abc"', b', "model": "\\ud83d"'),
    "lone surrogate stop": lambda path: _with_text(path, b'"abc"', b', "stop": ["\\udc00"]'),
    "deep nesting": lambda path: _with_text(path, b"[" * 5000 + b"]" * 5000),
}


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_malformed_bodies_are_400s(http, path, name):
    _refused(_raw(http, path, BAD_BODIES[name](path)))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": {"a": 1}}, "prompt"),
        ({"prompt": [[1, 2], "mixed"]}, "prompt"),
        ({"prompt": [1.5, 2]}, "prompt"),
        ({"prompt": True}, "prompt"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"n": [2]}, "n"),
        ({"temperature": "hot"}, "temperature"),
        ({"stream": [True]}, "stream"),
        ({"stop": 7}, "stop"),
        ({"seed": 2**80}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"stream_options": "yes", "stream": True}, "stream_options"),
        ({"stop_token_ids": [-5]}, "stop_token_ids[0]"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"5": "strong"}}, "logit_bias"),
        ({"logit_bias": {"5": 1e300}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"stream_options": {"include_usage": True, "extra": 1}, "stream": True}, "stream_options"),
    ],
)
def test_wrong_types_and_ranges_name_the_field(http, fields, param):
    error = _refused(http.post(COMPLETIONS, json=_completion(**fields)))
    # A union field's errors name the branch too ("prompt.str"); the field comes first.
    assert error["param"].split(".")[0] == param, error


@pytest.mark.parametrize(
    "body",
    [
        _chat(content=5),
        _chat(content=[{"type": "image_url", "image_url": "x"}]),
        {"model": MODEL, "messages": []},
        {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
        {"model": MODEL, "messages": "hi"},
        {"model": MODEL, "messages": [None]},
        _chat(max_completion_tokens=0),
        _chat(top_logprobs=3),
    ],
)
def test_bad_chat_bodies_are_400s(http, body):
    _refused(http.post(CHAT, json=body))


def test_huge_n_and_huge_max_tokens(http, served):
    _refused(http.post(COMPLETIONS, json=_completion(n=10**6)), param="n")
    _refused(http.post(COMPLETIONS, json=_completion(max_tokens=10**30)), param="max_tokens")
    _refused(http.post(COMPLETIONS, json=_completion(max_tokens=2**63)), param="max_tokens")
    # Legal one by one, too much together: prompt + max_tokens x n over --max-request-tokens.
    error = _refused(
        http.post(COMPLETIONS, json=_completion(n=128, max_tokens=32)), code="request_too_large"
    )
    assert str(MAX_REQUEST_TOKENS) in error["message"]
    _refused(http.post(CHAT, json=_chat(n=20, max_tokens=40)), code="request_too_large")
    many_prompts = _completion(prompt=[[5, 6, 7]] * 200, max_tokens=1)  # 200 choices fit
    _refused(http.post(COMPLETIONS, json=many_prompts), code="request_too_large")
    # Without max_tokens a chat request gets what fits the request budget, not a refusal.
    response = http.post(CHAT, json=_chat(n=16, temperature=0.0, ignore_eos=True))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= MAX_REQUEST_TOKENS
    served.wait_idle(timeout=5)


def test_prompts_and_choices_per_request_are_bounded_before_any_is_encoded(http, served):
    """server/protocol.py's MAX_CHOICES (256): at most that many prompts, and prompts x n."""
    many = _completion(prompt=[[5, 6, 7]] * 257, max_tokens=1)
    assert "at most 256 prompts" in _refused(http.post(COMPLETIONS, json=many), "prompt")["message"]
    many_texts = _completion(prompt=["a"] * 100_000, max_tokens=1)
    _refused(http.post(COMPLETIONS, json=many_texts), "prompt")
    choices = _completion(prompt=[[5, 6, 7]] * 20, n=13, max_tokens=1)  # 260 choices
    assert "256 choices" in _refused(http.post(COMPLETIONS, json=choices), "n")["message"]
    served.wait_idle(timeout=5)


def test_prompts_over_the_context(http, served):
    long_ids = [5] * (MAX_MODEL_LEN + 1)
    for body, path in [
        (_completion(prompt=long_ids), COMPLETIONS),
        (_completion(prompt=[[5, 6], long_ids]), COMPLETIONS),
        (_completion(prompt=[5] * (MAX_MODEL_LEN - 2), max_tokens=3), COMPLETIONS),
        (_chat(content="def add(a, b): " * 40), CHAT),
    ]:
        _refused(http.post(path, json=body), code="context_length_exceeded")
    served.wait_idle()


def test_one_megabyte_prompts_are_refused_promptly(http, served):
    big = "def add(a, b):\n    return a + b\n" * (2**20 // 32)
    for path, body in [(COMPLETIONS, _completion(prompt=big)), (CHAT, _chat(content=big))]:
        started = time.monotonic()
        _refused(http.post(path, json=body), code="context_length_exceeded")
        elapsed = time.monotonic() - started
        print(f"\n1 MB prompt on {path}: refused in {elapsed:.2f}s")
        assert elapsed < 20
    # The server still answers at once.
    assert http.post(COMPLETIONS, json=_completion()).status_code == 200
    served.wait_idle()


def test_token_ids_out_of_range(http, served):
    vocab = served.engine.vocab_size
    for prompt in ([vocab], [-1], [5, 2**40], [[5], [vocab + 7]]):
        _refused(http.post(COMPLETIONS, json=_completion(prompt=prompt)), param="prompt")
    # The last valid id is fine.
    assert http.post(COMPLETIONS, json=_completion(prompt=[vocab - 1])).status_code == 200
    # Stop ids index the logits (min_tokens masks them): out of range must not reach a step.
    for fields in (
        {"stop_token_ids": [vocab + 1, 3]},
        {"stop_token_ids": [vocab], "min_tokens": 1},
    ):
        _refused(http.post(COMPLETIONS, json=_completion(**fields)))
    # So do logit_bias's: an id past the vocabulary is refused, the last one is biased.
    _refused(http.post(COMPLETIONS, json=_completion(logit_bias={str(vocab): 5})), "logit_bias")
    last = _completion(logit_bias={str(vocab - 1): 5})
    assert http.post(COMPLETIONS, json=last).status_code == 200
    served.wait_idle()


def test_stop_lists(http, served):
    error = _refused(http.post(COMPLETIONS, json=_completion(stop=[f"s{i}" for i in range(100)])))
    assert error["param"] == "stop"
    _refused(http.post(CHAT, json=_chat(stop=["x"] * 100, max_tokens=4)), param="stop")
    _refused(http.post(COMPLETIONS, json=_completion(stop=["ok", ""])), param="stop")
    # Long and odd stop strings are legal.
    odd = ["\x00", "😀", "a" * 10_000, "\n\n", "日本"]
    response = http.post(COMPLETIONS, json=_completion(stop=odd))
    assert response.status_code == 200, response.text
    served.wait_idle()


@pytest.mark.parametrize(
    "prompt", [" ", "   \n\t ", "\x00", "\x00\x01\x1b[31m\x7f", "\u202e\u200b\ufeff", "😀" * 8]
)
def test_whitespace_and_control_character_prompts_are_served(http, served, prompt):
    for path, body in [
        (COMPLETIONS, {**GREEDY_BODY, "prompt": prompt, "max_tokens": 3}),
        (CHAT, {**GREEDY_BODY, **_chat(content=prompt), "max_tokens": 3}),
    ]:
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
    with http.stream("POST", COMPLETIONS, json={**GREEDY_BODY, "prompt": prompt, "stream": True}):
        pass  # opened and dropped at once: must not leak
    served.wait_idle(timeout=2)


def test_empty_prompts(http, served):
    for prompt in ("", [], [[]], ["a", ""], [[5], []]):
        _refused(http.post(COMPLETIONS, json=_completion(prompt=prompt)), param="prompt")
    # An empty chat message is legal: the template still renders a prompt.
    response = http.post(CHAT, json={**_chat(content=""), "max_tokens": 2})
    assert response.status_code == 200, response.text
    served.wait_idle()


def test_streamed_refusals_are_errors_not_streams(http, served):
    body = _completion(prompt=[5] * (MAX_MODEL_LEN + 1), stream=True)
    with http.stream("POST", COMPLETIONS, json=body) as response:
        response.read()
    assert response.headers["content-type"].startswith("application/json")
    _refused(response, code="context_length_exceeded")
    body = {**GREEDY_BODY, "prompt": PROMPT, "max_tokens": 5, "stream": True}
    with http.stream("POST", COMPLETIONS, json=body) as response:
        events = sse_data(response.iter_lines())
    text, finish, error = stream_text(events)
    assert error is None and finish == "length" and text
    served.wait_idle()


def test_the_server_stays_ready_after_bad_input(http, served):
    assert http.post(COMPLETIONS, json=_completion(max_tokens=-1)).status_code == 400
    assert _raw(http, CHAT, b"{not json").status_code == 400
    served.wait_idle()
    assert json.loads(httpx.get(f"{served.url}/health").text) == {"status": "ready"}


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 1.5, "frequency_penalty": -0.5},
        {"min_tokens": 3, "max_tokens": 6},
        {"min_tokens": 2, "stop_token_ids": [7, 9], "presence_penalty": 0.3, "temperature": 1.0},
    ],
)
def test_penalties_and_min_tokens_with_drafting(http, served, fields):
    """Both change logits in place, the draft model's included (K is fixed at 2 here)."""
    for path, body in [(COMPLETIONS, _completion(**fields)), (CHAT, _chat(**fields))]:
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
    served.wait_idle()
