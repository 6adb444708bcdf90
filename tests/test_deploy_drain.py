"""Graceful drain inside one process: `DrainingServer` + `DrainGate` around a gated engine.

The signal handler is called directly (uvicorn installs it only on the main thread), and the
engine holds every request after its first token until the test opens the gate, so "in
flight" lasts exactly as long as a test needs. tests/test_deploy_nginx.py drains real
processes behind nginx.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from engine.core.client import EngineClient
from engine.types.outputs import RequestOutput
from engine.types.request import GrammarSpec, InvalidRequest, SamplingParams
from engine.types.stats import EngineStats
from engine.types.validation import check_request
from server.app import create_app
from server.drain import DrainingServer
from server.settings import load_settings
from server.state import ServerState
from tests.server_helpers import wait_healthy

TOKENS = [40, 41, 42, 43, 44, 45]


class GatedEngine(EngineClient):
    """An engine for the server (`EngineClient`): a first token at once, the rest at the gate."""

    max_model_len = 64
    vocab_size = 320
    eos_token_ids = (0,)
    cpu_isa = None

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.aborted: list[str] = []
        self.generating = 0
        """Requests that got their first token."""

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def problem(self) -> str | None:
        return None

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(num_blocks_total=8, num_blocks_free=8)

    def spare_cores(self) -> set[int] | None:
        return None

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_token_ids, params, self.vocab_size, self.max_model_len, 10**6)

    def check_grammar(self, spec: GrammarSpec) -> None:
        raise InvalidRequest("this stand-in has no grammar engine", spec.param)

    def admit(self, count: int) -> None:
        pass

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        return self._outputs(request_id, len(prompt_token_ids))

    async def _outputs(self, request_id: str, num_prompt: int) -> AsyncIterator[RequestOutput]:
        for i, token in enumerate(TOKENS):
            while i == 1 and not self.gate.is_set():
                await asyncio.sleep(0.01)
            if i == 0:
                self.generating += 1
            last = i == len(TOKENS) - 1
            yield RequestOutput(
                request_id,
                [token],
                finished=last,
                finish_reason="length" if last else None,
                num_prompt_tokens=num_prompt,
                num_output_tokens=i + 1,
            )


@dataclass
class Running:
    url: str
    server: DrainingServer
    thread: threading.Thread
    state: ServerState
    engine: GatedEngine


@pytest.fixture(scope="module")
def settings(tiny_dirs):
    return load_settings(
        None, {"model.path": str(tiny_dirs["llama"]), "speculative.method": "off"}, environ={}
    )


@contextmanager
def running(settings, drain_timeout: float) -> Iterator[Running]:
    engine = GatedEngine()
    app = create_app(settings, engine)  # type: ignore[arg-type]
    state = app.state.tandem
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=1)
    server = DrainingServer(config, state, drain_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_healthy(url, 30, interval=0.02)
        yield Running(url, server, thread, state, engine)
    finally:
        engine.gate.set()
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _in_background(run: Running, stream: bool) -> tuple[threading.Thread, dict]:
    """A completion request on its own thread; its result lands in the returned dict."""
    result: dict = {}
    body = {"prompt": "hi", "max_tokens": len(TOKENS), "stream": stream}

    def call() -> None:
        try:
            with httpx.Client(base_url=run.url, timeout=30) as client:
                if stream:
                    with client.stream("POST", "/v1/completions", json=body) as response:
                        lines = response.iter_lines()
                        result["events"] = [ln[6:] for ln in lines if ln.startswith("data: ")]
                else:
                    response = client.post("/v1/completions", json=body)
                    result["status"], result["body"] = response.status_code, response.json()
        except httpx.HTTPError as exc:
            result["error"] = repr(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, result


def _wait_generating(run: Running, count: int) -> None:
    """Until `count` requests are in the engine, each past its first token."""
    deadline = time.monotonic() + 10
    while run.engine.generating < count:
        assert time.monotonic() < deadline, f"{run.engine.generating} requests generating"
        time.sleep(0.01)
    assert run.state.in_flight == count


def test_sigterm_refuses_new_work_and_lets_requests_in_flight_finish(settings):
    with running(settings, drain_timeout=30) as run:
        streamed, stream_result = _in_background(run, stream=True)
        whole, whole_result = _in_background(run, stream=False)
        _wait_generating(run, 2)

        run.server.handle_exit(signal.SIGTERM, None)
        health = httpx.get(f"{run.url}/health")
        assert health.status_code == 503 and health.headers["retry-after"]
        for method, path in (
            ("POST", "/v1/completions"),
            ("GET", "/v1/models"),
            ("POST", "/tokenize"),  # vLLM's, at the root: API requests all the same
            ("POST", "/detokenize"),
        ):
            body = {"tokens": [5]} if path == "/detokenize" else {"prompt": "x"}
            refused = httpx.request(method, f"{run.url}{path}", json=body)
            assert refused.status_code == 503, path
            assert int(refused.headers["retry-after"]) > 0
            error = refused.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert "shutting down" in error["message"] and error["type"] == "server_error"
        assert httpx.get(f"{run.url}/metrics").status_code == 200
        time.sleep(0.3)
        assert run.thread.is_alive() and not run.server.should_exit  # still draining

        run.engine.gate.set()
        streamed.join(10)
        whole.join(10)
        run.thread.join(10)
        assert not run.thread.is_alive(), "server did not stop once drained"

    assert "error" not in stream_result and "error" not in whole_result
    events = stream_result["events"]
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
    assert whole_result["status"] == 200
    assert whole_result["body"]["usage"]["completion_tokens"] == len(TOKENS)


def test_drain_timeout_cuts_what_is_left_and_stops(settings):
    with running(settings, drain_timeout=0.3) as run:
        streamed, result = _in_background(run, stream=True)
        _wait_generating(run, 1)
        started = time.monotonic()
        run.server.handle_exit(signal.SIGTERM, None)
        run.thread.join(10)
        assert not run.thread.is_alive()
        # 0.3 s of drain, then at most uvicorn's 1 s graceful shutdown for the stream.
        assert time.monotonic() - started < 3
        streamed.join(10)
        assert run.engine.aborted, "the cut request was not aborted in the engine"
    assert result.get("events", [])[-1:] != ["[DONE]"]


def test_second_signal_exits_at_once(settings, monkeypatch):
    class Exited(Exception):
        pass

    def fake_exit(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr("server.drain.os._exit", fake_exit)
    with running(settings, drain_timeout=30) as run:
        _in_background(run, stream=True)
        _wait_generating(run, 1)
        run.server.handle_exit(signal.SIGTERM, None)
        with pytest.raises(Exited) as exited:
            run.server.handle_exit(signal.SIGTERM, None)
        assert exited.value.args == (128 + signal.SIGTERM,)
