"""How many draft tokens (K) each decoding request gets this step.

A policy sees the whole decoding batch at once because the right K depends on the batch:
speculation that pays at batch 1 wastes compute at batch 64 (docs/ARCHITECTURE.md,
"Speculation in brief"). `observe` feeds it the outcome of every verification so it can
track acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine.config import SpecConfig
from engine.spec.catch_up import CatchUp
from engine.spec.chain_choice import ChainChoice
from engine.spec.cost_model import CostModel
from engine.spec.decision_reuse import DecisionReuse
from engine.spec.tree_choice import TreeChoice
from engine.types.request import Request

# Reasons a request got fewer than K_max drafts (exported as a metric label).
REASON_BATCH = "batch_cost"
REASON_ACCEPTANCE = "low_acceptance"
REASON_BUDGET = "token_budget"
REASON_LENGTH = "max_tokens"
REASON_MEMORY = "kv_memory"

ACCEPTANCE_DECAY = 0.995
"""Per verified chain, the weight left to the depth, tree-root and lookup counts before it."""

PRIOR_DECAY, REQUEST_WEIGHT = 0.999, 32
"""The engine-wide rate every request starts from is a mean over ~1,000 chains, weighing 32
trials in each request's estimate: its own few chains say little of its next ones
(`python -m bench.acceptance_weight`; docs/ADAPTIVE_K.md, "Acceptance estimates")."""

PROBE_STEPS = 8
"""Consecutive steps a probe drafts (K = 1) for its request: its first step pays the draft's
catch-up, so one step alone does not measure what drafting costs in steady state."""


@dataclass
class DraftLengths:
    ks: list[int]
    reasons: list[str | None] = field(default_factory=list)
    """Per request: why K < K_max (None when it is not)."""
    branches: int = 1
    """Draft-tree candidates for the next token of every drafting request (1 = chains)."""


class DraftLengthPolicy(Protocol):
    """Rules: `choose` returns one K in [0, max_draft_tokens] per request, in order; K = 0 means
    a plain decode with no draft work for that request. It must not mutate the requests.
    `num_other_tokens` is how many non-decode (prefill) tokens the step will also carry."""

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


class AdaptiveDraftLength(ChainChoice, TreeChoice, DecisionReuse):
    """Maximise expected accepted tokens per second for the whole batch.

    With per-token acceptance a_i, the d-th draft of request i adds a_i^d expected tokens
    (it counts only if drafts 1..d-1 were accepted). Every increment (i, d) is ranked by that
    gain; the policy takes the prefix of the ranking that maximises
        (B + sum of gains) / (T_target(n_other + B + drafts) + T_draft(passes, drafts) + T_step(B))
    using the measured cost model, which charges a pass for its tokens and for the context its
    queries attend to (`PassShape`), and a step of B requests what such steps were measured to
    cost outside the passes (T_step: sampling, bookkeeping, and in a server streaming the
    outputs; paid once a step, so more tokens a step amortize it). An empty prefix is plain
    decoding.

    Giving requests different K has costs the model leaves out: every distinct query count is
    one more attention call per layer, and the deepest draft sets the number of draft passes
    for all. So the best single K for the whole batch is used unless the per-request choice is
    predicted to beat it by more than `uniform_margin` (a request whose drafts keep failing
    still drops to K = 0 then: that difference is large).

    The d-th draft's gain is a_i^d only as a first guess: drafts are not kept independently
    (the positions after a hard token are hard too), and a request is drafted deep when its
    estimate is high, partly by luck. So every verified chain also compares, per depth d,
    how many d-th drafts were kept with how many a_i^d predicted (decayed, engine-wide), and
    the gains are a_i^d times that ratio (`depth_factors`). On the default pair at
    concurrency 1 the second draft was kept 37% of the times the first was against the ~52%
    predicted, and steps of K = 2 made fewer tokens per second than plain decodes.

    Drafting again after plain decodes first feeds the draft every token it skipped: that
    catch-up is charged as draft tokens, spread over the drafting steps expected to follow,
    as measured (engine/spec/catch_up.py; at concurrency 16 the draft's catch-ups when the
    batch thinned out were most of its time, and at concurrency 1 a fixed spread of 32 steps
    made the policy switch K every few steps at a loss).

    When speculation has been off for `probe_interval` steps, one request drafts K = 1 for
    `PROBE_STEPS` steps: otherwise a pessimistic cost estimate or acceptance prior could never be
    corrected, since only steps that draft measure the draft's cost and acceptance. A probe is
    not free (the draft first catches up on every token it skipped), so it takes the request
    with the least to catch up (a probe of every request in a full batch made the draft catch
    up on all of them), and while probes keep confirming K = 0 the interval doubles, up to
    `max_probe_interval`; the policy choosing drafts on its own resets it.

    A seeded request's tokens are fixed by (seed, position), not by K (engine/sample/sampler.py).
    """

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
    ) -> None:
        self.max_draft_tokens = max_draft_tokens
        DecisionReuse.__init__(self, reuse_steps)
        self.max_branches = max_branches
        self.uniform_margin = uniform_margin
        self.cost = cost
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self._probe_every = probe_interval
        self._steps_without_drafts = 0
        self._probing = ("", 0)  # the request a probe drafts for, and its steps left
        self.prior_weight = prior_weight
        self.request_weight = request_weight
        self._accepted = prior * prior_weight  # decayed engine-wide counts
        self._trials = prior_weight
        self._root_hits: dict[int, float] = {}  # TreeChoice's counts
        self._root_trials: dict[int, float] = {}
        # Per depth d: drafts kept, and kept as the a^d model predicted (decayed).
        # Plain floats, not arrays: observe() runs once per drafting request each step, and
        # numpy's per-call cost on arrays this small was most of the policy's time at large
        # batches (`python -m bench.policy_cost`, 64 requests: 436-469 us a step with arrays,
        # 169-176 with floats, on the 2-core AMD EPYC, 2026-11-27; a GPU step of 64 requests
        # takes 1-2 ms).
        self._depth_kept = [0.0] * max_draft_tokens
        self._depth_predicted = [0.0] * max_draft_tokens
        self.catch_up = CatchUp()
        self._depth_cache: tuple[list[float], tuple] | None = None
        """`depth_factors()` as floats and rounded for `_inputs_key`, until the next observe()."""
        self._lookup_counts = [prior * prior_weight, float(prior_weight)]  # kept, trials

    @property
    def global_acceptance(self) -> float:
        return self._accepted / self._trials

    def acceptance(self, req: Request) -> float:
        """Per-token acceptance: the engine-wide rate (a prior of `request_weight` trials)
        updated by the request's verified drafts (trials: accepted + the ending rejections)."""
        return self._estimate(req.spec.accepted, req.spec.trials)

    def _estimate(self, accepted: float, trials: float) -> float:
        w = self.request_weight
        est = (accepted + w * self.global_acceptance) / (trials + w)
        return float(min(max(est, 0.0), 0.99))

    def depth_factors(self) -> np.ndarray:
        """Per depth: drafts kept over what a^d predicted, 1 as a prior of `prior_weight`."""
        w = self.prior_weight
        return (np.array(self._depth_kept) + w) / (np.array(self._depth_predicted) + w)

    def _depth_factors(self) -> tuple[list[float], tuple]:
        """`depth_factors()` as floats, and rounded to 1/32 (cached: they change only with
        observe())."""
        if self._depth_cache is None:
            factors = self.depth_factors().tolist()
            self._depth_cache = factors, tuple(round(32 * f) for f in factors)
        return self._depth_cache

    def _gains_one(self, a: float) -> list[float]:
        """`gains()` for one request, in plain Python (numpy's per-call cost is most of it
        at concurrency 1, where the policy decides every few steps)."""
        gains, gain = [], 0.99
        for d, factor in enumerate(self._depth_factors()[0], start=1):
            gain = min(a**d * factor, 0.99, gain)
            gains.append(gain)
        return gains

    def gains(self, a: np.ndarray) -> np.ndarray:
        """[requests, K_max]: the chance that each request's d-th draft is kept, a^d times
        the measured depth factor, never rising with depth."""
        raw = a[:, None] ** np.arange(1, self.max_draft_tokens + 1)[None, :]
        return np.minimum.accumulate(np.minimum(raw * self.depth_factors(), 0.99), axis=1)

    def observe(
        self, request: Request, num_drafted: int, num_accepted: int, branches: int = 1
    ) -> None:
        decay = ACCEPTANCE_DECAY
        self._depth_cache = None
        if branches == 1:
            # The request's estimate before this step (its counts already hold it).
            trials = num_accepted + (num_accepted < num_drafted)
            a = self._estimate(request.spec.accepted - num_accepted, request.spec.trials - trials)
            n = min(num_drafted, self.max_draft_tokens)
            kept, predicted = self._depth_kept, self._depth_predicted
            for d in range(self.max_draft_tokens):  # depth d + 1
                kept[d] = kept[d] * decay + (d < num_accepted and d < n)
                predicted[d] = predicted[d] * decay + (a ** (d + 1) if d < n else 0.0)
        if branches > 1:  # the root is a trial of the tree; the path below it, of a chain
            if not self._observe_root(branches, num_accepted > 0, decay) or num_drafted == 1:
                return
            num_drafted, num_accepted = num_drafted - 1, num_accepted - 1
        self._accepted = PRIOR_DECAY * self._accepted + num_accepted
        self._trials = PRIOR_DECAY * self._trials + num_accepted + (num_accepted < num_drafted)

    def lookup_length(self, request: Request, k: int, found: int, batch: int) -> int:
        """Alone in its step, the cost model's best chain of the lookup's drafts at their own
        measured per-token acceptance (decayed engine-wide), as drafts that cost no draft
        pass, whatever K the draft model got; in a batch, the draft model's K (its search
        priced the batch's rows)."""
        if batch > 1:
            return min(k, found)
        kept, trials = self._lookup_counts
        gains = [min((kept / trials) ** d, 0.99) for d in range(1, found + 1)]
        over = (self.cost.step_overhead(1), self.cost.step_overhead(1, drafting=True))
        context = float(request.num_tokens)
        return self.cost.best_chain_length(gains, context, 1, found, 0.0, over, free_drafts=True)

    def observe_lookup(self, num_drafted: int, num_accepted: int) -> None:
        decay, counts = ACCEPTANCE_DECAY, self._lookup_counts
        counts[0] = decay * counts[0] + num_accepted
        counts[1] = decay * counts[1] + num_accepted + (num_accepted < num_drafted)

    def choose(self, requests: list[Request], num_other_tokens: int = 0) -> DraftLengths:
        batch, k_max = len(requests), self.max_draft_tokens
        if batch == 0 or k_max == 0:
            return DraftLengths([0] * batch, [None] * batch)
        decided = self._decided_for(requests, num_other_tokens)
        ks, reasons, branches = decided
        if any(ks):
            self._steps_without_drafts = 0
            self._probe_every = self.probe_interval
            self._probing = ("", 0)
        else:
            ks = self._probe(requests, ks)
        self.catch_up.count(requests, ks, probe=not any(decided[0]) and any(ks))
        return DraftLengths(list(ks), list(reasons), branches)

    def _probe(self, requests: list[Request], ks: list[int]) -> list[int]:
        """`ks` (all 0), or K = 1 for the request a probe drafts for this step."""
        probed, left = self._probing
        ids = [r.request_id for r in requests]
        if left and probed in ids:  # a probe's later steps: the same request
            self._probing = (probed, left - 1)
            return [int(i == probed) for i in ids]
        self._steps_without_drafts += 1
        if self._steps_without_drafts < self._probe_every:
            return ks
        self._steps_without_drafts = 0
        self._probe_every = min(2 * self._probe_every, self.max_probe_interval)
        behind = [r.num_tokens - r.num_draft_computed_tokens for r in requests]
        probed = ids[behind.index(min(behind))]
        self._probing = (probed, PROBE_STEPS - 1)
        return [int(i == probed) for i in ids]

    def _decide(
        self, a: np.ndarray, context: np.ndarray, num_other_tokens: int, catch_up: np.ndarray
    ) -> tuple[list[int], list[str | None], int]:
        """(K per request, why each is below K_max, tree branches): the batch's best rate.
        `catch_up`: per request, the draft tokens a step pays for its lag (`CatchUp.tokens`)."""
        batch, k_max = len(a), self.max_draft_tokens
        if batch == 1 and self.max_branches == 1:  # one request: plain numbers, no arrays
            g1 = self._gains_one(float(a[0]))
            best, c1, lag = self.cost.best_chain_length, float(context[0]), float(catch_up[0])
            over = (self.cost.step_overhead(1), self.cost.step_overhead(1, drafting=True))
            k = best(g1, c1, num_other_tokens + 1, k_max, lag, over)
            solo = best(g1, c1, 1, k_max, lag, over) if num_other_tokens else k  # as _best_alone
            return [k], [None if k >= k_max else REASON_BATCH if k < solo else REASON_ACCEPTANCE], 1
        gains = self.gains(a)  # [batch, k_max]: the d-th draft's expected tokens
        ks, rate = self._best_prefix(gains, context, num_other_tokens, catch_up)
        uniform_ks, uniform_rate = self._best_uniform(gains, context, num_other_tokens, catch_up)
        if rate < (1 + self.uniform_margin) * uniform_rate:
            ks = uniform_ks
        solo = self._best_alone(gains, context, catch_up)
        reasons: list[str | None] = []
        for k, k_solo in zip(ks, solo, strict=True):
            if k >= k_max:
                reasons.append(None)
            else:  # would it get more alone? then the batch is what cut it
                reasons.append(REASON_BATCH if k < k_solo else REASON_ACCEPTANCE)
        branches = 1
        if self.max_branches > 1:
            n, k_tree, tree_rate = self._best_tree(a, context, num_other_tokens, catch_up)
            if n > 1 and tree_rate > (1 + self.uniform_margin) * max(rate, uniform_rate):
                ks, branches = np.full(batch, k_tree, dtype=np.int64), n
                reasons = [None] * batch
        return [int(k) for k in ks], reasons, branches


class NoSpeculation(FixedDraftLength):
    def __init__(self) -> None:
        super().__init__(0)


def policy_for(spec: SpecConfig, cost_model: CostModel | None) -> DraftLengthPolicy:
    """The policy `spec` asks for: none when speculation is off, adaptive on `cost_model`
    when there is one, else a fixed K_max."""
    if not spec.enabled:
        return NoSpeculation()
    if cost_model is not None:
        return AdaptiveDraftLength(
            spec.max_draft_tokens, cost_model, max_branches=spec.max_branches
        )
    return FixedDraftLength(spec.max_draft_tokens, spec.draft_branches or 1)
