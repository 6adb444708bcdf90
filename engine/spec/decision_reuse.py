"""When the adaptive draft-length policy (engine/spec/draft_length.py) may reuse a decision
instead of searching again: the search is a few vectorised array passes, about 0.5 ms a step
for 16 requests on the 2-core AMD EPYC, where a GPU step of the same batch can take 1-2 ms.

Two rules, in this order:
- a decision holds for `reuse_steps` steps of the same requests with no prefill tokens among
  them: their contexts move by that many tokens, where the key below rounds them to 32 (at
  c=16 on the default pair 89% of the keys missed, contexts and catch-ups crossing their
  rounding, so the key alone saved little there);
- otherwise a step whose inputs round alike to an earlier step's (`_inputs_key`) takes that
  step's decision.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.spec.catch_up import CatchUp
from engine.spec.cost_model import CostModel
from engine.types.request import Request

Decision = tuple[list[int], list[str | None], int]
"""(K per request, why each is below K_max, tree branches)."""


class DecisionReuse:
    """Mixed into AdaptiveDraftLength, whose estimates (`acceptance`, `_depth_factors`,
    `_root_factor`), cost model, catch-up and search (`_decide`) it reads."""

    cost: CostModel
    catch_up: CatchUp
    max_branches: int

    def __init__(self, reuse_steps: int) -> None:
        self.reuse_steps = reuse_steps
        self._reuse: tuple[list[str], int, Any] = ([], 0, None)
        """The last decision's requests, the steps it may still be reused for, and it."""
        self._decided: dict[tuple, Decision] = {}
        """Decisions by their rounded inputs (`_inputs_key`)."""

    def _decided_for(self, requests: list[Request], num_other_tokens: int) -> Decision:
        ids = [r.request_id for r in requests]
        last_ids, left, decided = self._reuse
        if left and not num_other_tokens and ids == last_ids:
            self._reuse = (ids, left - 1, decided)
            return decided
        decided = self._decision(requests, num_other_tokens)
        self._reuse = (ids, self.reuse_steps - 1, decided)
        return decided

    def _decision(self, requests: list[Request], num_other_tokens: int) -> Decision:
        # Plain Python until a decision is missing (arrays for every key: 85 us a step, this 30)
        a = [self.acceptance(r) for r in requests]
        context = [r.num_tokens for r in requests]
        catch_up = [self.catch_up.tokens(r) for r in requests]
        key = self._inputs_key(a, context, num_other_tokens, catch_up)
        decided = self._decided.get(key)
        if decided is None:
            arrays = np.array(a), np.array(context, dtype=np.float64)
            decided = self._decide(*arrays, num_other_tokens, np.array(catch_up))
            if len(self._decided) >= 4096:
                self._decided.clear()
            self._decided[key] = decided
        return decided

    def _inputs_key(
        self, a: list[float], context: list[int], num_other: int, catch_up: list[float]
    ) -> tuple:
        """What a decision depends on, rounded (acceptance, depth and tree roots' factors to 1/32,
        online cost factors to 4%, the step's overhead to 5% of a one-token pass, contexts and
        other tokens to 32, catch-ups to a token): a step whose inputs round alike reuses the
        decision; inputs that close predict rates within a few percent."""
        cost = self.cost
        widths = sorted(cost.tree_scales)
        scales = [cost.target_scale, *cost.small_scales, *cost.size_scales]
        scales += [s for n in widths for s in cost.tree_scales[n]]
        trees: tuple = ()
        if self.max_branches > 1:
            trees = tuple(round(32 * self._root_factor(n)) for n in range(2, self.max_branches + 1))
        return (
            num_other // 32,
            tuple(int(x * 32) for x in a),
            self._depth_factors()[1],
            tuple(n // 32 for n in context),
            tuple(widths),
            tuple(round(25 * s.value) for s in scales),
            tuple(round(25 * s) for s in cost.draft.scales.tolist()),
            tuple(
                round(20 * cost.step_overhead(len(a), kind) / max(cost.target_seconds[0], 1e-9))
                for kind in (False, True)
            ),
            trees,
            tuple(round(c) for c in catch_up),
        )
