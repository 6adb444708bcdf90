"""A lean client for streamed OpenAI responses: HTTP/1.1 over asyncio streams, one connection
per request, the chunked body undone by hand and the server-sent events split from it.

The chat benchmark's client runs on the machine it measures. On a 2-core machine every
millisecond of CPU it spends per streamed token is taken from the server under test, and the
faster the server streams, the larger that share of its time. httpx reads a stream through
its own state machines and decoders at 0.25-0.51 ms of CPU per streamed chunk, this at
0.11-0.26 ms, with the event loop's own buffered reader and a `json.loads` per event
(docs/BENCHMARKS.md, "The benchmark's own client: from httpx to a lean reader").

It speaks only what the benchmark needs: a POST with a JSON body to a loopback server, a
status line, headers, then a body sent chunked (a streamed response) or with a
Content-Length (an error). Nothing else, and no redirects, proxies or TLS.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


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
            yield status, (await _unchunk_all(reader)).decode(errors="replace")
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


async def _unchunk_all(reader: asyncio.StreamReader) -> bytes:
    return b"".join([c async for c in _chunks(reader)])
