"""`EngineClient`: what a server needs from an engine, and nothing more.

`AsyncEngine` implements it; so does any stand-in (the tests' scripted engine). The server
types its engine as an `EngineClient`, so the two stay interchangeable; tests/
test_architecture.py checks that every implementation has every member with the protocol's
signature, and type-checks them with mypy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engine.types.outputs import RequestOutput
from engine.types.request import GrammarSpec, SamplingParams
from engine.types.stats import EngineStats


class EngineClient(Protocol):
    max_model_len: int
    """Longest prompt + output a request may have (already capped by the KV pool)."""
    vocab_size: int
    cpu_isa: str | None
    """The instruction set of the CPU kernels the target runs on, or None (/version)."""

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
        """Raise InvalidRequest (engine/types/validation.py) unless the request can be served;
        `generate` runs the same check."""
        ...

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile a structured-output grammar (or find it compiled); raise InvalidRequest
        naming `spec.param` if it does not compile. A large schema takes a while: call it off
        the event loop, and `validate` then finds it compiled."""
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
        """Cores the caller's own threads may use without competing with the engine's, or
        None when the engine is not bound to cores of its own."""
        ...
