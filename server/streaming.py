"""Running several choices at once, SSE framing, and aborting work nobody will read.

A client that goes away must not keep the engine busy: streamed responses abort their engine
requests when the SSE response ends for any reason (sse-starlette cancels the body on
disconnect), and non-streamed ones race their work against the client's disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.errors import APIError
from server.serving import ChoiceDelta, ChoiceRequest, collect, generate_choice, submit_all
from server.state import ServerState

T = TypeVar("T")
log = logging.getLogger("tandem.server")
PING_SECONDS = 15


@dataclass(frozen=True)
class _Failed:
    error: BaseException


_DONE = object()


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of all streams as they come. The first error ends everything; so does leaving."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async with aclosing(stream) as items:  # type: ignore[type-var]
                async for item in items:
                    await queue.put(item)
            await queue.put(_DONE)
        except Exception as exc:
            await queue.put(_Failed(exc))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        # Let the cancelled generators run their cleanup (engine aborts) before returning.
        await asyncio.gather(*tasks, return_exceptions=True)


async def started(stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the first item (so refusals become HTTP errors), then replay it and the rest."""
    try:
        first = await anext(stream)
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise

    async def replay() -> AsyncIterator[T]:
        async with aclosing(stream) as rest:  # type: ignore[type-var]
            yield first
            async for item in rest:
                yield item

    return replay()


class _EventStream(EventSourceResponse):
    """sse-starlette's response, each send made directly when no per-send timeout is set:
    its `_send_with_timeout` wraps every send in an anyio cancel scope that can never fire
    without a timeout, and entering and leaving that scope was about a fifth of the event
    loop's time per streamed token (bench/server_overhead.py, profiled)."""

    async def _send_with_timeout(self, send: Any, message: Any) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def sse_frame(data: str) -> bytes:
    """One SSE event of one `data:` line, as sse-starlette encodes it (its default "\\r\\n"
    separator), without building its event object per token. `data` holds no line break:
    JSON from `json.dumps` escapes them."""
    return b"data: " + data.encode() + b"\r\n\r\n"


def sse_response(
    chunks: AsyncIterator[dict[str, Any]], on_close: Callable[[], None]
) -> EventSourceResponse:
    """`data: {json}` per chunk, an error event if generation fails, then `data: [DONE]`."""

    async def events() -> AsyncIterator[bytes]:
        try:
            async with aclosing(chunks) as items:  # type: ignore[type-var]
                async for chunk in items:
                    yield sse_frame(json.dumps(chunk, ensure_ascii=False))
        except APIError as exc:
            yield sse_frame(json.dumps(exc.body(), ensure_ascii=False))
        except Exception as exc:
            log.exception("stream failed")
            body = APIError(f"Internal server error: {type(exc).__name__}", 500).body()
            yield sse_frame(json.dumps(body))
        finally:
            on_close()
        yield sse_frame("[DONE]")

    # on_close also runs as a background task: it covers a body that never started.
    return _EventStream(events(), ping=PING_SECONDS, background=BackgroundTask(on_close))


async def until_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run work unless the client disconnects first: (True, result) or (False, None)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def respond(
    raw: Request,
    state: ServerState,
    choices: Sequence[ChoiceRequest],
    *,
    arrival: float,
    stream: bool,
    to_chunks: Callable[[AsyncIterator[ChoiceDelta]], AsyncIterator[dict[str, Any]]],
    to_body: Callable[[dict[int, ChoiceDelta]], dict[str, Any]],
) -> Response:
    """Run every choice of a request; answer with an SSE stream or one JSON body.

    arrival: time.monotonic() when the request came in (latency metrics count from it).
    """
    engine = state.ready_engine()
    streams = submit_all(state, choices)  # all or none, before anything is sent
    deltas = merge(
        [
            generate_choice(state, engine, c, arrival, s)
            for c, s in zip(choices, streams, strict=True)
        ]
    )

    def abort_all() -> None:
        for choice in choices:
            engine.abort(choice.request_id)

    if stream:
        # A client that leaves while its request is still queued must not keep its place.
        connected, first = await until_disconnected(raw, started(deltas))
        if not connected or first is None:
            abort_all()
            return Response(status_code=499)
        return sse_response(to_chunks(first), on_close=abort_all)
    finished, results = await until_disconnected(raw, collect(deltas))
    if not finished or results is None:
        abort_all()
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    return JSONResponse(to_body(results))
