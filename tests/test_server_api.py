"""The OpenAI API end to end: a real uvicorn server, the real engine, the official SDK."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from engine.engine import AsyncEngine
from server.app import create_app
from server.settings import Settings, load_settings

API_KEY = "test-key"
MODEL = "tiny"
PROMPT = "def add(a, b):"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@dataclass
class Served:
    url: str
    engine: AsyncEngine
    settings: Settings
    tokenizer: object
    client: openai.OpenAI

    def http(self, key: str | None = API_KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def wait_idle(self, timeout: float = 1.0) -> None:
        """Every request gone and every KV block back in the pool within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine.stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0
            if idle and stats.num_blocks_free == stats.num_blocks_total:
                break
            assert time.monotonic() < deadline, f"engine still busy: {stats}"
            time.sleep(0.02)
        self.engine.check_invariants()


@pytest.fixture(scope="module")
def served(tiny_dirs) -> Iterator[Served]:
    overrides = {
        "model.path": str(tiny_dirs["llama"]),
        "model.max_model_len": 256,
        "speculative.method": "draft",
        "speculative.draft_model": str(tiny_dirs["llama_draft"]),
        "speculative.max_draft_tokens": 2,
        "cache.block_size": 4,
        "cache.num_blocks": 192,
        "scheduler.max_num_seqs": 8,
        "scheduler.max_num_batched_tokens": 128,
        "server.served_model_name": MODEL,
        "server.api_key": API_KEY,
    }
    settings = load_settings(None, overrides, environ={})
    engine = AsyncEngine.from_config(settings.engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(settings, engine), log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy"
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    yield Served(url, engine, settings, tokenizer, client)
    server.should_exit = True
    thread.join(timeout=30)
    assert not engine.is_running  # the lifespan stopped the engine loop
    sock.close()


def _metrics(served: Served) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{served.url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_health_models_version(served):
    assert httpx.get(f"{served.url}/health").json() == {"status": "ready"}
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 256
    version = httpx.get(f"{served.url}/version").json()["version"]
    assert version and version != "unknown"


def test_completion(served):
    out = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, **GREEDY)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert out.usage.prompt_tokens == len(served.tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6
    spec = out.usage.model_extra["speculative"]
    assert spec["drafted_tokens"] > 0 and 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    # The model path is accepted as the model name too.
    again = served.client.completions.create(
        model=str(served.settings.model_path), prompt=PROMPT, max_tokens=6, **GREEDY
    )
    assert again.choices[0].text == choice.text
    served.wait_idle()


def test_chat_completion(served):
    messages = [{"role": "user", "content": "hi"}]
    out = served.client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=5, **GREEDY
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    (choice,) = out.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    rendered = served.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt_ids = served.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 5
    # Same tokens through /v1/completions: the chat endpoint is template + generation.
    plain = served.client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=5, **GREEDY)
    assert plain.choices[0].text == choice.message.content


def test_streams_concatenate_to_the_greedy_text(served):
    whole = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, **GREEDY)
    chunks = list(
        served.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=10, stream=True,
            stream_options={"include_usage": True}, **GREEDY,
        )
    )  # fmt: skip
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10

    messages = [{"role": "user", "content": "count"}]
    chat = served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, **GREEDY
    )
    parts = list(
        served.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, stream=True, **GREEDY
        )
    )
    assert all(p.object == "chat.completion.chunk" for p in parts)
    assert parts[0].choices[0].delta.role == "assistant"
    assert (
        "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    )
    assert parts[-1].choices[0].finish_reason == "length"
    served.wait_idle()


def test_several_prompts_and_n(served):
    ids = served.tokenizer.encode("for i in")
    out = served.client.completions.create(
        model=MODEL, prompt=[PROMPT, "for i in"], n=2, max_tokens=4, **GREEDY
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    single = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=4, **GREEDY)
    # Greedy: both choices of a prompt are equal, and prompt 1 owns choices 2 and 3.
    assert out.choices[2].text == out.choices[3].text == single.choices[0].text
    assert out.usage.prompt_tokens == len(served.tokenizer.encode(PROMPT)) + len(ids)
    assert out.usage.completion_tokens == 16
    batch = served.client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4, **GREEDY)
    assert [c.text for c in batch.choices] == [single.choices[0].text] * 2
    served.wait_idle()


