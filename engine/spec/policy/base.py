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


@dataclass
class DraftLengths:
    ks: list[int]
    reasons: list[str | None] = field(default_factory=list)
    """Per request: why K < K_max (None when it is not)."""
    branches: int = 1
    """Draft-tree candidates for the next token of every drafting request (1 = chains)."""


class DraftLengthPolicy(Protocol):
    """How many drafts (K) each decoding request gets this step.

    A policy sees the whole decoding batch at once because the right K depends on the batch:
    speculation that pays at batch 1 wastes compute at batch 64. Rules: `choose` returns one K
    in [0, max_draft_tokens] per request, in order; K = 0 means a plain decode with no draft
    work for that request. It must not mutate the requests. `num_other_tokens` is how many
    non-decode (prefill) tokens the step also carries. The `observe*` calls feed it every
    verification's outcome (engine/spec/planner.py is their one caller).
    """

    max_draft_tokens: int

    def choose(self, requests: list[Request], num_other_tokens: int = 0) -> DraftLengths: ...

    def observe(
        self, request: Request, num_drafted: int, num_accepted: int, branches: int = 1
    ) -> None:
        """A verified step of `request`: drafts of depth num_drafted, num_accepted kept, from
        a tree of `branches` candidates at its root (1: a chain)."""
        ...

    def lookup_length(self, request: Request, k: int, found: int, batch: int) -> int:
        """How many of `found` prompt-lookup drafts (`speculative.ngram_assist`) `request`
        verifies in place of the proposer's, given its K in a batch of `batch` requests."""
        ...

    def observe_lookup(self, num_drafted: int, num_accepted: int) -> None:
        """A verified chain of prompt-lookup drafts."""
        ...


class FixedDraftLength:
    """Always K_max (the baseline the adaptive policy is measured against), with a fixed
    number of draft-tree branches."""

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

    def lookup_length(self, request: Request, k: int, found: int, batch: int) -> int:
        return min(k, found)

    def observe_lookup(self, num_drafted: int, num_accepted: int) -> None:
        pass


class NoSpeculation(FixedDraftLength):
    def __init__(self) -> None:
        super().__init__(0)
