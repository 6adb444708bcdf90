"""What the adaptive policy has learned of acceptance (decayed counts): the engine-wide rate,
each request's estimate, depth and tree-root corrections, prompt lookups by match length."""

from __future__ import annotations

from weakref import WeakKeyDictionary

import numpy as np

from engine.types.request import Request

ACCEPTANCE_DECAY = 0.995
"""Per verified chain, the weight left to the depth, tree-root and lookup counts before it."""

PRIOR_DECAY, REQUEST_WEIGHT = 0.999, 32
"""The engine-wide prior's decay and its weight in trials in a request's estimate."""

LOOKUP_REQUEST_DECAY, LOOKUP_REQUEST_WEIGHT = 0.95, 2.0
"""Per lookup, the weight left to a request's earlier ones; and the drafts its expected kept
count starts at (the engine-wide estimate's weight in the request's factor)."""


def match_bucket(match: int) -> int:
    """The match lengths that share a lookup rate: each up to 4, then 5-7, 8-15 and 16 on."""
    return match if match <= 4 else 5 if match < 8 else 8 if match < 16 else 16


class AcceptanceEstimates:
    """Per-token acceptance a, engine-wide and per request; a d-th draft's gain is a^d times
    a measured depth factor (drafts are not kept independently)."""

    def __init__(
        self,
        max_draft_tokens: int,
        prior: float = 0.6,
        prior_weight: float = 8,
        request_weight: float = REQUEST_WEIGHT,
    ) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.prior_weight = prior_weight
        self.request_weight = request_weight
        self._accepted = prior * prior_weight  # decayed engine-wide counts
        self._trials = prior_weight
        self.root_hits: dict[int, float] = {}  # per tree width: steps a root candidate was kept
        self.root_trials: dict[int, float] = {}
        # Per depth: drafts kept, and as a^d predicted (floats: numpy is slower at this size).
        self._depth_kept = [0.0] * max_draft_tokens
        self._depth_predicted = [0.0] * max_draft_tokens
        self._depth_cache: tuple[list[float], tuple] | None = None
        self._lookup = [prior * prior_weight, float(prior_weight)]  # kept, trials: all lookups
        self._lookup_by_match: dict[int, list[float]] = {}  # the same per match_bucket
        # Per request: its lookups' kept drafts and what the by-match estimate expected.
        self._lookup_by_request: WeakKeyDictionary[Request, list[float]] = WeakKeyDictionary()

    @property
    def global_acceptance(self) -> float:
        return self._accepted / self._trials

    def lookup_acceptance(self, match: int = 0) -> float:
        """Per-token acceptance of lookups that matched `match` tokens (`match_bucket`'s range),
        all lookups' rate as a prior of `prior_weight` trials (match 0: all lookups' rate)."""
        pooled = self._lookup[0] / self._lookup[1]
        counts = self._lookup_by_match.get(match_bucket(match))
        if counts is None:
            return pooled
        w = self.prior_weight
        return min((counts[0] + w * pooled) / (counts[1] + w), 0.99)

    def lookup_gains(self, request: Request, match: int, found: int) -> list[float]:
        """Per depth d of `found` looked-up drafts, the chance the d-th is kept: a^d at the
        match length's rate, times `lookup_factor`: a sampled request keeps a looked-up x with
        probability p(x), so how peaked the target is on its own text decides."""
        a, factor = self.lookup_acceptance(match), self.lookup_factor(request)
        return [min(a**d * factor, 0.99) for d in range(1, found + 1)]

    def lookup_factor(self, request: Request) -> float:
        """A sampled request's lookups kept over expected (LOOKUP_REQUEST_WEIGHT as a prior);
        1 for a greedy one, whose earlier lookups said little of its later ones."""
        kept, expected = self._lookup_by_request.get(request, (0.0, 0.0))
        return (kept + LOOKUP_REQUEST_WEIGHT) / (expected + LOOKUP_REQUEST_WEIGHT)

    def acceptance(self, req: Request) -> float:
        """The engine-wide rate (a prior of `request_weight` trials) updated by the request's."""
        return self._estimate(req.spec.accepted, req.spec.trials)

    def _estimate(self, accepted: float, trials: float) -> float:
        w = self.request_weight
        est = (accepted + w * self.global_acceptance) / (trials + w)
        return float(min(max(est, 0.0), 0.99))

    def depth_factors(self) -> np.ndarray:
        """Per depth: drafts kept over what a^d predicted, 1 as a prior of `prior_weight`."""
        w = self.prior_weight
        return (np.array(self._depth_kept) + w) / (np.array(self._depth_predicted) + w)

    def depth_factors_keyed(self) -> tuple[list[float], tuple]:
        """`depth_factors()` as floats, and rounded to 1/32 for a decision's key (cached)."""
        if self._depth_cache is None:
            factors = self.depth_factors().tolist()
            self._depth_cache = factors, tuple(round(32 * f) for f in factors)
        return self._depth_cache

    def gains_one(self, a: float) -> list[float]:
        gains, gain = [], 0.99
        for d, factor in enumerate(self.depth_factors_keyed()[0], start=1):
            gain = min(a**d * factor, 0.99, gain)
            gains.append(gain)
        return gains

    def gains(self, a: np.ndarray) -> np.ndarray:
        """[requests, K_max]: the chance each request's d-th draft is kept, non-increasing."""
        raw = a[:, None] ** np.arange(1, self.max_draft_tokens + 1)[None, :]
        return np.minimum.accumulate(np.minimum(raw * self.depth_factors(), 0.99), axis=1)

    def root_acceptance(self, a: np.ndarray, n: int) -> np.ndarray:
        """The chance one of n root candidates is kept: 1 - (1 - a)^n scaled by `root_factor`
        (candidates of one draft tend to miss together)."""
        return np.clip((1 - (1 - a) ** n) * self.root_factor(n), 0.0, 0.99)

    def root_factor(self, n: int) -> float:
        """Measured root acceptance of n-branch trees over the independence formula's."""
        independent = 1 - (1 - self.global_acceptance) ** n
        w = self.prior_weight
        measured = (self.root_hits.get(n, 0.0) + w * independent) / (
            self.root_trials.get(n, 0.0) + w
        )
        return measured / max(independent, 1e-9)

    def observe(
        self, request: Request, num_drafted: int, num_accepted: int, branches: int = 1
    ) -> None:
        """A verified step of `request`, whose counts already hold it (`branches` 1: a chain)."""
        decay = ACCEPTANCE_DECAY
        self._depth_cache = None
        if branches == 1:
            trials = num_accepted + (num_accepted < num_drafted)
            a = self._estimate(request.spec.accepted - num_accepted, request.spec.trials - trials)
            n = min(num_drafted, self.max_draft_tokens)
            kept, predicted = self._depth_kept, self._depth_predicted
            for d in range(self.max_draft_tokens):  # depth d + 1
                kept[d] = kept[d] * decay + (d < num_accepted and d < n)
                predicted[d] = predicted[d] * decay + (a ** (d + 1) if d < n else 0.0)
        else:  # the root is a trial of the tree; the path below it, of a chain
            hit = num_accepted > 0
            self.root_hits[branches] = decay * self.root_hits.get(branches, 0.0) + hit
            self.root_trials[branches] = decay * self.root_trials.get(branches, 0.0) + 1
            if not hit or num_drafted == 1:
                return
            num_drafted, num_accepted = num_drafted - 1, num_accepted - 1
        self._accepted = PRIOR_DECAY * self._accepted + num_accepted
        self._trials = PRIOR_DECAY * self._trials + num_accepted + (num_accepted < num_drafted)

    def observe_lookup(
        self, match: int, num_drafted: int, num_accepted: int, request: Request | None = None
    ) -> None:
        if request is not None and not request.params.greedy:
            a = self.lookup_acceptance(match)
            expected = sum(min(a**d, 0.99) for d in range(1, num_drafted + 1))
            counts = self._lookup_by_request.setdefault(request, [0.0, 0.0])
            counts[0] = LOOKUP_REQUEST_DECAY * counts[0] + num_accepted
            counts[1] = LOOKUP_REQUEST_DECAY * counts[1] + expected
        trials = num_accepted + (num_accepted < num_drafted)
        by_match = self._lookup_by_match.setdefault(match_bucket(match), [0.0, 0.0])
        for counts in (self._lookup, by_match):
            counts[0] = ACCEPTANCE_DECAY * counts[0] + num_accepted
            counts[1] = ACCEPTANCE_DECAY * counts[1] + trials
