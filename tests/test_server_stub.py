"""Server behaviour that needs a scripted engine: refusals, failures, stop strings, loading."""

from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

import server.app as app_module
from engine.core.client import EngineClient
from engine.core.engine import QueueFullError
from engine.types.outputs import RequestOutput, TokenLogprob
from engine.types.request import GrammarSpec, InvalidRequest, SamplingParams
from engine.types.stats import EngineStats
from engine.types.validation import check_request
from server.app import create_app
from server.settings import load_settings


class ScriptedEngine(EngineClient):
    """An engine for the server (the `EngineClient` protocol) replaying scripted token groups."""

    max_model_len = 64
    vocab_size = 320
    eos_token_ids = (0,)
    cpu_isa = None

    def __init__(self, steps: list[list[int]] | None = None, fail: str | None = None) -> None:
        self.steps = steps or []
        self.fail = fail
        self.aborted: list[str] = []
        self.params: list[SamplingParams] = []
        self.running = False

    def start(self) -> None:
        self.running = True

    def shutdown(self) -> None:
        self.running = False

    def problem(self) -> str | None:
        return None

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(num_blocks_total=32, num_blocks_free=32)

    def spare_cores(self) -> set[int] | None:
        return None

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_token_ids, params, self.vocab_size, self.max_model_len, 10**6)

    def check_grammar(self, spec: GrammarSpec) -> None:
        raise InvalidRequest("this stand-in has no grammar engine", spec.param)

    def admit(self, count: int) -> None:
        if self.fail == "queue":
            raise QueueFullError("4 requests are already waiting")

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        # Like AsyncEngine: refusals raise at the call, outputs stream afterwards.
        self.params.append(params)
        if self.fail == "invalid":
            raise ValueError("token id 999 is out of range")
        return self._outputs(request_id, prompt_token_ids)

    async def _outputs(
        self, request_id: str, prompt_token_ids: list[int]
    ) -> AsyncIterator[RequestOutput]:
        done = 0
        for i, group in enumerate(self.steps):
            done += len(group)
            last = i == len(self.steps) - 1
            yield RequestOutput(
                request_id,
                list(group),
                finished=last and self.fail is None,
                finish_reason="length" if last and self.fail is None else None,
                new_logprobs=[TokenLogprob(t, -0.5) for t in group],
                num_prompt_tokens=len(prompt_token_ids),
                num_output_tokens=done,
            )
        if self.fail == "error":
            yield RequestOutput(
                request_id, [], finished=True, finish_reason="error", error="device lost"
            )


@pytest.fixture(scope="module")
def settings(tiny_dirs):
    return load_settings(
        None,
        {"model.path": str(tiny_dirs["llama"]), "speculative.method": "off"},
        environ={},
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_dirs):
    return AutoTokenizer.from_pretrained(tiny_dirs["llama"])


def _client(settings, engine) -> TestClient:
    client = TestClient(create_app(settings, engine))
    client.__enter__()  # runs the lifespan
    deadline = time.monotonic() + 10
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return client


