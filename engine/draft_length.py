"""How many draft tokens (K) each decoding request gets this step.

A policy sees the whole decoding batch at once because the right K depends on the batch:
speculation that pays at batch 1 wastes compute at batch 64. `observe` feeds it the outcome of
every verification so it can track acceptance.
"""

from __future__ import annotations

from typing import Protocol

from engine.request import Request


class DraftLengthPolicy(Protocol):
    """Rules: `choose` returns one K in [0, max_draft_tokens] per request, in order; K = 0 means
    a plain decode with no draft work for that request. It must not mutate the requests."""

    def choose(self, requests: list[Request]) -> list[int]: ...

    def observe(self, request: Request, num_drafted: int, num_accepted: int) -> None: ...


class FixedDraftLength:
    """Always K_max (the baseline the adaptive policy is measured against)."""

    def __init__(self, max_draft_tokens: int) -> None:
        self.max_draft_tokens = max_draft_tokens

    def choose(self, requests: list[Request]) -> list[int]:
        return [self.max_draft_tokens] * len(requests)

    def observe(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        pass


class NoSpeculation(FixedDraftLength):
    def __init__(self) -> None:
        super().__init__(0)
