"""ASGI middleware at the door: a request body over `--max-body-bytes` gets 413 in the OpenAI
error shape before anything parses it, whether it declares its length or arrives in chunks;
with `--api-key-scope all`, every path but /health needs the key (the API routes always do)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, error_response
from server.routes import key_error


class EntryGate:
    def __init__(self, app: ASGIApp, limit: int, key: str | None = None) -> None:
        self.app = app
        self.limit = limit
        self.key = key  # required on every path but /health, if given

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.key and scope["path"] != "/health":
            error = key_error(self.key, Request(scope).headers)
            if error is not None:
                await error_response(error, Request(scope))(scope, receive, send)
                return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        # The body read whole here (the routes parse it whole anyway), then handed on; later
        # receives (a streaming response's disconnect watch) go to the client's.
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                await self.app(scope, _replay(message, receive), send)
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await self._refuse(scope, receive, send)
                return
        await self.app(scope, _replay({"type": "http.request", "body": body}, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            f"The request body is over this server's limit of {self.limit} bytes "
            "(--max-body-bytes).",
            413,
            code="request_too_large",
        )
        await error_response(error, Request(scope))(scope, receive, send)


def _replay(first: Message, receive: Receive) -> Receive:
    pending = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
