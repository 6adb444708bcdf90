"""The /health watchdog: a hung forward or a dead engine thread turns the replica unhealthy.

Own server (module fixture): the second test kills the engine thread for good.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.robustness_helpers import GREEDY_BODY, HEADERS, openai_error
from tests.server_helpers import PROMPT, Served, serve


@pytest.fixture(scope="module")
def served(tiny_dirs) -> Iterator[Served]:
    yield from serve(tiny_dirs)


def _health(served: Served) -> httpx.Response:
    return httpx.get(f"{served.url}/health", timeout=5)


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _post(served: Served, results: list) -> None:
    body = {**GREEDY_BODY, "prompt": PROMPT, "max_tokens": 4}
    results.append(
        httpx.post(f"{served.url}/v1/completions", json=body, headers=HEADERS, timeout=60)
    )


def test_a_hung_forward_fails_health_until_it_returns(served: Served, monkeypatch):
    runner = served.engine.engine.runner
    original, release = runner.forward_packed, threading.Event()

    def hanging(*args, **kwargs):
        release.wait(timeout=30)
        return original(*args, **kwargs)

    monkeypatch.setattr(served.engine, "stall_seconds", 0.3)
    monkeypatch.setattr(runner, "forward_packed", hanging)
    results: list[httpx.Response] = []
    client = threading.Thread(target=_post, args=(served, results))
    client.start()
    try:
        _wait_for(lambda: _health(served).status_code == 503)
        error = openai_error(503, _health(served).json())
        assert "has not returned" in error["message"] and error["code"] == "not_ready"
    finally:
        release.set()
        monkeypatch.setattr(runner, "forward_packed", original)
        client.join(timeout=30)
    assert results and results[0].status_code == 200  # the slow request still finished
    _wait_for(lambda: _health(served).status_code == 200)


def test_a_dead_engine_thread_fails_health_and_the_requests_it_held(served: Served, monkeypatch):
    def broken_schedule():
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(served.engine.engine.scheduler, "schedule", broken_schedule)
    results: list[httpx.Response] = []
    _post(served, results)  # the engine thread dies on this request's first step
    assert results[0].status_code == 500  # failed, not left hanging
    _wait_for(lambda: _health(served).status_code == 503)
    assert "engine thread stopped" in openai_error(503, _health(served).json())["message"]
    refused: list[httpx.Response] = []
    _post(served, refused)
    assert refused[0].status_code == 503  # new work is refused, not queued forever
