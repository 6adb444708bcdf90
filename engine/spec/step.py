"""What one verified step hands back to speculation: the one value every learner reads."""

from __future__ import annotations

from dataclasses import dataclass, field

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

    num_drafts: list[int] = field(init=False)
    """Per scheduled request, the drafts it verified."""
    proposed: list[int] = field(init=False)
    """Per scheduled request, the drafts the proposer made (forced ones cost it nothing)."""
    draft_passes: int = field(init=False)

    def __post_init__(self) -> None:
        drafts, scheduled = self.drafts, self.sched.scheduled
        counts = [len(d) for d in drafts.token_ids] if drafts is not None else [0] * len(scheduled)
        self.num_drafts = counts
        self.proposed = [0 if item.forced else k for item, k in zip(scheduled, counts, strict=True)]
        passes = drafts.passes if drafts is not None else 0
        self.draft_passes = passes or max(self.proposed, default=0)
