"""vLLM's POST /tokenize and /detokenize, and GET /v1/models/{id}, through a real server.

The served name holds a slash, as hub names do, so /v1/models/{id} is also tested with one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import openai
import pytest

from server.prompts import OFF_LOOP_CHARS, render_chat
from server.protocol import ChatCompletionRequest
from server.tokenization import detokenize, tokenize
from server.tools import tool_setup
from tests.server_helpers import Served, error_of, serve

NAME = "acme/tiny-chat"
TEXTS = ["def add(a, b):\n    return a + b\n", "Héllo wörld ✓ 日本語 😀", "", "  x  "]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "for i in range(10):"},
]


@pytest.fixture(scope="module")
def served(tiny_dirs) -> Iterator[Served]:
    yield from serve(tiny_dirs, server__served_model_name=NAME)


def _post(served: Served, path: str, body: object, **http: str | None) -> httpx.Response:
    """POST `body` as JSON with the server's key (or `key=`: another, None for none)."""
    with served.http(**http) as client:
        return client.post(path, json=body)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_tokenize_then_detokenize_gives_the_text_back(served):
    for text in TEXTS:
        for special in (True, False):
            body = {"model": NAME, "prompt": text, "add_special_tokens": special}
            answer = _post(served, "/tokenize", body)
            assert answer.status_code == 200, answer.text
            out = answer.json()
            assert set(out) == {"count", "max_model_len", "tokens"}
            assert out["tokens"] == served.tokenizer.encode(text, add_special_tokens=special)
            assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256
            back = _post(served, "/detokenize", {"model": NAME, "tokens": out["tokens"]})
            assert back.status_code == 200 and back.json() == {"prompt": text}
    # model is optional; null means "not given", as on the other routes
    plain = _post(served, "/tokenize", {"prompt": TEXTS[0], "return_token_strs": None})
    assert plain.json()["tokens"] == served.tokenizer.encode(TEXTS[0])
    assert _post(served, "/detokenize", {"tokens": [], "model": None}).json() == {"prompt": ""}


def test_token_strs_when_asked(served):
    out = _post(served, "/tokenize", {"prompt": TEXTS[1], "return_token_strs": True}).json()
    assert out["token_strs"] == served.tokenizer.convert_ids_to_tokens(out["tokens"])
    assert len(out["token_strs"]) == out["count"] > 1


def test_a_prompt_counts_as_completions_count_it(served):
    usage = served.client.completions.create(model=NAME, prompt=TEXTS[1], max_tokens=1).usage
    out = _post(served, "/tokenize", {"model": NAME, "prompt": TEXTS[1]}).json()
    assert out["count"] == usage.prompt_tokens


def test_chat_tokenization_is_what_the_chat_endpoint_counts(served):
    usage = served.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1).usage
    out = _post(served, "/tokenize", {"model": NAME, "messages": MESSAGES}).json()
    assert out["count"] == usage.prompt_tokens == len(out["tokens"])
    template = served.tokenizer.apply_chat_template
    text = template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert out["tokens"] == served.tokenizer.encode(text, add_special_tokens=False)

    # With tools, rendered as the chat endpoint renders them (tool_choice auto). Their prompt
    # is past the tiny context, so the chat endpoint's own steps stand in for its usage.
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    req = ChatCompletionRequest(model=NAME, messages=MESSAGES, tools=tools)
    state = SimpleNamespace(tokenizer=served.tokenizer)
    expected = render_chat(state, req.messages, tool_setup(req)).token_ids
    with_tools = _post(served, "/tokenize", {"messages": MESSAGES, "tools": tools}).json()
    assert with_tools["tokens"] == expected and len(expected) > out["count"]


