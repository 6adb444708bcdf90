"""Helpers for the robustness suite: the OpenAI error shape, SSE parsing, forward injection."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.server_helpers import API_KEY, MODEL, Served

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
GREEDY_BODY = {"model": MODEL, "temperature": 0.0, "ignore_eos": True}


def openai_error(status: int, body: Any) -> dict[str, Any]:
    """The `error` object of an error response, after checking it has the OpenAI shape."""
    assert 400 <= status < 600, status
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    expected = "server_error" if status >= 500 else "invalid_request_error"
    assert error["type"] == expected, (status, error)
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error


def sse_data(lines: Iterable[str]) -> list[str]:
    """The `data:` payloads of an SSE body, in order (pings and blank lines dropped). Lines may
    end in CRLF (sse-starlette's separator) when split on LF only."""
    return [line.rstrip("\r")[len("data: ") :] for line in lines if line.startswith("data: ")]


def stream_text(events: list[str]) -> tuple[str, str | None, dict | None]:
    """(text, last finish_reason, error object or None) of a completions stream's events."""
    assert events and events[-1] == "[DONE]", events[-3:]
    text, finish, error = "", None, None
    for event in events[:-1]:
        chunk = json.loads(event)
        if "error" in chunk:
            error = chunk["error"]
            continue
        for choice in chunk["choices"]:
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish, error


@contextmanager
def patched_forward(
    served: Served, monkeypatch: pytest.MonkeyPatch, wrap: Callable[[Callable], Callable]
) -> Iterator[None]:
    """Run the target model's passes (`forward_packed`, which every forward runs) through
    `wrap(original)` inside the block."""
    runner = served.engine.engine.runner
    original = runner.forward_packed
    with monkeypatch.context() as patch:
        patch.setattr(runner, "forward_packed", wrap(original))
        yield


def slow(seconds: float) -> Callable[[Callable], Callable]:
    """A wrap for patched_forward: every target forward takes at least `seconds` longer."""

    def wrap(original: Callable) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return original(*args, **kwargs)

        return forward

    return wrap


class FailOnce:
    """A wrap for patched_forward: the forward raises once, after `after` good calls, when armed."""

    def __init__(self, after: int = 0) -> None:
        self.after = after
        self.armed = threading.Event()
        self.calls_failed = 0
        self.batch_sizes: list[int] = []
        """Requests in the forward that raised."""

    def __call__(self, original: Callable) -> Callable:
        def forward(batch: Any, *args: Any, **kwargs: Any) -> Any:
            if self.armed.is_set() and self.calls_failed == 0:
                if self.after == 0:
                    self.calls_failed += 1
                    self.batch_sizes.append(len(batch.query_lens))
                    raise RuntimeError("injected fault: CUDA error: an illegal memory access")
                self.after -= 1
            return original(batch, *args, **kwargs)

        return forward
