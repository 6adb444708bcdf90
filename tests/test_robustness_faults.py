"""Overload, timeouts and a failing forward, end to end through HTTP with the real engine.

The target model's forward is wrapped (slowed down, or made to raise once) so that queueing,
deadlines and faults happen at known moments on a tiny model.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from engine.types.request import SamplingParams
from tests.robustness_helpers import (
    GREEDY_BODY,
    HEADERS,
    FailOnce,
    openai_error,
    patched_forward,
    slow,
    stream_text,
)
from tests.server_helpers import PROMPT, Served, scrape_metrics, serve

MAX_NUM_SEQS = 2
MAX_WAITING = 4
TIMEOUT = 4.0  # at 1 s steps, two steps of tokens before a deadline (the timeout test)


@pytest.fixture(scope="module")
def served(tiny_dirs) -> Iterator[Served]:
    yield from serve(
        tiny_dirs,
        scheduler__max_num_seqs=MAX_NUM_SEQS,
        scheduler__max_waiting=MAX_WAITING,
        server__request_timeout=TIMEOUT,
    )


async def _call(http: httpx.AsyncClient, body: dict, events: list[str] | None = None) -> tuple:
    """(status, JSON body or SSE events, headers); a stream's events also go to `events`."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with http.stream("POST", path, json=body) as response:
        if not response.headers["content-type"].startswith("text/event-stream"):
            return response.status_code, json.loads(await response.aread()), response.headers
        events = [] if events is None else events
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
        return response.status_code, events, response.headers


def _client(served: Served) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=served.url, headers=HEADERS, timeout=60)


