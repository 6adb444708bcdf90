"""How many drafts each decoding request gets: fixed policies (`base`) and the adaptive one."""

from __future__ import annotations

from engine.config import SpecConfig
from engine.spec.cost.model import CostModel
from engine.spec.policy.adaptive import AdaptiveDraftLength
from engine.spec.policy.base import (
    REASON_ACCEPTANCE,
    REASON_BATCH,
    REASON_BUDGET,
    REASON_LENGTH,
    REASON_MEMORY,
    REASON_REQUEST,
    DraftLengthPolicy,
    DraftLengths,
    FixedDraftLength,
    NoSpeculation,
)


def policy_for(spec: SpecConfig, cost_model: CostModel | None) -> DraftLengthPolicy:
    """The policy `spec` asks for: none when speculation is off, adaptive on `cost_model`
    when there is one, else a fixed K_max."""
    if not spec.enabled:
        return NoSpeculation()
    if cost_model is not None:
        return AdaptiveDraftLength(
            spec.max_draft_tokens,
            cost_model,
            max_branches=spec.max_branches,
            max_request_slowdown=spec.max_request_slowdown,
        )
    return FixedDraftLength(spec.max_draft_tokens, spec.draft_branches or 1)


__all__ = [
    "REASON_ACCEPTANCE",
    "REASON_BATCH",
    "REASON_BUDGET",
    "REASON_LENGTH",
    "REASON_MEMORY",
    "REASON_REQUEST",
    "AdaptiveDraftLength",
    "DraftLengthPolicy",
    "DraftLengths",
    "FixedDraftLength",
    "NoSpeculation",
    "policy_for",
]
