"""What one engine step runs: the scheduled requests, their new tokens and drafts."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.types.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # from all_token_ids: a prefill chunk, or 1 when decoding
    num_draft_tokens: int = 0  # K; the proposer may fill fewer
    branches: int = 1  # draft-tree candidates for the next token, each to depth K
    # Drafts replacing the proposer's: a grammar's forced tokens, or a prompt lookup's.
    forced: list[int] | None = None
    lookup_match: int = 0  # a prompt lookup's: how many tokens of the context it matched
    reason: str | None = None
    """Why K is below K_max this step (the policy's reason or the scheduler's cut), or None."""
    samples: bool = field(init=False)
    """Whether this step reaches the end of the request's tokens and so samples."""

    def __post_init__(self) -> None:
        req = self.request
        self.samples = req.num_computed_tokens + self.num_new_tokens == req.num_tokens

    @property
    def looked_up(self) -> bool:
        return self.lookup_match > 0

    @property
    def num_proposed_tokens(self) -> int:
        """The drafts the proposer is asked for (none when the grammar supplies them)."""
        return 0 if self.forced else self.num_draft_tokens

    @property
    def num_draft_slots(self) -> int:
        return self.num_draft_tokens * self.branches


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    prefills: bool = False  # whether a prefilling request may be among the scheduled

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.num_new_tokens == 1 and s.samples)


@dataclass
class DraftPlan:
    """What one decoding request should verify this step (before the scheduler's cuts)."""

    k: int = 0
    reason: str | None = None
    """Why k < K_max, as the policy saw it (None when it is not)."""
    width: int = 1  # as ScheduledRequest.branches
    given: list[int] | None = None
    """Drafts in place of the proposer's: a grammar's forced tokens or a prompt lookup's."""
    lookup_match: int = 0

    @property
    def looked_up(self) -> bool:
        return self.lookup_match > 0


NO_DRAFTS = DraftPlan()