def _body(max_tokens: int, stream: bool, prompt: str = PROMPT) -> dict:
    return {**GREEDY_BODY, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


def test_a_full_queue_is_503_with_retry_after(served, monkeypatch):
    async def burst() -> list[tuple]:
        async with _client(served) as http:
            tasks = []
            # Spread over several steps: admissions then race the engine thread's bookkeeping
            # (which once let requests past the bound, to be failed with a 500 later).
            for i in range(48):
                body = _body(6, stream=i % 2 == 0, prompt=f"{PROMPT} {i}")
                tasks.append(asyncio.create_task(_call(http, body)))
                await asyncio.sleep(0.005)
            return await asyncio.gather(*tasks)

    with patched_forward(served, monkeypatch, slow(0.02)):
        results = asyncio.run(burst())
    statuses = Counter(status for status, _, _ in results)
    print(f"\nqueue bound: 48 requests spread over ~0.25s -> {dict(statuses)}")
    assert set(statuses) == {200, 503}, statuses
    # A request counts as waiting until a step has taken it into the batch, so a burst that
    # arrives within one step gets exactly MAX_WAITING admissions; later ones may get more.
    assert statuses[200] >= MAX_WAITING, statuses
    for status, body, headers in results:
        if status == 503:
            assert openai_error(status, body)["code"] == "queue_full"
            assert int(headers["retry-after"]) >= 1
        elif isinstance(body, list):
            text, finish, error = stream_text(body)
            assert error is None and finish == "length" and text
        else:
            assert body["choices"][0]["finish_reason"] == "length"
    served.wait_idle(timeout=5)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_multi_choice_request_is_admitted_whole_or_refused_whole(served, monkeypatch, stream):
    """n choices that do not all fit in the waiting queue: a 503 before any reaches the engine
    (none started then aborted); n that fit all run."""
    submitted: list[str] = []
    generate = served.engine.generate

    def counting(request_id, prompt, params):
        submitted.append(request_id)
        return generate(request_id, prompt, params)

    monkeypatch.setattr(served.engine, "generate", counting)
    body = {**_body(2, stream), "n": MAX_WAITING + 1, "temperature": 1.0}
    status, answer, headers = asyncio.run(_once(served, body))
    assert status == 503 and openai_error(status, answer)["code"] == "queue_full"
    assert submitted == [] and int(headers["retry-after"]) >= 1
    body["n"] = MAX_WAITING
    status, answer, _ = asyncio.run(_once(served, body))
    assert status == 200 and len(submitted) == MAX_WAITING
    served.wait_idle(timeout=5)


async def _once(served: Served, body: dict) -> tuple:
    async with _client(served) as http:
        return await _call(http, body)


def test_requests_past_the_timeout_are_aborted_with_504(served, monkeypatch):
    before = scrape_metrics(served)

    async def run() -> list[tuple]:
        async with _client(served) as http:
            tasks = []
            # FIFO admission: the first two fill the batch, the third waits for a free slot.
            # Its deadline comes a few ms after theirs, less than the step it would need to
            # produce a token once they are gone, so it times out before anything is sent:
            # even when a step boundary falls between their deadlines and it is taken into
            # the batch, its abort arrives during that step and wins over the step's token
            # (test_an_abort_during_a_step_wins_over_its_tokens). A 1 s step keeps the
            # sends' spacing and a late timer on a busy 2-core machine well inside it.
            # Each is sent once the engine has the one before: requests sent 10 ms apart on
            # a busy machine could reach it out of order (the queued one then the stream).
            for stream in (False, True, True):
                submitted = served.engine._num_submitted
                tasks.append(asyncio.create_task(_call(http, _body(200, stream=stream))))
                for _ in range(5000):  # 10 s at most
                    if served.engine._num_submitted > submitted:
                        break
                    await asyncio.sleep(0.002)
            return await asyncio.gather(*tasks)

    with patched_forward(served, monkeypatch, slow(1.0)):
        (status, plain, _), (s_status, events, _), (q_status, queued, _) = asyncio.run(run())
    # Not streamed: a 504 in the OpenAI shape.
    assert status == 504 and openai_error(status, plain)["code"] == "timeout"
    assert "--request-timeout" in plain["error"]["message"]
    # Streamed and started: tokens, then an error event, then [DONE].
    assert s_status == 200
    text, finish, error = stream_text(events)
    assert text and finish is None and error["code"] == "timeout"
    # Streamed but still queued at the deadline: nothing was sent yet, so a plain 504.
    assert q_status == 504 and openai_error(q_status, queued)["code"] == "timeout"
    served.wait_idle(timeout=2)  # aborted in the engine: every block is free again

    after = scrape_metrics(served)
    key = ("tandem_requests_finished_total", (("finish_reason", "timeout"),))
    assert after[key] - before.get(key, 0.0) == 3
    key = ("tandem_request_errors_total", (("status", "504"),))
    assert after[key] - before.get(key, 0.0) == 2  # the third was a stream's error event


def test_an_abort_during_a_step_wins_over_its_tokens(served, monkeypatch):
    """A deadline timer or a departed client aborts from another thread while a step runs:
    the request gets the abort and none of that step's tokens (a timed-out stream still queued
    at its deadline must be a plain 504, not a 200 with one token)."""
    request_id = "aborted-mid-step"

    def wrap(original):
        def forward(*args, **kwargs):
            served.engine.abort(request_id)  # arrives while the step is in flight
            return original(*args, **kwargs)

        return forward

    async def run() -> list:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        prompt = served.tokenizer.encode(PROMPT)
        return [out async for out in served.engine.generate(request_id, prompt, params)]

    with patched_forward(served, monkeypatch, wrap):
        outputs = asyncio.run(run())
    assert [(o.new_token_ids, o.finished, o.finish_reason) for o in outputs] == [
        ([], True, "abort")
    ]
    served.wait_idle(timeout=2)


def test_a_failing_forward_fails_only_its_step(served, monkeypatch):
    async def run(fault: FailOnce) -> tuple:
        async with _client(served) as http:
            reference = await _call(http, _body(8, stream=False, prompt="class Point:"))
            streamed: list[str] = []
            in_step = [
                asyncio.create_task(_call(http, _body(100, stream=True), streamed)),
                asyncio.create_task(_call(http, _body(100, stream=False))),
            ]
            while len(streamed) < 3 or served.engine.stats().num_running < MAX_NUM_SEQS:
                await asyncio.sleep(0.01)
            # The batch is full, so this one waits and is not part of the failing step.
            waiting = asyncio.create_task(
                _call(http, _body(8, stream=False, prompt="class Point:"))
            )
            while served.engine.stats().num_waiting < 1:
                await asyncio.sleep(0.01)
            fault.armed.set()
            results = await asyncio.gather(*in_step, waiting)
            after = await _call(http, _body(8, stream=True, prompt="class Point:"))
            return reference, results, after

    fault = FailOnce()
    with patched_forward(served, monkeypatch, lambda forward: fault(slow(0.02)(forward))):
        reference, (streamed, plain, waited), after = asyncio.run(asyncio.wait_for(run(fault), 60))

    assert fault.batch_sizes == [MAX_NUM_SEQS]  # the fault hit one step with the two requests
    status, events, _ = streamed
    text, finish, error = stream_text(events)
    assert status == 200 and text and finish is None
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert "injected fault" in error["message"]
    status, body, _ = plain
    assert status == 500 and openai_error(status, body)["code"] == "engine_error"
    # The request that was waiting, and one sent afterwards, are served as if nothing happened.
    expected = reference[1]["choices"][0]["text"]
    assert waited[0] == 200 and waited[1]["choices"][0]["text"] == expected
    assert after[0] == 200 and stream_text(after[1]) == (expected, "length", None)
    served.wait_idle(timeout=2)