def test_chat_endings(served):
    """add_generation_prompt false ends on the last message; continue_final_message leaves
    the last message open (a prefill)."""
    prefill = [*MESSAGES, {"role": "assistant", "content": "for"}]
    for body, kwargs in (
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        (
            {"add_generation_prompt": False, "continue_final_message": True},
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
    ):
        out = _post(served, "/tokenize", {"messages": prefill, **body}).json()
        text = served.tokenizer.apply_chat_template(prefill, tokenize=False, **kwargs)
        assert out["tokens"] == served.tokenizer.encode(text, add_special_tokens=False), body
    opened = _post(served, "/tokenize", {"messages": prefill}).json()["tokens"]
    closed = _post(served, "/tokenize", {"messages": prefill, "add_generation_prompt": False})
    left_open = _post(
        served,
        "/tokenize",
        {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert len(left_open.json()["tokens"]) < len(closed.json()["tokens"]) < len(opened)


def test_the_model_is_retrieved_by_its_id(served):
    listed = served.client.models.list().data
    got = served.client.models.retrieve(NAME)  # the SDK sends the slash as %2F
    assert got.model_dump() == listed[0].model_dump()
    assert got.id == NAME and got.model_extra["max_model_len"] == 256
    with served.http() as http:
        raw = http.get(f"/v1/models/{NAME}")  # and a plain client as it is
        card = http.get("/v1/models").json()["data"][0]
    assert raw.status_code == 200 and raw.json() == card
    for other in ("tiny", "acme", "acme/tiny-chat/x", "gpt-4"):
        with pytest.raises(openai.NotFoundError) as info:
            served.client.models.retrieve(other)
        error = error_of(info.value)
        assert error["code"] == "model_not_found" and other in error["message"]


def test_unknown_models_are_404s(served):
    for path, body in (
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}),
        ("/tokenize", {"model": "gpt-4", "messages": MESSAGES}),
        ("/detokenize", {"model": "gpt-4", "tokens": [5]}),
    ):
        error = _error(_post(served, path, body), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [5, 320]}, "tokens"),  # the tiny vocabulary is 320
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [2**70]}, "tokens"),
        ("/detokenize", {"tokens": ["5"]}, "tokens[0]"),
        ("/detokenize", {"tokens": [5, 1.0]}, "tokens[1]"),
        ("/detokenize", {"tokens": [True]}, "tokens[0]"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": [5], "skip_special_tokens": True}, "skip_special_tokens"),
        ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
        ("/tokenize", {"messages": MESSAGES, "add_generation_promt": 0}, "add_generation_promt"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ x }}"}, "chat_template"),
        ("/tokenize", {"messages": MESSAGES, "prompt": "x"}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "maybe"}, "add_special_tokens"),
        (
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            "continue_final_message",
        ),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(served, path, body, param):
    error = _error(_post(served, path, body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_odd_bodies_are_400s(served):
    json_type = {"content-type": "application/json"}
    with served.http() as http:
        for path in ("/tokenize", "/detokenize"):
            not_json = http.post(path, content=b"{not json", headers=json_type)
            assert "JSON" in _error(not_json, 400)["message"], path
            _error(http.post(path, json=[1, 2]), 400)
        # A lone surrogate escape reaches neither the tokenizer nor an error message (no 500).
        raw = b'{"prompt": "a\\ud800b"}'
        _error(http.post("/tokenize", content=raw, headers=json_type), 400)
        raw = b'{"model": "\\udfff", "tokens": [1]}'
        _error(http.post("/detokenize", content=raw, headers=json_type), 400)


def test_sizes_are_bounded_by_the_request_token_limit(served):
    limit = 8 * 256  # --max-request-tokens auto: 8 contexts
    error = _error(_post(served, "/detokenize", {"tokens": [5] * (limit + 1)}), 400)
    assert error["param"] == "tokens" and error["code"] == "request_too_large"
    assert _post(served, "/detokenize", {"tokens": [5] * limit}).status_code == 200
    long_text = "é" * (limit + 1)  # a token or more each: not in the tiny BPE's merges
    assert len(served.tokenizer.encode(long_text)) > limit
    error = _error(_post(served, "/tokenize", {"prompt": long_text}), 400)
    assert error["param"] == "prompt" and error["code"] == "request_too_large"
    chat = [{"role": "user", "content": long_text}]
    error = _error(_post(served, "/tokenize", {"messages": chat}), 400)
    assert error["param"] == "messages" and error["code"] == "request_too_large"


def test_the_key_is_needed_even_at_the_root(served):
    """--api-key-scope v1 (this server's) leaves /metrics open, yet /tokenize and /detokenize
    need the key: they run the tokenizer for whoever calls."""
    assert served.settings.server.api_key_scope == "v1"
    assert httpx.get(f"{served.url}/metrics").status_code == 200
    for key in (None, "wrong"):
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
            error = _error(_post(served, path, body, key=key), 401)
            assert error["code"] == "invalid_api_key", (path, key)
        with served.http(key=key) as http:
            refused = http.get(f"/v1/models/{NAME}")
        assert _error(refused, 401)["code"] == "invalid_api_key"


# The handlers alone, on a stand-in tokenizer that shows what reached it.


class FakeTokenizer:
    """Each character is its code point; special tokens add 1 in front."""

    chat_template = "(its own)"

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.template_calls: list[dict] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread())
        return [1] * add_special_tokens + [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        self.threads.append(threading.current_thread())
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True, **kw):
        self.template_calls.append({"add_generation_prompt": add_generation_prompt, **kw})
        return "".join(m["content"] for m in conversation) + ">" * add_generation_prompt


def _state(tokenizer: FakeTokenizer) -> SimpleNamespace:
    engine = SimpleNamespace(max_model_len=64, vocab_size=1 << 17)
    server = SimpleNamespace(max_request_tokens=1 << 20)
    return SimpleNamespace(
        tokenizer=tokenizer,
        check_model=lambda name: "m",
        ready_engine=lambda: engine,
        settings=SimpleNamespace(server=server),
    )


def _run(coro_fn):
    async def main():
        return await coro_fn(), threading.current_thread()

    return asyncio.run(main())


def test_the_options_reach_the_tokenizer():
    tok = FakeTokenizer()
    state = _state(tok)
    out, _ = _run(lambda: tokenize(state, {"prompt": "ab"}))
    assert out == {"count": 3, "max_model_len": 64, "tokens": [1, 97, 98]}
    out, _ = _run(lambda: tokenize(state, {"prompt": "ab", "add_special_tokens": False}))
    assert out["tokens"] == [97, 98]
    chat = [{"role": "user", "content": "ab"}]
    out, _ = _run(lambda: tokenize(state, {"messages": chat}))
    assert out["tokens"] == [97, 98, ord(">")]  # the chat endpoint's: no special tokens
    out, _ = _run(lambda: tokenize(state, {"messages": chat, "add_special_tokens": True}))
    assert out["tokens"] == [1, 97, 98, ord(">")]
    body = {"messages": chat, "add_generation_prompt": False, "continue_final_message": True}
    out, _ = _run(lambda: tokenize(state, body))
    assert out["tokens"] == [97, 98]
    assert tok.template_calls[-1] == {
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    assert tok.template_calls[0] == {"add_generation_prompt": True}


def test_long_inputs_leave_the_event_loop():
    tok = FakeTokenizer()
    state = _state(tok)
    _, loop_thread = _run(lambda: tokenize(state, {"prompt": "short"}))
    assert tok.threads == [loop_thread]
    long_text = "x" * OFF_LOOP_CHARS
    for run in (
        lambda: tokenize(state, {"prompt": long_text}),
        lambda: tokenize(state, {"messages": [{"role": "user", "content": long_text}]}),
        lambda: detokenize(state, {"tokens": [120] * OFF_LOOP_CHARS}),
    ):
        tok.threads.clear()
        out, loop_thread = _run(run)
        assert tok.threads and loop_thread not in tok.threads
    assert out == {"prompt": long_text}
