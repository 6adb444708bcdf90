"""Tandem on Ray Serve (server/ray_serve.py): `python -m server.ray_serve --num-replicas 2` as
a user starts it, on loopback, with the official openai client.

One module, one Ray instance (about half a minute to start on two cores), every test bounded
in time: 32 concurrent requests reach both replicas with single-server greedy text; a replica
killed under load loses no request (the client's retry lands on the other); a scale-down
drains the replica it removes. Skipped without Ray (the `ray` extra; `make test` installs it).
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.deploy_helpers import free_port
from tests.server_helpers import serve

ray = pytest.importorskip("ray")

# The cluster's start (up to 180 s) falls in the first test, its stop (up to 150 s) in the
# last, each test's requests may wait 120 s: past the default per-test timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MAX_TOKENS = 24
PROMPTS = [f"prompt {i}: def add(a, b):" for i in range(32)]


def _flags(tiny_dirs) -> list[str]:
    return [
        "--model", str(tiny_dirs["llama"]), "--draft-model", str(tiny_dirs["llama_draft"]),
        "--draft-length", "fixed", "--max-draft-tokens", "2", "--max-model-len", "256",
        "--block-size", "4", "--kv-cache-blocks", "192", "--served-model-name", "tiny",
        "--drain-timeout", "20",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tiny_dirs, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")  # a loopback test cluster
    cmd = [sys.executable, "-m", "server.ray_serve", "--num-replicas", "2", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*cmd, *_flags(tiny_dirs)], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    url = f"http://127.0.0.1:{port}"
    gcs = _wait_ready(proc, log, timeout=180)
    try:
        yield url, gcs, log
    finally:
        proc.send_signal(signal.SIGTERM)  # serve.shutdown: the replicas drain and stop
        try:
            proc.wait(timeout=90)
        finally:
            proc.kill()
            subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
                           capture_output=True, timeout=60)  # fmt: skip


def _wait_ready(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"ray cluster (\S+)\)", log.read_text())
        if found:
            return found.group(1)
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError("Ray Serve did not start:\n" + log.read_text()[-3000:])


def _client(url: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=retries, timeout=120)


def _ask(client: openai.OpenAI, prompt: str, stream: bool) -> tuple[str, str | None]:
    """(text, the replica that served it)."""
    kwargs = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    raw = client.completions.with_raw_response.create(stream=stream, **kwargs)
    body = raw.parse()
    text = "".join(c.choices[0].text for c in body if c.choices) if stream else body.choices[0].text
    return text, raw.headers.get("x-tandem-replica")


def _engine_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"ServeReplica:tandem:TandemEngine" in cmdline:
                pids.append(int(entry.name))
    return pids


def _replicas_idle(url: str, timeout: float = 30) -> set[str]:
    """Ask /metrics until two replicas were seen, each with an empty KV pool and no request."""
    seen: dict[str, bool] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (len(seen) < 2 or not all(seen.values())):
        response = httpx.get(f"{url}/metrics", timeout=10)
        replica = response.headers["x-tandem-replica"]
        usage = re.search(r"^tandem_kv_cache_usage_ratio (\S+)$", response.text, re.M)
        running = re.search(r"^tandem_requests_running (\S+)$", response.text, re.M)
        seen[replica] = float(usage.group(1)) == 0 and float(running.group(1)) == 0
    assert len(seen) >= 2 and all(seen.values()), seen
    return set(seen)


def test_two_replicas_serve_32_concurrent_requests_with_single_server_text(cluster, tiny_dirs):
    url, _, _ = cluster
    client = _client(url)
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda i: _ask(client, PROMPTS[i], i % 2 == 1), range(32)))
    replicas = {replica for _, replica in answers}
    assert len(replicas) == 2, replicas  # both replicas served some
    single_server = serve(tiny_dirs, speculative__method="off")  # the reference
    single = next(single_server)
    try:
        want = [
            single.client.completions.create(
                model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0
            )
            .choices[0]
            .text
            for p in PROMPTS
        ]
    finally:
        single_server.close()
    assert [text for text, _ in answers] == want
    _replicas_idle(url)


def test_a_replica_killed_under_load_loses_no_request(cluster):
    url, _, _ = cluster
    client = _client(url, retries=3)  # the SDK retries a 503 (replica_unavailable)
    victims = _engine_pids()
    assert len(victims) == 2, victims
    results: dict[int, str] = {}
    failures: list[str] = []

    def run(i: int) -> None:
        for _ in range(3):  # a stream cut by the dying replica: a fresh request
            try:
                results[i] = _ask(client, PROMPTS[i], stream=i % 2 == 1)[0]
                return
            except openai.APIError as exc:
                failures.append(f"{i}: {exc}")
        raise AssertionError(f"request {i} never succeeded")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    os.kill(victims[0], signal.SIGKILL)
    for t in threads:
        t.join(timeout=180)
    assert len(results) == 24, (len(results), failures)
    # Serve replaces the dead replica; afterwards every replica is idle with its pool free.
    deadline = time.monotonic() + 120
    while len(_engine_pids()) < 2 and time.monotonic() < deadline:
        time.sleep(1)
    _replicas_idle(url, timeout=60)


def test_scaling_down_drains_the_replica_it_removes(cluster, tiny_dirs, monkeypatch):
    url, gcs, _ = cluster
    from ray import serve

    from server.ray_serve import build_app

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(address=gcs, log_to_driver=False)
    try:
        _replica_metrics_reach_rays_exporter()
        client = _client(url)  # no retries: every request accepted must finish
        with ThreadPoolExecutor(16) as pool:
            pending = [pool.submit(_ask, client, PROMPTS[i], i % 2 == 1) for i in range(16)]
            time.sleep(0.2)
            overrides = _overrides(tiny_dirs)
            serve.run(build_app(overrides, num_replicas=1), name="tandem", route_prefix="/",
                      blocking=False)  # fmt: skip
            answers = [f.result(timeout=120) for f in pending]
        assert all(text for text, _ in answers)
        assert len({replica for _, replica in answers}) == 2  # the removed one served some
        deadline = time.monotonic() + 60
        while len(_engine_pids()) > 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(_engine_pids()) == 1
    finally:
        ray.shutdown()


def _overrides(tiny_dirs) -> dict:
    from server.cli import build_parser

    args = vars(build_parser().parse_args(["serve", *_flags(tiny_dirs)]))
    return {k: v for k, v in args.items() if "." in k}


def _replica_metrics_reach_rays_exporter(timeout: float = 60) -> None:
    """Each engine replica's counters, tagged by replica, at the node's Prometheus exporter."""
    [node] = ray.nodes()
    url = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    deadline = time.monotonic() + timeout
    replicas: set[str] = set()
    while len(replicas) < 2 and time.monotonic() < deadline:
        text = httpx.get(url, timeout=10).text
        replicas = set(
            re.findall(r'^ray_tandem_num_blocks_total\{[^}]*replica="([^"]+)"', text, re.M)
        )
        time.sleep(1)
    assert len(replicas) == 2, replicas
