"""Start an OpenAI-compatible server as a child process on 127.0.0.1, wait for it, stop it.

Each server gets its own session (process group) so stopping it also stops the worker
processes it forked (vLLM runs its engine in a separate process), and nothing else.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass(frozen=True)
class ServerCase:
    """One server configuration of one system."""

    system: str
    config: str
    kind: str
    """bench.loadgen kind: how this server is told to ignore EOS."""
    argv: list[str]
    """Command line; "{port}" is replaced by a free port."""
    model_name: str
    """The `model` field requests carry."""
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/v1/models"
    start_timeout_s: float = 600.0
    notes: str = ""
    max_requests: int | None = None
    """Cap on requests per level, for configurations too slow for the full count."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RunningServer:
    def __init__(self, case: ServerCase, log_path: Path, env: dict[str, str]) -> None:
        self.case = case
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        argv = [a.replace("{port}", str(self.port)) for a in case.argv]
        self._log.write("$ " + " ".join(argv) + "\n")
        self._log.flush()
        self.command = " ".join(argv)
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=os.environ | env | case.env,
            start_new_session=True,
        )

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
