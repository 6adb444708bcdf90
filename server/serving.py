"""One choice of one request, from engine tokens to released text with a finish reason.

`generate_choice` drives `AsyncEngine.generate` for one engine request: it detokenizes
incrementally, holds back text that may still become a stop string, aborts the engine
request when a stop string matches, and measures latencies. Both endpoints, streamed or not,
consume the same `ChoiceDelta`s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING

from engine import RequestOutput, SamplingParams, TokenLogprob
from server.detokenizer import IncrementalDetokenizer, Piece, StopStringFilter
from server.errors import APIError
from server.responses import DraftCounts, PromptTokensDetails, SpeculativeUsage, Usage
from server.state import ServerState

if TYPE_CHECKING:
    from engine import EngineClient

Outputs = AsyncIterator[RequestOutput]
"""An engine request's output stream (EngineClient.generate)."""


@dataclass(frozen=True)
class ChoiceRequest:
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...] = ()


@dataclass
class ChoiceUsage:
    """Counts for one engine request so far (the engine reports running totals)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    by_source: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Drafted and accepted tokens by what drafted them (RequestOutput.drafts_by_source)."""

    @classmethod
    def of(cls, out: RequestOutput) -> ChoiceUsage:
        return cls(
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            cached_tokens=out.num_cached_tokens,
            by_source=out.drafts_by_source,
        )


@dataclass
class ChoiceDelta:
    """Newly released output of one choice. The first delta of a choice has `first` set."""

    index: int
    pieces: list[Piece] = field(default_factory=list)
    finish_reason: str | None = None
    """stop | length, on the last delta only."""
    usage: ChoiceUsage = field(default_factory=ChoiceUsage)
    first: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return "".join(piece.text for piece in self.pieces)


def _timed_out(timeout: float | None) -> APIError:
    return APIError(
        f"The request did not finish within the server's limit of {timeout:g} seconds "
        "(--request-timeout) and was stopped. Ask for fewer tokens or retry later.",
        504,
        code="timeout",
    )


def _failure(out: RequestOutput) -> APIError:
    if out.finish_reason == "abort":
        return APIError("The request was aborted by the server (shutting down?)", 503)
    if out.error_code == "invalid_grammar":  # the request's grammar, not the server, failed
        return APIError(f"Generation failed: {out.error}", 400, code="invalid_grammar")
    return APIError(f"Generation failed: {out.error or 'engine error'}", 500, code="engine_error")


def submit_all(state: ServerState, choices: Sequence[ChoiceRequest]) -> list[Outputs]:
    """Hand every choice of a request to the engine, or none: APIError 400 for input the
    engine refuses, 503 when the waiting queue has no room for them all. Nothing awaits in
    between, so no other request takes the room it checked."""
    from engine import QueueFullError  # imports torch: loaded when first needed

    engine = state.ready_engine()
    streams: list[Outputs] = []
    try:
        for choice in choices:
            engine.validate(choice.prompt_ids, choice.params)
        engine.admit(len(choices))
        for choice in choices:
            streams.append(engine.generate(choice.request_id, choice.prompt_ids, choice.params))
        return streams
    except (QueueFullError, ValueError) as exc:
        for choice in choices[: len(streams)]:
            engine.abort(choice.request_id)
        state.metrics.requests_finished.labels("rejected").inc(len(choices))
        if isinstance(exc, ValueError):
            raise APIError(str(exc), 400) from exc
        raise APIError(
            f"Server busy: the waiting queue is full ({exc})",
            503,
            code="queue_full",
            headers={"Retry-After": "1"},
        ) from exc


