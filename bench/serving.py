"""The benchmarks' servers and client: OpenAI-compatible servers as child processes on
127.0.0.1, each in its own session (stopping one stops the workers it forked, as vLLM's engine
process, and nothing else); a lean streaming client (`post_events`: HTTP/1.1 over asyncio
streams, chunked bodies and server-sent events undone by hand, to spend little of the CPU it
measures); and timings. A `Trace` is the moments tokens reached the client and how many each
carried; a gap of g seconds before a chunk of n tokens counts as n inter-token samples of g / n.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-peers" / "vllm" / "bin" / "python"


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"the URL must point at this machine (127.0.0.1), got host {host!r}")


@dataclass(frozen=True)
class ServerCase:
    argv: list[str]  # the command line; "{port}" is replaced by a free port
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/v1/models"
    start_timeout_s: float = 600.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tandem_serve(flags: list[str], log_path: Path) -> tuple[RunningServer, float]:
    """`tandem serve` with `flags` on 127.0.0.1 (`start`)."""
    argv = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", "{port}"]
    return start(ServerCase([*argv, *flags], ready_path="/health"), log_path)


def start(case: ServerCase, log_path: Path) -> tuple[RunningServer, float]:
    """The server started and ready, and the seconds it took; stopped again if it failed."""
    server = RunningServer(case, log_path)
    try:
        return server, server.wait_ready()
    except BaseException:
        server.stop()
        raise


class RunningServer:
    def __init__(self, case: ServerCase, log_path: Path) -> None:
        self.case = case
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        argv = [a.replace("{port}", str(self.port)) for a in case.argv]
        self._log.write("$ " + " ".join(argv) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=os.environ | case.env,
            start_new_session=True,
        )  # fmt: skip

    def wait_ready(self) -> float:
        """Seconds until the server answered; raises RuntimeError with the log's gist."""
        start = time.perf_counter()
        deadline = start + self.case.start_timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}: {self.error_gist()}")
            try:
                if httpx.get(self.url + self.case.ready_path, timeout=5).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"not ready after {self.case.start_timeout_s:.0f}s: {self.error_gist()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()

    def error_gist(self, limit: int = 400) -> str:
        self._log.flush()
        return log_gist(self.log_path.read_text(errors="replace"), limit)


_RAISED = re.compile(r"\b[A-Z]\w*(Error|Exception): \S")
_ERROR_LINE = re.compile(r"(Error|Exception|error:|not supported|NotImplemented)")
# Follow-on errors name no cause of their own; the first raised exception does.
_FOLLOW_ON = ("EngineDeadError", "See stack trace", "please check the stack trace")


def log_gist(text: str, limit: int = 400) -> str:
    """The first raised exception in a log that names a cause, else its last error-looking
    line, else its last line; shortened, log prefixes dropped."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and "WARNING" not in ln]
    raised = [ln for ln in lines if _RAISED.search(ln) and not any(f in ln for f in _FOLLOW_ON)]
    errors = [ln for ln in lines if _ERROR_LINE.search(ln)]
    if raised:
        gist = raised[0]
        gist = gist[_RAISED.search(gist).start() :]
    else:
        gist = errors[-1] if errors else (lines[-1] if lines else "(empty log)")
    return gist if len(gist) <= limit else gist[: limit - 3] + "..."


class StreamError(Exception):
    """The server answered outside what this client reads (or closed the connection)."""


async def post_events(url: str, path: str, body: dict) -> AsyncIterator[tuple[int, str]]:
    """POST `body` to `url` + `path`; yield (status, data) per server-sent event's `data:`
    field in order, or one (status, whole body) when the status is not 200."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\n"
            "Connection: close\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        status, headers = await _head(reader)
        if headers.get("transfer-encoding", "").lower() != "chunked":
            length = headers.get("content-length")
            data = await (reader.readexactly(int(length)) if length else reader.read())
            yield status, data.decode(errors="replace")
            return
        if status != 200:
            yield status, b"".join([c async for c in _chunks(reader)]).decode(errors="replace")
            return
        pending = b""
        async for chunk in _chunks(reader):
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield status, line[5:].strip().decode()
    finally:
        writer.close()


async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    line = await reader.readline()
    fields = line.split(None, 2)
    if len(fields) < 2 or not fields[0].startswith(b"HTTP/1."):
        raise StreamError(f"not an HTTP/1.x status line: {line[:80]!r}")
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(fields[1]), headers


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The chunks of a chunked body, CRs dropped (SSE lines may end in CRLF), until the last."""
    while True:
        size_line = await reader.readline()
        if not size_line:
            raise StreamError("the connection closed inside a chunked body")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            await reader.readline()  # the (empty) trailer section's end
            return
        data = await reader.readexactly(size + 2)  # the chunk and its CRLF
        yield data[:-2].replace(b"\r", b"")


@dataclass
class Trace:
    """One request as the client saw it. Times are time.perf_counter() seconds."""

    start: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    """(arrival time, tokens in the chunk); chunks with no tokens are not recorded."""
    output_tokens: int = 0
    """Tokens the system says it produced (usage), else the sum over chunks."""
    error: str | None = None


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(traces: list[Trace], seconds: float) -> dict[str, float | int]:
    """Throughput and latency over the finished traces of one measured run."""
    ok = [t for t in traces if t.error is None and t.chunks]
    ttft = [t.chunks[0][0] - t.start for t in ok]
    itl: list[float] = []
    gaps: list[float] = []
    tpot: list[float] = []
    for t in ok:
        for (prev, _), (now, n) in zip(t.chunks, t.chunks[1:], strict=False):
            itl += [(now - prev) / n] * n
            gaps.append(now - prev)
        later = sum(n for _, n in t.chunks[1:])
        if later:
            tpot.append((t.chunks[-1][0] - t.chunks[0][0]) / later)
    tokens = sum(t.output_tokens for t in ok)
    ms = 1e3
    return {
        "requests": len(traces),
        "failed": len(traces) - len(ok),
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else math.nan,
        "requests_per_s": len(ok) / seconds if seconds > 0 else math.nan,
        "ttft_p50_ms": ms * percentile(ttft, 50),
        "ttft_p99_ms": ms * percentile(ttft, 99),
        "ttft_mean_ms": ms * statistics.fmean(ttft) if ttft else math.nan,
        "itl_p50_ms": ms * percentile(itl, 50),
        "itl_p99_ms": ms * percentile(itl, 99),
        "itl_mean_ms": ms * statistics.fmean(itl) if itl else math.nan,
        "tpot_p50_ms": ms * percentile(tpot, 50),
        "tpot_p99_ms": ms * percentile(tpot, 99),
        "chunk_gap_p50_ms": ms * percentile(gaps, 50),
        "chunk_gap_p99_ms": ms * percentile(gaps, 99),
        "tokens_per_chunk": sum(n for t in ok for _, n in t.chunks)
        / max(1, sum(len(t.chunks) for t in ok)),
    }


def vllm_env(threads: int) -> dict[str, str]:
    """vLLM-CPU's environment: 1 GiB of KV cache, OpenMP threads bound to the first `threads`
    cores, warnings only, and the preloads its CPU guide asks for where present (tcmalloc from
    the distribution's libtcmalloc-minimal4, libiomp5 from the intel-openmp wheel)."""
    preload = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
               VLLM_PYTHON.parent.parent / "lib" / "libiomp5.so"]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_LOGGING_LEVEL": "WARNING"}  # fmt: skip
    if present := ":".join(str(c) for c in preload if c.exists()):
        env["LD_PRELOAD"] = present
    return env
