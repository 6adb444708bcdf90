"""The deployment of docker/compose.yaml without Docker: `tandem serve` processes on loopback
ports and, in front of them, the nginx binary with the repo's docker/nginx.conf.

Every process is started with a deadline and stopped by the fixture that started it.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
NGINX_TEMPLATE = REPO / "docker" / "nginx.conf"
UPSTREAM_PLACEHOLDER = "${TANDEM_UPSTREAM}"
LISTEN_PLACEHOLDER = "${NGINX_LISTEN}"
MODEL = "tiny"
STARTUP_SECONDS = 90  # two replicas importing torch on two busy cores


def dockerfile_instructions() -> list[tuple[str, str]]:
    """The Dockerfile's (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range (and above Ray's worker ports,
    10002-19999). A port-0 pick comes from the ephemeral range, where any outgoing connection or
    port-0 listener can take it before the server binds it; Ray's processes open dozens of those,
    and once took the port a test had picked for Ray Serve's proxy."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    for port in random.sample(range(20000, low), min(256, max(low - 20000, 0))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # an unusual range: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nginx_binary() -> str | None:
    """The nginx executable, also where Debian puts it outside a non-root PATH."""
    return shutil.which("nginx") or next(
        (path for path in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(path, os.X_OK)),
        None,
    )


NEEDS_NGINX = pytest.mark.skipif(
    nginx_binary() is None,
    reason="needs the nginx binary (Debian package `nginx`; .ci/run installs it)",
)


def render_nginx_conf(upstreams: Sequence[str], listen: str) -> str:
    """docker/nginx.conf with its placeholders filled the way its header documents.

    The `server ${TANDEM_UPSTREAM}` line is repeated once per upstream address (compose fills
    it once with a name that resolves to every replica).
    """
    lines = []
    for line in NGINX_TEMPLATE.read_text().splitlines(keepends=True):
        if line.strip().startswith(f"server {UPSTREAM_PLACEHOLDER}"):
            lines += [line.replace(UPSTREAM_PLACEHOLDER, address) for address in upstreams]
        else:
            lines.append(line.replace(LISTEN_PLACEHOLDER, listen))
    text = "".join(lines)
    assert "${" not in text, "docker/nginx.conf has a placeholder the tests do not fill"
    return text


@dataclass
class Replica:
    port: int
    log: Path
    proc: subprocess.Popen
    signalled_at: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def terminate(self) -> None:
        self.signalled_at = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)


def start_replica(
    tiny_dirs: dict, log: Path, *, drain_timeout: float, api_key_file: Path | None = None
) -> Replica:
    """`tandem serve` on a free loopback port with the small engine the API tests use; with
    `api_key_file`, its key guards the API, read the way compose passes it (TANDEM_API_KEY_FILE)."""
    port = free_port()
    args = [
        "serve", "--model", str(tiny_dirs["llama"]), "--draft-model", str(tiny_dirs["llama_draft"]),
        "--speculative-method", "draft", "--max-draft-tokens", "2", "--block-size", "4",
        "--kv-cache-blocks", "192", "--max-model-len", "256", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "128", "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--drain-timeout", str(drain_timeout),
    ]  # fmt: skip
    # One torch thread each: two replicas, nginx and the clients share two cores.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if api_key_file is not None:
        env["TANDEM_API_KEY_FILE"] = str(api_key_file)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
    return Replica(port, log, proc)


def wait_healthy(replicas: Sequence[Replica], timeout: float = STARTUP_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    pending = list(replicas)
    while pending:
        replica = pending[0]
        assert replica.proc.poll() is None, f"replica exited:\n{replica.output()}"
        try:
            if httpx.get(f"{replica.url}/health", timeout=2).status_code == 200:
                pending.pop(0)
                continue
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"replica not healthy:\n{replica.output()}"
        time.sleep(0.1)


def stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_ACCESS_LINE = re.compile(
    r'"(?P<request>[^"]*)" (?P<status>\d+) \d+ up=(?P<up>.*?) upstatus=(?P<upstatus>.*?) '
    r"rt=(?P<rt>[\d.]+) msec=(?P<msec>[\d.]+)$"
)


@dataclass(frozen=True)
class Access:
    """One line of the `tandem` access log format in docker/nginx.conf."""

    request: str
    status: int
    upstreams: tuple[str, ...]
    """Every replica nginx tried, in order; the last one answered."""
    upstream_statuses: tuple[str, ...]
    started: float
    """Wall-clock time (time.time()) nginx read the request."""

    @classmethod
    def parse(cls, line: str) -> Access:
        match = _ACCESS_LINE.search(line)
        assert match, f"not a tandem access log line: {line!r}"
        ended, took = float(match["msec"]), float(match["rt"])
        return cls(
            request=match["request"],
            status=int(match["status"]),
            upstreams=tuple(match["up"].split(", ")),
            upstream_statuses=tuple(match["upstatus"].split(", ")),
            started=ended - took,
        )


@dataclass
class Balancer:
    proc: subprocess.Popen
    port: int
    out: Path
    err: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def access_log(self) -> list[Access]:
        return [Access.parse(line) for line in self.out.read_text().splitlines() if line]


def start_nginx(binary: str, prefix: Path, upstreams: Sequence[str]) -> Balancer:
    """nginx in the foreground with the rendered docker/nginx.conf, once it accepts."""
    prefix.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(render_nginx_conf(upstreams, f"127.0.0.1:{port}"))
    out, err = prefix / "stdout.log", prefix / "stderr.log"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            [binary, "-p", f"{prefix}/", "-c", str(conf), "-e", "stderr", "-g", "daemon off;"],
            stdout=stdout,
            stderr=stderr,
        )
    balancer = Balancer(proc, port, out, err)
    deadline = time.monotonic() + 15
    while True:
        assert proc.poll() is None, f"nginx exited: {err.read_text()}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return balancer
        except OSError:
            assert time.monotonic() < deadline, f"nginx does not listen: {err.read_text()}"
            time.sleep(0.05)


def finished_requests(url: str) -> float:
    """All choices a replica finished, whatever the reason (its /metrics)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem_requests_finished_total"
    )


def stream_events(client: httpx.Client, url: str, body: dict) -> Iterator[tuple[float, str]]:
    """(arrival time, data) for every SSE `data:` line of a streamed request."""
    with client.stream("POST", url, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                yield time.monotonic(), line.removeprefix("data:").strip()


@contextmanager
def behind_nginx(tiny_dirs: dict, root: Path, **replica: object) -> Iterator[tuple[list, Balancer]]:
    """Two `start_replica(..., **replica)` replicas behind the real nginx with
    docker/nginx.conf: (replicas, balancer) once all are up; everything stopped after."""
    replicas = [start_replica(tiny_dirs, root / f"replica{i}.log", **replica) for i in (0, 1)]
    balancer = None
    try:
        wait_healthy(replicas)
        binary = nginx_binary()
        assert binary is not None
        balancer = start_nginx(binary, root / "nginx", [r.address for r in replicas])
        yield replicas, balancer
    finally:
        for each in replicas:
            stop(each.proc)
        if balancer is not None:
            stop(balancer.proc)
