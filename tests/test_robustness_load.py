"""A disconnect storm on a KV pool too small for the load: nothing lost, nothing leaked.

64 streaming clients at once on a pool that holds about five of them, so the scheduler keeps
preempting; a third of the clients (chosen by a seeded RNG) leave at random points, some while
still queued. Every client that stays must get the complete greedy text it gets without memory
pressure, and afterwards the engine must be idle with every KV block back in the pool.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.robustness_helpers import GREEDY_BODY, HEADERS, stream_text
from tests.server_helpers import Served, scrape_metrics, serve

CLIENTS = 64
TOKENS = 24
SEED = 1234
POOL_BLOCKS = 48
"""192 tokens of KV: one request needs up to 10 blocks (prompt + 24 tokens + 2 drafts)."""
PROMPTS = [
    f"def f{i}(a, b):" if i % 2 else f"for i in range({i}):\n    print(i * {i % 7})"
    for i in range(CLIENTS)
]


@dataclass
class Plan:
    leave_after_events: int | None = None
    """Close the stream after this many events."""
    leave_after_seconds: float | None = None
    """Drop the connection after this long, wherever the request is (queued, streaming)."""


@dataclass
class Outcome:
    status: int | None = None
    events: list[str] = field(default_factory=list)
    left: bool = False


@pytest.fixture(scope="module")
def served(tiny_dirs) -> Iterator[Served]:
    yield from serve(
        tiny_dirs,
        model__max_model_len=128,
        cache__num_blocks=POOL_BLOCKS,
        scheduler__max_num_seqs=CLIENTS,
        scheduler__max_num_batched_tokens=128,
    )


def _plans() -> list[Plan]:
    rng = random.Random(SEED)
    plans = [Plan() for _ in range(CLIENTS)]
    for i in rng.sample(range(CLIENTS), CLIENTS // 3):
        if rng.random() < 0.5:
            plans[i] = Plan(leave_after_events=rng.randint(1, TOKENS // 2))
        else:
            plans[i] = Plan(leave_after_seconds=rng.uniform(0.0, 1.5))
    return plans


async def _stream(http: httpx.AsyncClient, prompt: str, plan: Plan, outcome: Outcome) -> None:
    body = {**GREEDY_BODY, "prompt": prompt, "max_tokens": TOKENS, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            return
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                outcome.events.append(line[len("data: ") :])
            if plan.leave_after_events is not None:
                if len(outcome.events) >= plan.leave_after_events:
                    outcome.left = True
                    return  # leaving the block closes the connection mid-stream


async def _client(http: httpx.AsyncClient, prompt: str, plan: Plan) -> Outcome:
    outcome = Outcome()
    try:
        await asyncio.wait_for(_stream(http, prompt, plan, outcome), plan.leave_after_seconds)
    except asyncio.TimeoutError:
        outcome.left = True
    return outcome


async def _references(url: str) -> list[str]:
    """Each prompt's greedy text, non-streamed, four at a time (no memory pressure)."""
    texts: list[str] = []
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=60) as http:
        for start in range(0, CLIENTS, 4):
            bodies = [
                {**GREEDY_BODY, "prompt": prompt, "max_tokens": TOKENS}
                for prompt in PROMPTS[start : start + 4]
            ]
            responses = await asyncio.gather(
                *(http.post("/v1/completions", json=body) for body in bodies)
            )
            for response in responses:
                assert response.status_code == 200, response.text
                texts.append(response.json()["choices"][0]["text"])
    return texts


async def _storm(url: str, plans: list[Plan]) -> list[Outcome]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=60, limits=limits) as http:
        return await asyncio.gather(
            *(_client(http, prompt, plan) for prompt, plan in zip(PROMPTS, plans, strict=True))
        )


def test_disconnect_storm_under_kv_pressure_loses_nothing(served):
    before = served.engine.stats().preemptions
    references = asyncio.run(_references(served.url))
    assert served.engine.stats().preemptions == before, "the reference run was under pressure"
    served.wait_idle()
    metrics_before = scrape_metrics(served)

    plans = _plans()
    started = time.monotonic()
    outcomes = asyncio.run(_storm(served.url, plans))
    elapsed = time.monotonic() - started

    statuses = Counter(o.status for o in outcomes)
    assert all(status is None or status < 500 for status in statuses), statuses
    stayed = [(i, o) for i, o in enumerate(outcomes) if not o.left]
    assert len(stayed) >= CLIENTS - CLIENTS // 3
    for i, outcome in stayed:
        assert outcome.status == 200, (i, outcome)
        text, finish, error = stream_text(outcome.events)
        assert error is None, (i, error)
        assert finish == "length", (i, outcome.events[-3:])
        assert text == references[i], (i, text, references[i])

    served.wait_idle(timeout=10)  # running/waiting 0, every block free, invariants hold
    stats = served.engine.stats()
    preemptions = stats.preemptions - before
    assert preemptions > 0, "the pool was not small enough to force preemption"
    metrics = scrape_metrics(served)
    assert metrics[("tandem_requests_running", ())] == 0
    assert metrics[("tandem_requests_waiting", ())] == 0
    assert metrics[("tandem_kv_cache_usage_ratio", ())] == 0

    def finished(reason: str) -> float:
        key = ("tandem_requests_finished_total", (("finish_reason", reason),))
        return metrics.get(key, 0.0) - metrics_before.get(key, 0.0)

    left = sum(o.left for o in outcomes)
    # A client that leaves before its request reaches the server is counted nowhere.
    assert finished("length") >= len(stayed)
    assert finished("length") + finished("abort") <= CLIENTS
    assert finished("abort") <= left
    assert finished("error") == finished("timeout") == 0
    print(
        f"\nstorm: {CLIENTS} clients x {TOKENS} tokens, {left} left "
        f"({sum(p.leave_after_seconds is not None for p in plans)} planned by time, "
        f"{int(finished('abort'))} aborted before their end), {len(stayed)} stayed and matched; "
        f"{preemptions} preemptions on {POOL_BLOCKS} blocks; {elapsed:.1f}s; "
        f"statuses {dict(statuses)}"
    )