async def generate_choice(
    state: ServerState,
    engine: EngineClient,
    choice: ChoiceRequest,
    arrival: float,
    outputs: Outputs,
) -> AsyncIterator[ChoiceDelta]:
    """Yield a first delta as soon as the engine answers, then one per release of text.

    `outputs`: `engine`'s stream for the choice (submit_all): from then on an engine that
    fails fails the request (500), however soon. Raises APIError for that, or for one that
    outlived --request-timeout (504). Leaving early (client gone, task cancelled) aborts the
    engine request.
    """
    loop = asyncio.get_running_loop()
    timeout = state.settings.server.request_timeout
    # At the deadline the engine aborts the request (freeing its blocks) wherever it is; the
    # abort comes back as its last output, which then means "timed out". A timer costs nothing
    # per token, unlike a timeout around every wait.
    timer = (
        None
        if timeout is None
        else loop.call_later(arrival + timeout - time.monotonic(), engine.abort, choice.request_id)
    )
    metrics = state.metrics
    detok = IncrementalDetokenizer(state.tokenizer, choice.prompt_ids)
    stops = StopStringFilter(choice.stops)
    first, last_token_time = True, None
    reason = "abort"  # until the engine or a stop string says otherwise
    engine_done = False
    try:
        async with aclosing(outputs):
            async for out in outputs:
                engine_done = out.finished
                now = time.monotonic()
                if out.new_token_ids:
                    if last_token_time is None:
                        metrics.time_to_first_token.observe(now - arrival)
                    else:
                        metrics.observe_tokens(now - last_token_time, len(out.new_token_ids))
                    last_token_time = now
                if out.finished and out.finish_reason not in ("stop", "length"):
                    reason = out.finish_reason or "error"
                    if reason == "abort" and timer is not None and loop.time() >= timer.when():
                        reason = "timeout"
                        raise _timed_out(timeout)
                    raise _failure(out)
                logprobs = out.new_logprobs or repeat(None)
                pieces = [
                    Piece(tid, detok.step(tid), lp)
                    for tid, lp in zip(out.new_token_ids, logprobs, strict=False)
                ]
                if out.finished and (tail := detok.flush()):
                    pieces.append(Piece(None, tail))
                released, stopped = stops.push(pieces)
                finish = "stop" if stopped else out.finish_reason if out.finished else None
                if finish is not None:
                    released += stops.flush()
                elif not released and not first:
                    continue
                prompt_logprobs = out.prompt_logprobs if first else None
                delta = ChoiceDelta(
                    choice.index, released, finish, ChoiceUsage.of(out), first, prompt_logprobs
                )
                if finish is not None:
                    reason = finish
                    yield delta
                    return
                yield delta
                first = False
    finally:
        if timer is not None:
            timer.cancel()
        if not engine_done:
            # After a stop string the engine would go on; after the consumer left (client
            # gone, task cancelled) the request's KV blocks must be freed at once.
            engine.abort(choice.request_id)
        if reason in ("stop", "length"):
            metrics.e2e_latency.observe(time.monotonic() - arrival)
        metrics.requests_finished.labels(reason).inc()


async def collect(deltas: AsyncIterator[ChoiceDelta]) -> dict[int, ChoiceDelta]:
    """Fold each choice's deltas into one (for non-streamed responses)."""
    merged: dict[int, ChoiceDelta] = {}
    async with aclosing(deltas):  # type: ignore[type-var]
        async for delta in deltas:
            whole = merged.setdefault(
                delta.index,
                ChoiceDelta(delta.index, first=True, prompt_logprobs=delta.prompt_logprobs),
            )
            whole.pieces.extend(delta.pieces)
            whole.finish_reason = delta.finish_reason
            whole.usage = delta.usage
    return merged


def total_usage(prompt_lengths: list[int], n: int, usages: dict[int, ChoiceUsage]) -> Usage:
    """Usage of a request: each prompt counted once, every choice's completion counted."""
    cached = sum(
        max((usages[p * n + i].cached_tokens for i in range(n) if p * n + i in usages), default=0)
        for p in range(len(prompt_lengths))
    )
    completion = sum(u.completion_tokens for u in usages.values())
    return Usage(
        prompt_tokens=sum(prompt_lengths),
        completion_tokens=completion,
        total_tokens=sum(prompt_lengths) + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        speculative=_speculative(usages.values()),
    )


def _speculative(usages) -> SpeculativeUsage:
    """The choices' drafts by what drafted them, summed, and in all."""
    out = SpeculativeUsage()
    for usage in usages:
        for source, (drafted, accepted) in usage.by_source.items():
            counts = out.by_proposer.setdefault(source, DraftCounts())
            counts.drafted_tokens += drafted
            counts.accepted_tokens += accepted
            out.drafted_tokens += drafted
            out.accepted_tokens += accepted
    return out
