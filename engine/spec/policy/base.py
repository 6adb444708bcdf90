"""The draft-length policy's protocol, its answer, and the fixed policies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.types.request import Request

# Why a request got fewer than K_max drafts (exported as a metric label).
REASON_BATCH = "batch_cost"
REASON_ACCEPTANCE = "low_acceptance"
REASON_BUDGET = "token_budget"
REASON_LENGTH = "max_tokens"
REASON_MEMORY = "kv_memory"
REASON_REQUEST = "request"  # the request's own `speculation` cap (SamplingParams.max_draft_tokens)


@dataclass
class DraftLengths:
    ks: list[int]
    reasons: list[str | None] = field(default_factory=list)  # why K < K_max, else None
    branches: int = 1  # draft-tree candidates per drafting request (1 = chains)


class DraftLengthPolicy(Protocol):
    """How many drafts (K) each decoding request gets this step, seen as a whole batch: `choose`
    returns one K in [0, max_draft_tokens] per request, in order, mutating none of them."""

    max_draft_tokens: int

    def choose(self, requests: list[Request], num_other_tokens: int = 0) -> DraftLengths: ...

    def observe(
        self, request: Request, num_drafted: int, num_accepted: int, branches: int = 1
    ) -> None:
        """A verified step of `request` (`branches` 1: a chain)."""
        ...

    def lookup_length(self, request: Request, k: int, match: int, found: int, batch: int) -> int:
        """How many of `found` prompt-lookup drafts, whose context matched `match` tokens,
        `request` verifies instead of its K."""
        ...

    def observe_lookup(
        self, match: int, num_drafted: int, num_accepted: int, request: Request | None = None
    ) -> None:
        """A verified lookup of `request`, whose context matched `match` tokens."""
        ...


class FixedDraftLength:
    """Always K_max, with a fixed number of draft-tree branches."""

    def __init__(self, max_draft_tokens: int, branches: int = 1) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.branches = branches

    def choose(self, requests: list[Request], num_other_tokens: int = 0) -> DraftLengths:
        n = len(requests)
        return DraftLengths([self.max_draft_tokens] * n, [None] * n, self.branches)

    def observe(
        self, request: Request, num_drafted: int, num_accepted: int, branches: int = 1
    ) -> None:
        pass

    def lookup_length(self, request: Request, k: int, match: int, found: int, batch: int) -> int:
        return min(k, found)

    def observe_lookup(
        self, match: int, num_drafted: int, num_accepted: int, request: Request | None = None
    ) -> None:
        pass


class NoSpeculation(FixedDraftLength):
    def __init__(self) -> None:
        super().__init__(0)
