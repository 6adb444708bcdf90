"""What one verified step hands back to speculation: the one value every learner reads."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from engine.spec.proposers.base import DraftBatch
from engine.spec.verifier import VerifyResult
from engine.types.batch import SchedulerOutput


@dataclass
class StepResult:
    sched: SchedulerOutput
    drafts: DraftBatch | None
    """What was verified: the proposer's drafts with grammar-forced and looked-up ones in place."""
    verified: VerifyResult
    """The verified tokens per request, and the target's hidden states (`VerifyResult.hidden`)."""
    draft_seconds: float
    target_seconds: float
    timed: bool = True
    """False when a CUDA graph was captured during the step: its time says nothing of steps'."""

    @cached_property
    def num_drafts(self) -> list[int]:
        """Per scheduled request, the drafts it verified."""
        if self.drafts is None:
            return [0] * len(self.sched.scheduled)
        return [len(d) for d in self.drafts.token_ids]

    @cached_property
    def proposed(self) -> list[int]:
        """Per scheduled request, the drafts the proposer made (forced ones cost it nothing)."""
        return [
            0 if item.forced else k
            for item, k in zip(self.sched.scheduled, self.num_drafts, strict=True)
        ]

    @cached_property
    def draft_passes(self) -> int:
        passes = self.drafts.passes if self.drafts else 0
        return passes or max(self.proposed, default=0)