def _events(response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_queue_full_is_503_with_retry_after(settings):
    client = _client(settings, ScriptedEngine(fail="queue"))
    for stream in (False, True):
        body = {"prompt": "hi", "max_tokens": 4, "stream": stream}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 503
        assert response.headers["retry-after"]
        assert response.json()["error"]["code"] == "queue_full"
    client.__exit__(None, None, None)


def test_engine_refusal_is_400(settings):
    client = _client(settings, ScriptedEngine(fail="invalid"))
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert response.status_code == 400 and "out of range" in response.json()["error"]["message"]


def test_failed_generation_is_500_or_an_error_event(settings, tokenizer):
    engine = ScriptedEngine([tokenizer.encode("abc")], fail="error")
    client = _client(settings, engine)
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert "device lost" in response.json()["error"]["message"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as stream:
        events = _events(stream)
    assert "device lost" in json.loads(events[-2])["error"]["message"]
    assert events[-1] == "[DONE]"


def test_stop_string_inside_one_speculative_step(settings, tokenizer):
    # Three engine outputs; the stop string straddles the 2nd and 3rd, which also carries more.
    text = ["Hello wo", "rld, S", "TOP and more"]
    engine = ScriptedEngine([tokenizer.encode(t) for t in text])
    client = _client(settings, engine)
    body = {"prompt": "hi", "max_tokens": 30, "stop": "STOP", "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as stream:
        chunks = [json.loads(e) for e in _events(stream)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world, "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert engine.aborted  # the engine was told to stop generating
    whole = client.post("/v1/completions", json={**body, "stream": False, "logprobs": 0}).json()
    choice = whole["choices"][0]
    assert choice["text"] == "Hello world, " and choice["finish_reason"] == "stop"
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len("Hello world, ")


def test_sampling_params_reach_the_engine(settings, tokenizer):
    engine = ScriptedEngine([tokenizer.encode("ok")])
    client = _client(settings, engine)
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 11, "n": 2,
        "max_completion_tokens": 9, "stop_token_ids": [42], "presence_penalty": 0.5,
        "logprobs": True, "top_logprobs": 2,
    }  # fmt: skip
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and len(response.json()["choices"]) == 2
    first, second = engine.params
    assert (first.temperature, first.top_p, first.top_k, first.max_tokens) == (0.5, 0.9, 7, 9)
    assert (first.seed, second.seed) == (11, 12)
    assert first.logprobs == 2 and first.presence_penalty == 0.5
    assert 42 in first.stop_token_ids and tokenizer.eos_token_id in first.stop_token_ids
    default = client.post("/v1/chat/completions", json={"messages": body["messages"]})
    assert default.status_code == 200
    prompt_len = default.json()["usage"]["prompt_tokens"]
    assert engine.params[-1].max_tokens == ScriptedEngine.max_model_len - prompt_len


def test_health_is_503_while_loading_and_after_a_failed_load(settings, tmp_path, monkeypatch):
    release = threading.Event()
    real = app_module._load_tokenizer

    def slow_load(path: str):
        release.wait(10)
        return real(path)

    monkeypatch.setattr(app_module, "_load_tokenizer", slow_load)
    with TestClient(create_app(settings, ScriptedEngine())) as client:
        loading = client.get("/health")
        assert loading.status_code == 503 and "loading" in loading.json()["error"]["message"]
        busy = client.post("/v1/completions", json={"prompt": "hi"})
        assert busy.status_code == 503 and busy.headers["retry-after"]
        release.set()
        deadline = time.monotonic() + 10
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    monkeypatch.setattr(app_module, "_load_tokenizer", real)
    fatal: list[BaseException] = []
    # An empty directory holds no tokenizer: loading fails and the CLI would be told.
    app = create_app(_with_model(settings, tmp_path), ScriptedEngine(), on_fatal=fatal.append)
    with TestClient(app) as client:
        deadline = time.monotonic() + 10
        while not fatal:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        response = client.get("/health")
    assert response.status_code == 503 and "failed to load" in response.json()["error"]["message"]


def _with_model(settings, path):
    model = replace(settings.engine.model, model=str(path))
    return replace(settings, engine=replace(settings.engine, model=model))


def test_a_server_that_loads_its_own_engine_freezes_the_start_up_heap(settings, monkeypatch):
    """The collector stops walking what start-up loaded (server/app.py `_freeze_heap`), once
    the app has built its own engine; an injected engine's heap is its caller's."""
    import engine as engine_package

    frozen: list[int] = []
    monkeypatch.setattr(app_module, "_freeze_heap", lambda: frozen.append(1))

    class Built:
        @staticmethod
        def from_config(config):
            return ScriptedEngine()

    monkeypatch.setattr(engine_package, "AsyncEngine", Built)
    client = _client(settings, None)  # loads "its own" engine: the stand-in above
    client.__exit__(None, None, None)
    assert frozen == [1]
    client = _client(settings, ScriptedEngine())
    client.__exit__(None, None, None)
    assert frozen == [1]


def test_freeze_heap_moves_live_objects_out_of_the_collector():
    try:
        app_module._freeze_heap()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
