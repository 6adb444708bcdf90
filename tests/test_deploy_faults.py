"""A replica killed with SIGKILL mid-stream behind docker/nginx.conf (the real nginx, two
`tandem serve` replicas on loopback): the streams it was serving end with an error their
clients see, not a hang and not a quiet `[DONE]`; every new request goes to the survivor and
succeeds; the survivor's own streams are untouched."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.deploy_helpers import (
    MODEL,
    NEEDS_NGINX,
    Balancer,
    Replica,
    behind_nginx,
    stream_events,
)
from tests.test_deploy_nginx import check_completion

pytestmark = NEEDS_NGINX
STREAMS = 6  # through nginx, least_conn: both replicas get some
STREAM_TOKENS = 240  # with the prompt, just under the replicas' --max-model-len 256
AFTER = 8  # requests sent after the kill


@pytest.fixture(scope="module")
def deployment(tiny_dirs, tmp_path_factory) -> Iterator[tuple[list[Replica], Balancer]]:
    with behind_nginx(tiny_dirs, tmp_path_factory.mktemp("faults"), drain_timeout=5) as both:
        yield both


def _stream(url: str, outcome: list, started: threading.Event) -> None:
    """Read one long stream through nginx; record how it ended and how long after the kill."""
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": STREAM_TOKENS,
            "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    last = ""
    try:
        with httpx.Client(timeout=httpx.Timeout(30, read=20)) as client:
            for _, data in stream_events(client, url, body):
                last = data
                started.set()
        outcome.append(("done" if last == "[DONE]" else f"ended quietly after {last!r}", None))
    except httpx.HTTPError as exc:
        outcome.append(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        outcome.append(("at", time.monotonic()))
        started.set()


def test_sigkill_mid_stream_errors_its_streams_and_the_survivor_takes_the_rest(deployment):
    (victim, survivor), balancer = deployment
    url = f"{balancer.url}/v1/completions"
    outcomes: list[list] = [[] for _ in range(STREAMS)]
    started = [threading.Event() for _ in range(STREAMS)]
    threads = [
        threading.Thread(target=_stream, args=(url, outcomes[i], started[i]))
        for i in range(STREAMS)
    ]
    for thread in threads:
        thread.start()
    assert all(event.wait(30) for event in started), "streams did not start"
    killed = time.monotonic()
    victim.proc.send_signal(signal.SIGKILL)
    after = []
    with httpx.Client(timeout=60) as client:
        for i in range(AFTER):
            after.append(check_completion(client, url, stream=i % 2 == 0, max_tokens=8))
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a stream hangs after the kill"
    assert victim.proc.wait(timeout=10) == -signal.SIGKILL

    ends = [dict(outcome) for outcome in outcomes]
    errors = [end for end in ends if "error" in end]
    print(f"\nSIGKILL: {len(errors)} of {STREAMS} streams broke, the rest:",
          [next(iter(end)) for end in ends if "error" not in end])  # fmt: skip
    # The victim's streams end with a transport error (nginx closes the chunked response
    # unfinished), soon after the kill; the survivor's finish whole; none ends quietly.
    assert errors, "no stream was on the killed replica"
    assert all("done" in end or "error" in end for end in ends), ends
    assert all(end["at"] - killed < 15 for end in errors), ends
    assert len(errors) < STREAMS, "no stream was on the surviving replica"
    assert after == [""] * AFTER, after  # new requests: all answered, by the survivor
    late = [e for e in balancer.access_log() if e.started > time.time() - 30]
    assert late and all(e.upstreams[-1] == survivor.address for e in late[-AFTER:]), late
    assert httpx.get(f"{survivor.url}/health", timeout=5).status_code == 200
