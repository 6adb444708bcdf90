"""`EngineClient`: what a server needs from an engine, and nothing more. `AsyncEngine` and the
tests' scripted engine implement it (tests/test_architecture.py checks the signatures)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engine.types.outputs import RequestOutput
from engine.types.request import GrammarSpec, SamplingParams
from engine.types.stats import EngineStats


class EngineClient(Protocol):
    max_model_len: int  # longest prompt + output (capped by the KV pool)
    vocab_size: int
    cpu_isa: str | None  # the target's CPU kernels' instruction set, or None (/version)

    def start(self) -> None:
        """Begin stepping (idempotent)."""
        ...

    def shutdown(self) -> None:
        """Stop stepping; unfinished requests end with an error output."""
        ...

    def problem(self) -> str | None:
        """Why the engine cannot serve (a dead or stalled step loop), or None."""
        ...

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest unless the request can be served (`generate` checks it too)."""
        ...

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile a grammar (or find it compiled); raise InvalidRequest naming `spec.param` if
        it does not compile. Slow for a large schema: call it off the event loop."""
        ...

    def admit(self, count: int) -> None:
        """Raise QueueFullError unless `count` more requests fit in the waiting queue now."""
        ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request; raises ValueError (bad input) or QueueFullError at the call, then
        streams output deltas. Closing the iterator early aborts the request."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters."""
        ...

    def spare_cores(self) -> set[int] | None:
        """Cores the caller's threads may use without competing with the engine's, or None."""
        ...
