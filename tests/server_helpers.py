"""A real Tandem server for API tests: uvicorn on a free port, the real engine, the SDK.

Each API test module wraps `serve` in a module-scoped fixture of its own.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from engine.core.async_engine import AsyncEngine
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


def serve(tiny_dirs: dict, **changes: object) -> Iterator[Served]:
    """Start a server on the tiny models, yield it, stop it (a fixture body).

    changes: settings to change, by YAML key with `__` for the dot (`cache__num_blocks=64`).
    """
    overrides = {
        "model.path": str(tiny_dirs["llama"]),
        "model.max_model_len": 256,
        "speculative.method": "draft",
        "speculative.draft_model": str(tiny_dirs["llama_draft"]),
        "speculative.max_draft_tokens": 2,
        # The random tiny draft never agrees with the target, so the adaptive policy would
        # (rightly) stop drafting; fixed K keeps speculation in every request the tests send.
        "speculative.draft_length": "fixed",
        "cache.block_size": 4,
        "cache.num_blocks": 192,
        "scheduler.max_num_seqs": 8,
        "scheduler.max_num_batched_tokens": 128,
        "server.served_model_name": MODEL,
        "server.api_key": API_KEY,
        **{key.replace("__", "."): value for key, value in changes.items()},
    }
    settings = load_settings(None, overrides, environ={})
    engine = AsyncEngine.from_config(settings.engine)
    with running(settings, engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
        yield Served(url, engine, settings, tokenizer, client)
    assert not engine.is_running  # the lifespan stopped the engine loop


def wait_healthy(
    url: str, timeout: float, alive: Callable[[], None] | None = None, interval: float = 0.05
) -> None:
    """Poll `url`/health until it answers 200; fail after `timeout` seconds. `alive` is
    called before each try (to fail at once if the server process died)."""
    deadline = time.monotonic() + timeout
    while True:
        if alive is not None:
            alive()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy"
        time.sleep(interval)


@contextmanager
def running(settings: Settings, engine: AsyncEngine, timeout: float = 60) -> Iterator[str]:
    """uvicorn serving `engine` on a free loopback port, healthy; yields its URL, then stops it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(settings, engine), log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_healthy(url, timeout)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def scrape_metrics(served: Served) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{served.url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]
