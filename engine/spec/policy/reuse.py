"""When the adaptive policy may reuse a decision: for `reuse_steps` (or PLAIN_REUSE_STEPS) steps
of the same requests without prefill tokens, else for a step whose inputs round alike."""

from __future__ import annotations

from engine.spec.cost.model import CostModel
from engine.spec.policy.acceptance import AcceptanceEstimates
from engine.spec.policy.base import DraftLengths
from engine.types.request import Request

MAX_CACHED = 4096  # decisions kept by key; the cache starts afresh when full
PLAIN_REUSE_STEPS = 32
"""Steps a decision of K = 0 for all serves, unless drafts are verified (a probe's) first."""


class DecisionReuse:
    """The last decision with the steps it may still serve, and earlier decisions by key."""

    def __init__(self, reuse_steps: int, plain_reuse_steps: int = PLAIN_REUSE_STEPS) -> None:
        self.reuse_steps = reuse_steps
        self.plain_reuse_steps = plain_reuse_steps
        self._last: tuple[list[Request], int, DraftLengths | None] = ([], 0, None)
        self._by_key: dict[tuple, DraftLengths] = {}

    def recent(self, requests: list[Request], num_other_tokens: int) -> DraftLengths | None:
        """The last decision, if it may serve this step (and counts the step against it)."""
        last, left, decided = self._last
        if left and not num_other_tokens and requests == last and decided is not None:
            self._last = (last, left - 1, decided)
            return decided
        return None

    def expire_plain(self) -> None:
        last, left, decided = self._last
        if left and decided is not None and not any(decided.ks):
            self._last = (last, 0, decided)

    def keyed(self, key: tuple) -> DraftLengths | None:
        return self._by_key.get(key)

    def remember(self, requests: list[Request], key: tuple | None, decided: DraftLengths) -> None:
        steps = self.reuse_steps if any(decided.ks) else self.plain_reuse_steps
        self._last = (requests, steps - 1, decided)
        if key is not None:
            if len(self._by_key) >= MAX_CACHED:
                self._by_key.clear()
            self._by_key[key] = decided


def decision_key(
    cost: CostModel,
    estimates: AcceptanceEstimates,
    max_branches: int,
    a: list[float],
    context: list[int],
    num_other: int,
    catch_up: list[float],
) -> tuple:
    """What a decision depends on, rounded so inputs that round alike predict nearly alike."""
    widths = sorted(cost.tree_scales)
    scales = [cost.target_scale, *cost.small_scales, *cost.size_scales]
    scales += [s for n in widths for s in cost.tree_scales[n]]
    trees: tuple = ()
    if max_branches > 1:
        trees = tuple(round(32 * estimates.root_factor(n)) for n in range(2, max_branches + 1))
    one_token = max(cost.target_seconds[0], 1e-9)
    return (
        num_other // 32,
        tuple(int(x * 32) for x in a),
        estimates.depth_factors_keyed()[1],
        tuple(n // 32 for n in context),
        tuple(widths),
        tuple(round(25 * s.value) for s in scales),
        tuple(round(25 * s) for s in cost.draft.scales),
        tuple(round(20 * cost.step_overhead(len(a), kind) / one_token) for kind in (False, True)),
        trees,
        tuple(round(c) for c in catch_up),
    )
