"""The adaptive draft-length policy: K per request from a cost model and learned acceptance."""

from __future__ import annotations

import numpy as np

from engine.spec.cost.model import CostModel
from engine.spec.policy.acceptance import REQUEST_WEIGHT, AcceptanceEstimates
from engine.spec.policy.base import REASON_ACCEPTANCE, REASON_BATCH, DraftLengths
from engine.spec.policy.catch_up import CatchUp
from engine.spec.policy.reuse import PLAIN_REUSE_STEPS, DecisionReuse, decision_key
from engine.spec.policy.search import BatchSearch
from engine.types.request import Request

PROBE_STEPS = 8
"""Consecutive steps a probe drafts K = 1 (its first pays the catch-up, so one is not enough)."""


class AdaptiveDraftLength:
    """Maximise the batch's expected accepted tokens per second on the measured cost model
    (docs/ADAPTIVE_K.md, "The choice"): one K unless per-request K beats it by `uniform_margin`,
    no request's expected rate below 1 - `max_request_slowdown` of its rate without drafts;
    probes (K = 1) after `probe_interval` steps without drafts."""

    def __init__(
        self,
        max_draft_tokens: int,
        cost: CostModel,
        prior: float = 0.6,
        prior_weight: float = 8,
        request_weight: float = REQUEST_WEIGHT,
        probe_interval: int = 32,
        uniform_margin: float = 0.03,
        max_probe_interval: int = 1024,
        max_branches: int = 1,
        reuse_steps: int = 4,
        plain_reuse_steps: int = PLAIN_REUSE_STEPS,
        max_request_slowdown: float | None = None,
    ) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.max_branches = max_branches
        self.uniform_margin = uniform_margin
        self.cost = cost
        self.estimates = AcceptanceEstimates(max_draft_tokens, prior, prior_weight, request_weight)
        self.search = BatchSearch(cost, self.estimates, max_request_slowdown)
        self.catch_up = CatchUp()
        self.reuse = DecisionReuse(reuse_steps, plain_reuse_steps)
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self._probe_every = probe_interval
        self._steps_without_drafts = 0
        self._probing = ("", 0)  # the request a probe drafts for, and its steps left

    def observe(
        self, request: Request, num_drafted: int, num_accepted: int, branches: int = 1
    ) -> None:
        self.estimates.observe(request, num_drafted, num_accepted, branches)
        self.reuse.expire_plain()

    def observe_lookup(
        self, match: int, num_drafted: int, num_accepted: int, request: Request | None = None
    ) -> None:
        self.estimates.observe_lookup(match, num_drafted, num_accepted, request)
        self.reuse.expire_plain()

    def lookup_length(self, request: Request, k: int, match: int, found: int, batch: int) -> int:
        """Alone: the best chain at `match`'s acceptance (and the request's own record) unless
        the draft's K wins; in a batch: that chain cut to the batch's K."""
        if batch > 1 and min(k, found) == 0:
            return 0
        gains = self.estimates.lookup_gains(request, match, found)
        over = (self.cost.step_overhead(1), self.cost.step_overhead(1, drafting=True))
        context = float(request.num_tokens)
        rates = self.cost.chain_rates(gains, context, 1, found, 0.0, over, free_drafts=True)
        n = _best(rates)
        if batch > 1:  # the batch's K, but no deeper than would pay alone at this match's rate
            return min(k, n)
        if k > 0 and n > 0:  # the draft model's choice, at its own acceptance and catch-up
            g = self.estimates.gains_one(self.estimates.acceptance(request))
            lag = self.catch_up.tokens(request)
            if self.cost.chain_rates(g, context, 1, k, lag, over)[k] >= rates[n]:
                return 0
        return n

    def choose(self, requests: list[Request], num_other_tokens: int = 0) -> DraftLengths:
        batch, k_max = len(requests), self.max_draft_tokens
        if batch == 0 or k_max == 0:
            return DraftLengths([0] * batch, [None] * batch)
        decided = self.reuse.recent(requests, num_other_tokens)
        if decided is None:
            decided = self.decision_for(requests, num_other_tokens)
        if any(decided.ks):
            self._steps_without_drafts = 0
            self._probe_every = self.probe_interval
            self._probing = ("", 0)
            self.catch_up.count(requests, decided.ks, probe=False)
            return decided
        ks = self._probe(requests, decided.ks)
        if ks is decided.ks:  # no probe
            if self.catch_up.open_runs:
                self.catch_up.count(requests, ks, probe=False)
            return decided
        self.catch_up.count(requests, ks, probe=True)
        return DraftLengths(ks, decided.reasons, decided.branches)

    def decision_for(self, requests: list[Request], num_other_tokens: int) -> DraftLengths:
        """An earlier decision whose inputs round alike, or a new search."""
        a = [self.estimates.acceptance(r) for r in requests]
        context = [r.num_tokens for r in requests]
        catch_up = [self.catch_up.tokens(r) for r in requests]
        key = None
        if len(requests) > 1 or self.max_branches > 1:  # one chain's search costs less than a key
            key = decision_key(
                self.cost, self.estimates, self.max_branches, a, context, num_other_tokens, catch_up
            )
            decided = self.reuse.keyed(key)
            if decided is not None:
                self.reuse.remember(requests, None, decided)
                return decided
        arrays = np.array(a), np.array(context, dtype=np.float64)
        decided = self.decide(*arrays, num_other_tokens, np.array(catch_up))
        self.reuse.remember(requests, key, decided)
        return decided

    def _probe(self, requests: list[Request], ks: list[int]) -> list[int]:
        """`ks` (all 0), or K = 1 for the request a probe drafts for this step."""
        probed, left = self._probing
        if left:
            ids = [r.request_id for r in requests]
            if probed in ids:  # a probe's later steps: the same request
                self._probing = (probed, left - 1)
                return [int(i == probed) for i in ids]
        self._steps_without_drafts += 1
        if self._steps_without_drafts < self._probe_every:
            return ks
        ids = [r.request_id for r in requests]
        self._steps_without_drafts = 0
        self._probe_every = min(2 * self._probe_every, self.max_probe_interval)
        behind = [r.num_tokens - r.num_draft_computed_tokens for r in requests]
        probed = ids[behind.index(min(behind))]
        self._probing = (probed, PROBE_STEPS - 1)
        return [int(i == probed) for i in ids]

    def decide(
        self, a: np.ndarray, context: np.ndarray, num_other_tokens: int, catch_up: np.ndarray
    ) -> DraftLengths:
        """K per request, why each is below K_max and tree branches: the batch's best rate."""
        batch, k_max, search = len(a), self.max_draft_tokens, self.search
        if batch == 1 and self.max_branches == 1:  # one request: plain numbers, no arrays
            g1 = self.estimates.gains_one(float(a[0]))
            rates, c1, lag = self.cost.chain_rates, float(context[0]), float(catch_up[0])
            over = (self.cost.step_overhead(1), self.cost.step_overhead(1, drafting=True))
            k = _best(rates(g1, c1, num_other_tokens + 1, k_max, lag, over))
            solo = _best(rates(g1, c1, 1, k_max, lag, over)) if num_other_tokens else k
            reason = None if k >= k_max else REASON_BATCH if k < solo else REASON_ACCEPTANCE
            return DraftLengths([k], [reason])
        gains = self.estimates.gains(a)  # [batch, k_max]: the d-th draft's expected tokens
        ks, rate = search.best_prefix(gains, context, num_other_tokens, catch_up)
        uniform_ks, uniform_rate = search.best_uniform(gains, context, num_other_tokens, catch_up)
        if rate < (1 + self.uniform_margin) * uniform_rate:
            ks = uniform_ks
        reasons: list[str | None] = [None] * batch
        if (ks < k_max).any():  # would a request get more alone? then the batch cut it
            solo = search.best_alone(gains, context, catch_up)
            for j, (k, k_solo) in enumerate(zip(ks, solo, strict=True)):
                if k < k_max:
                    reasons[j] = REASON_BATCH if k < k_solo else REASON_ACCEPTANCE
        branches = 1
        if self.max_branches > 1:
            n, k_tree, tree_rate = search.best_tree(
                a, context, num_other_tokens, catch_up, self.max_branches
            )
            if n > 1 and tree_rate > (1 + self.uniform_margin) * max(rate, uniform_rate):
                ks, branches = np.full(batch, k_tree, dtype=np.int64), n
                reasons = [None] * batch
        return DraftLengths([int(k) for k in ks], reasons, branches)


def _best(rates: list[float]) -> int:
    return rates.index(max(rates))
