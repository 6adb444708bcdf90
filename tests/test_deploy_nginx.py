"""docker/compose.yaml without Docker: the nginx binary with docker/nginx.conf in front of two
`tandem serve` replicas on loopback ports, which read their API key from a file as compose's
replicas read its secret (TANDEM_API_KEY_FILE).

One deployment serves the whole module and the tests run in file order: the last one drains
a replica with SIGTERM while clients keep both busy.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.deploy_helpers import (
    MODEL,
    NEEDS_NGINX,
    Balancer,
    Replica,
    behind_nginx,
    finished_requests,
    stream_events,
)

pytestmark = NEEDS_NGINX
PROMPT = "def add(a, b):"
DRAIN_TIMEOUT = 10.0
LOAD_CLIENTS = 4
LOAD_TOKENS = 24
STREAM_TOKENS = 200  # long enough that decoding, not the first token, fills the stream
LONG_TOKENS = 240  # with the prompt, just under the replicas' --max-model-len 256
LONG_CHOICES = 4
API_KEY = "compose-secret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Deployment:
    replicas: list[Replica]
    balancer: Balancer


@pytest.fixture(scope="module")
def deployment(tiny_dirs, tmp_path_factory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("deploy")
    key_file = root / "api-key"
    key_file.write_text(API_KEY + "\n")  # as `... > docker/api-key` writes it
    with behind_nginx(tiny_dirs, root, drain_timeout=DRAIN_TIMEOUT, api_key_file=key_file) as (
        replicas,
        balancer,
    ):
        yield Deployment(replicas, balancer)


def _body(max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }


def check_completion(client: httpx.Client, url: str, *, stream: bool, max_tokens: int) -> str:
    """'' when the completion came back whole, else what went wrong (never raises)."""
    try:
        if not stream:
            response = client.post(url, json=_body(max_tokens))
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {response.text}"
            body = response.json()
            finish = body["choices"][0]["finish_reason"]
            tokens = body["usage"]["completion_tokens"]
        else:
            body = {**_body(max_tokens), "stream_options": {"include_usage": True}}
            events = [data for _, data in stream_events(client, url, body)]
            if not events or events[-1] != "[DONE]":
                return f"stream ended without [DONE]: {events[-2:]}"
            chunks = [json.loads(data) for data in events[:-1]]
            if any("error" in chunk for chunk in chunks):
                return f"error event in stream: {chunks}"
            finish = next(
                choice["finish_reason"]
                for chunk in reversed(chunks)
                for choice in chunk["choices"]
                if choice.get("finish_reason")
            )
            tokens = chunks[-1]["usage"]["completion_tokens"]
    except (httpx.HTTPError, AssertionError, ValueError, KeyError, StopIteration) as exc:
        return f"{type(exc).__name__}: {exc}"
    if finish != "length" or tokens != max_tokens:
        return f"cut short: finish_reason={finish} completion_tokens={tokens}"
    return ""


def test_requests_reach_both_replicas(deployment):
    before = [finished_requests(r.url) for r in deployment.replicas]
    url = f"{deployment.balancer.url}/v1/completions"
    with httpx.Client(timeout=30, headers=AUTH) as client:
        problems = [check_completion(client, url, stream=False, max_tokens=4) for _ in range(6)]
    assert problems == [""] * 6
    after = [finished_requests(r.url) for r in deployment.replicas]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    entries = deployment.balancer.access_log()
    assert {e.upstreams[-1] for e in entries} == {r.address for r in deployment.replicas}


def test_the_key_guards_the_api_behind_nginx(deployment):
    """compose's contract: the API answers only with the key, which nginx passes through as
    it came (a 401 is not retried on the other replica); /health, which the health checks
    ask without a key, stays open, and so does /metrics (scope v1) for Prometheus."""
    lb = deployment.balancer.url
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        refused = httpx.post(f"{lb}/v1/completions", json=_body(4), headers=headers, timeout=30)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{lb}/v1/models", headers=headers, timeout=30).status_code == 401
    assert httpx.get(f"{lb}/v1/models", headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(f"{lb}/health", timeout=30).status_code == 200
    assert httpx.get(f"{lb}/metrics", timeout=30).status_code == 200
    refusals = [e for e in deployment.balancer.access_log() if e.status == 401]
    assert refusals and all(len(e.upstreams) == 1 for e in refusals), refusals


def test_stream_arrives_token_by_token(deployment):
    body = {**_body(STREAM_TOKENS), "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=30, headers=AUTH) as client:
        # A replica's first stream pays one-off costs (tens of ms) that would dwarf the tiny
        # model's decoding: warm both, so the time before the first token is small and steady.
        for replica in deployment.replicas:
            list(stream_events(client, f"{replica.url}/v1/completions", body))
        start = time.monotonic()
        events = list(stream_events(client, f"{deployment.balancer.url}/v1/completions", body))
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == STREAM_TOKENS
    arrivals = [at for (at, _), chunk in zip(events[:-1], chunks, strict=True) if chunk["choices"]]
    # An event carries one token or a few (a character split over tokens waits for the rest).
    assert len(arrivals) >= 16
    # Buffered, the events would land in one or two bursts at the end; streamed, they come
    # as the engine makes them: many distinct instants, the first well before the last.
    assert len({round(at, 3) for at in arrivals}) >= 10, arrivals
    assert arrivals[-1] - arrivals[0] >= 0.3 * (arrivals[-1] - start), (start, arrivals)


def test_sigterm_drains_a_replica_without_a_client_noticing(deployment):
    draining, survivor = deployment.replicas
    lb = f"{deployment.balancer.url}/v1/completions"
    stopping = threading.Event()
    problems: list[str] = []

    def client_loop(worker: int) -> None:
        with httpx.Client(timeout=30, headers=AUTH) as client:
            n = worker
            while not stopping.is_set():
                stream = n % 2 == 0
                problems.append(check_completion(client, lb, stream=stream, max_tokens=LOAD_TOKENS))
                n += 1

    long_result: list[str] = []
    long_started = threading.Event()

    def long_stream() -> None:
        # Straight to the replica, so it is surely in flight there when the signal lands.
        # n choices keep the replica busy (draining) well past the checks below.
        body = {**_body(LONG_TOKENS), "n": LONG_CHOICES, "stream_options": {"include_usage": True}}
        url = f"{draining.url}/v1/completions"
        try:
            with httpx.Client(timeout=30, headers=AUTH) as client:
                events = []
                for _, data in stream_events(client, url, body):
                    events.append(data)
                    long_started.set()
            chunks = [json.loads(data) for data in events[:-1]]
            tokens = chunks[-1]["usage"]["completion_tokens"]
            whole = events[-1] == "[DONE]" and tokens == LONG_TOKENS * LONG_CHOICES
            long_result.append("" if whole else f"{tokens} tokens, last event {events[-1]}")
        except Exception as exc:  # reported by the assertion below
            long_result.append(f"{type(exc).__name__}: {exc}")
        finally:
            long_started.set()

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(LOAD_CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)  # steady load on both replicas
        # The long stream starts only now, so that it is surely in flight when the signal lands.
        threads.append(threading.Thread(target=long_stream))
        threads[-1].start()
        assert long_started.wait(15)
        signalled = time.time()
        draining.terminate()

        # While draining: /health and new requests 503 (OpenAI shape, Retry-After), metrics up.
        deadline = time.monotonic() + 5
        while httpx.get(f"{draining.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after SIGTERM"
            time.sleep(0.01)
        drain_seen = time.time()
        assert httpx.get(f"{draining.url}/metrics", timeout=5).status_code == 200
        refused = httpx.post(
            f"{draining.url}/v1/completions", json=_body(4), headers=AUTH, timeout=5
        )
        assert refused.status_code == 503
        assert int(refused.headers["retry-after"]) > 0
        assert refused.json()["error"]["type"] == "server_error"

        time.sleep(2.0)  # the load goes on while the replica drains and leaves
    finally:
        stopping.set()
        for thread in threads:
            thread.join(timeout=60)

    assert draining.proc.wait(timeout=DRAIN_TIMEOUT + 10) == 0, draining.output()
    assert draining.signalled_at is not None
    took = time.monotonic() - draining.signalled_at
    assert took < DRAIN_TIMEOUT, f"drained replica exited after {took:.1f}s"
    output = draining.output()
    assert "drained: no request in flight" in output and "Traceback" not in output, output

    # Every request of the load came back whole, none saw a connection error or a 5xx.
    assert len(problems) >= 2 * LOAD_CLIENTS
    assert [p for p in problems if p] == []
    assert long_result == [""]

    entries = [e for e in deployment.balancer.access_log() if e.started >= signalled - 1.0]
    assert entries and all(e.status == 200 for e in entries), entries
    before = {e.upstreams[-1] for e in entries if e.started < signalled}
    assert before == {draining.address, survivor.address}, "load did not reach both replicas"
    # From the moment the replica refused work, nginx sent everything new to the other one...
    late = [e for e in entries if e.started > drain_seen + 0.005]
    assert late and {e.upstreams[-1] for e in late} == {survivor.address}, late
    # ...retrying on it what the draining replica turned away (503) or no longer took.
    retried = [e for e in entries if len(e.upstreams) > 1]
    assert retried, "no request was retried on the other replica"
    assert all(e.upstreams == (draining.address, survivor.address) for e in retried), retried


def test_second_sigterm_exits_at_once(deployment):
    """The real signal path of the other replica: a second SIGTERM does not wait for streams."""
    replica = deployment.replicas[1]
    url = f"{replica.url}/v1/completions"
    started = threading.Event()

    def long_stream() -> None:
        try:
            with httpx.Client(timeout=30, headers=AUTH) as client:
                for _ in stream_events(client, url, _body(LONG_TOKENS)):
                    started.set()
        except (httpx.HTTPError, AssertionError):
            pass  # cut short, as intended
        finally:
            started.set()

    reader = threading.Thread(target=long_stream)
    reader.start()
    try:
        assert started.wait(15)
        replica.terminate()
        deadline = time.monotonic() + 5
        while httpx.get(f"{replica.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after SIGTERM"
            time.sleep(0.01)
        replica.terminate()
        assert replica.proc.wait(timeout=5) == 128 + signal.SIGTERM, replica.output()
    finally:
        reader.join(timeout=30)
    assert "second SIGTERM, exiting without waiting" in replica.output()
