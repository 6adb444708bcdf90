"""Graceful drain: a replica leaving a load balancer finishes what it started.

On the first SIGTERM (or Ctrl-C) the server keeps listening, but /health turns 503 and new API
requests get 503 + Retry-After before any work starts (so a balancer can safely retry them on
another replica); requests already in flight, streams included, run to the end for up to
`--drain-timeout` seconds; then uvicorn shuts down and the process exits 0. A second signal
exits at once.

uvicorn's own handling would close the listening socket at the first signal (clients of a
balancer that has not noticed yet would see connection errors), and sse-starlette ends every
stream as soon as uvicorn's `should_exit` is set. `DrainingServer` therefore takes over
uvicorn's signal handler and sets `should_exit` only when the drain is over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from types import FrameType

import uvicorn
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import error_response
from server.state import ServerState, Status

log = logging.getLogger("tandem.server")
API_PREFIX = "/v1/"
ROOT_API = ("/tokenize", "/detokenize")
"""vLLM's tokenizer routes, at the root but API requests all the same."""
POLL_SECONDS = 0.05


def is_api(path: str) -> bool:
    return path.startswith(API_PREFIX) or path in ROOT_API


class DrainGate:
    """ASGI middleware: counts API requests in flight and refuses new ones while draining.

    Only API routes (/v1, /tokenize, /detokenize) pass the gate: /health, /metrics and /version
    keep answering during a drain so probes and Prometheus see the replica leave.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_api(scope["path"]):
            await self.app(scope, receive, send)
            return
        if self.state.status is Status.DRAINING:
            response = error_response(self.state.unavailable(), Request(scope))
            await response(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            # Returns only once the whole response, a stream's last event included, is sent.
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains the server instead of closing its socket."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        self._signalled = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn installs this for SIGINT and SIGTERM (when serving from the main thread).

        Not calling uvicorn's version also keeps it from re-raising the signal after the
        shutdown, which would turn the exit status 0 of a clean drain into "killed".
        """
        if self._signalled:
            name = signal.Signals(sig).name
            os.write(2, f"tandem: second {name}, exiting without waiting\n".encode())
            os._exit(128 + sig)  # at once: no thread joins, no waiting on the engine
        self._signalled = True
        if self.state.status is not Status.FAILED:
            # Set here, not in the loop callback, so no request parsed from now on gets in.
            self.state.status = Status.DRAINING
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_drain, sig)
        else:  # a signal before serving started: nothing to drain
            self.should_exit = True

    def _start_drain(self, sig: int) -> None:
        self._drain = asyncio.create_task(self._wait_for_requests(signal.Signals(sig).name))

    async def _wait_for_requests(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        log.info(
            "%s: draining, %d request(s) in flight, up to %gs; new requests get 503",
            name,
            self.state.in_flight,
            self.drain_timeout,
        )
        while self.state.in_flight and loop.time() < deadline:
            await asyncio.sleep(POLL_SECONDS)
        if self.state.in_flight:
            log.warning(
                "drain timeout (%gs): cutting %d request(s) short",
                self.drain_timeout,
                self.state.in_flight,
            )
        else:
            log.info("drained: no request in flight")
        self.should_exit = True