def test_concurrent_clients_get_their_own_tokens(served):
    prompts = ["def add(a, b):", "for i in range(10):", "class Point:", "import os"]

    def run(prompt: str, stream: bool) -> str:
        out = served.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, stream=stream, **GREEDY
        )
        return (
            "".join(c.choices[0].text for c in out if c.choices) if stream else out.choices[0].text
        )

    alone = [run(p, stream=False) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(run, prompts, [True, False, True, False]))
    assert together == alone  # batched with each other, greedy output is unchanged
    served.wait_idle()


def test_seed_reproducibility(served):
    def sample(seed: int, n: int = 1) -> list[str]:
        out = served.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed, n=n,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return [c.text for c in out.choices]

    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first  # near-uniform random model: 8 sampled tokens differ
    # Choice i of n uses seed + i.
    assert sample(1234, n=2) == first + sample(1235)


def test_stop_strings(served):
    base = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **GREEDY)
    text = base.choices[0].text
    stop = text[4:6]
    expected = text[: text.index(stop)]
    out = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, stop=[stop, "never-seen"], **GREEDY
    )
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    chunks = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, stop=stop, stream=True, **GREEDY
    )
    streamed = [c.choices[0] for c in chunks]
    assert "".join(c.text for c in streamed) == expected
    assert streamed[-1].finish_reason == "stop"
    served.wait_idle()  # the server aborted the request the stop string ended


def test_completion_logprobs(served):
    out = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=2, **GREEDY
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 2 <= len(top) <= 3 and top[token] == logprob
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the top token


def test_chat_logprobs(served):
    out = served.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True,
        top_logprobs=3, **GREEDY,
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert isinstance(entry.bytes, list) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0])


def test_echo_with_logprobs_and_no_new_tokens(served):
    out = served.client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0
    )
    (choice,) = out.choices
    n_prompt = len(served.tokenizer.encode(PROMPT))
    assert choice.text == PROMPT
    assert len(choice.logprobs.tokens) == n_prompt == out.usage.prompt_tokens
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert out.usage.completion_tokens == 0
    echoed = served.client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, max_tokens=3, **GREEDY
    )
    assert echoed.choices[0].text.startswith(PROMPT) and len(echoed.choices[0].text) > len(PROMPT)
    served.wait_idle()


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
    ],
)
def test_bad_requests_are_400s_in_openai_shape(served, kwargs, param):
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(**args)
    error = _error(info.value)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_context_length_error_is_explained(served):
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=300)
    assert _error(info.value)["code"] == "context_length_exceeded"
    assert "256" in str(info.value)


def test_unknown_model_and_auth_errors(served):
    with pytest.raises(openai.NotFoundError) as info:
        served.client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert _error(info.value)["code"] == "model_not_found"
    wrong = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert _error(info.value)["code"] == "invalid_api_key"
    with served.http(key=None) as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 401 and set(response.json()["error"]) >= {"message", "type"}


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


def test_unknown_fields_are_ignored_with_a_warning(served, caplog):
    with served.http() as http, caplog.at_level("WARNING", logger="tandem.server"):
        response = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "best_of_wishes": 1},
        )
    assert response.status_code == 200
    assert any("best_of_wishes" in record.getMessage() for record in caplog.records)


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
            timeout=0.5,
        )
    served.wait_idle(timeout=1.0)


def test_metrics_move_with_traffic(served):
    before = _metrics(served)
    served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, **GREEDY)
    with pytest.raises(openai.BadRequestError):
        served.client.completions.create(model=MODEL, prompt=PROMPT, temperature=9)
    after = _metrics(served)

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
