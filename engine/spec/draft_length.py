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
from engine.core.request import Request
from engine.spec.cost_model import CostModel

# Reasons a request got fewer than K_max drafts (exported as a metric label).
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


class AdaptiveDraftLength:
    """Maximise expected accepted tokens per second for the whole batch.

    With per-token acceptance a_i, the d-th draft of request i adds a_i^d expected tokens
    (it counts only if drafts 1..d-1 were accepted). Every increment (i, d) is ranked by that
    gain; the policy takes the prefix of the ranking that maximises
        (B + sum of gains) / (T_target(n_other + B + drafts) + T_draft(passes, drafts))
    using the measured cost model, which charges a pass for its tokens and for the context its
    queries attend to (`PassShape`). An empty prefix is plain decoding.

    Giving requests different K has costs the model leaves out: every distinct query count is
    one more attention call per layer, and the deepest draft sets the number of draft passes
    for all. So the best single K for the whole batch is used unless the per-request choice is
    predicted to beat it by more than `uniform_margin` (a request whose drafts keep failing
    still drops to K = 0 then: that difference is large).

    When speculation has been off for `probe_interval` steps, one step drafts K = 1 for every
    request: otherwise a pessimistic cost estimate or acceptance prior could never be corrected,
    since only steps that draft measure the draft's cost and acceptance. A probe is not free
    (the draft first catches up on every token it skipped), so while probes keep confirming
    K = 0 the interval doubles, up to `max_probe_interval`; the policy choosing drafts on its
    own resets it.

    A seeded request needs nothing special: its tokens are fixed by (seed, position), not by
    K (engine/sample/sampler.py), so any K gives it the same text.
    """

    def __init__(
        self,
        max_draft_tokens: int,
        cost: CostModel,
        prior: float = 0.6,
        prior_weight: float = 8,
        probe_interval: int = 32,
        uniform_margin: float = 0.03,
        max_probe_interval: int = 1024,
        max_branches: int = 1,
    ) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.max_branches = max_branches
        self.uniform_margin = uniform_margin
        self.cost = cost
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self._probe_every = probe_interval
        self._steps_without_drafts = 0
        self.prior_weight = prior_weight
        self._accepted = prior * prior_weight  # decayed engine-wide counts
        self._trials = prior_weight
        # Tree steps by branch count: how often some root candidate was kept (decayed).
        self._root_hits: dict[int, float] = {}
        self._root_trials: dict[int, float] = {}
        self._decided: dict[tuple, tuple[list[int], list[str | None], int]] = {}
        """Decisions by their rounded inputs (`_inputs_key`)."""

    @property
    def global_acceptance(self) -> float:
        return self._accepted / self._trials

    def acceptance(self, req: Request) -> float:
        """Per-token acceptance: the engine-wide rate as a prior, updated by the request's own
        verified drafts (a rejection ends a trial run, so trials = accepted + rejections)."""
        w = self.prior_weight
        est = (req.spec.accepted + w * self.global_acceptance) / (req.spec.trials + w)
        return float(min(max(est, 0.0), 0.99))

    def observe(
        self, request: Request, num_drafted: int, num_accepted: int, branches: int = 1
    ) -> None:
        decay = 0.995
        if branches > 1:  # the root is a trial of the tree; the path below it, of a chain
            hit = num_accepted > 0
            self._root_hits[branches] = decay * self._root_hits.get(branches, 0.0) + hit
            self._root_trials[branches] = decay * self._root_trials.get(branches, 0.0) + 1
            if not hit:
                return
            num_drafted, num_accepted = num_drafted - 1, num_accepted - 1
            if num_drafted == 0:
                return
        self._accepted = decay * self._accepted + num_accepted
        self._trials = decay * self._trials + num_accepted + (num_accepted < num_drafted)

    def root_acceptance(self, a: np.ndarray, n: int) -> np.ndarray:
        """The chance that one of n root candidates is kept, per request of acceptance a:
        1 - (1 - a)^n as if the candidates were independent draws, scaled by how the tree
        steps of n branches measured so far compare with that (candidates of one draft are
        not independent: they tend to miss together), the formula weighing as a prior."""
        return np.clip((1 - (1 - a) ** n) * self._root_factor(n), 0.0, 0.99)

    def _root_factor(self, n: int) -> float:
        """Measured root acceptance of n-branch trees over the independence formula's, the
        formula weighing as a prior (`root_acceptance`)."""
        independent = 1 - (1 - self.global_acceptance) ** n
        w = self.prior_weight
        measured = (self._root_hits.get(n, 0.0) + w * independent) / (
            self._root_trials.get(n, 0.0) + w
        )
        return measured / max(independent, 1e-9)

    def choose(self, requests: list[Request], num_other_tokens: int = 0) -> DraftLengths:
        batch, k_max = len(requests), self.max_draft_tokens
        if batch == 0 or k_max == 0:
            return DraftLengths([0] * batch, [None] * batch)
        a = np.array([self.acceptance(r) for r in requests])
        context = np.array([r.num_tokens for r in requests], dtype=np.float64)
        key = self._inputs_key(a, context, num_other_tokens)
        decided = self._decided.get(key)
        if decided is None:
            decided = self._decide(a, context, num_other_tokens)
            if len(self._decided) >= 4096:
                self._decided.clear()
            self._decided[key] = decided
        ks, reasons, branches = decided
        if any(ks):
            self._steps_without_drafts = 0
            self._probe_every = self.probe_interval
        else:
            self._steps_without_drafts += 1
            if self._steps_without_drafts >= self._probe_every:
                self._steps_without_drafts = 0
                self._probe_every = min(2 * self._probe_every, self.max_probe_interval)
                ks = [1] * batch
        return DraftLengths(list(ks), list(reasons), branches)

    def _inputs_key(self, a: np.ndarray, context: np.ndarray, num_other: int) -> tuple:
        """What a decision depends on, rounded (acceptance and tree roots' factors to 1/32,
        online cost factors to 4%, contexts and other tokens to 32): a step whose inputs round
        alike reuses the decision; inputs that close predict rates within a few percent."""
        cost = self.cost
        widths = sorted(cost.tree_scales)
        scales = [cost.target_scale, cost.draft_scale]
        scales += [s for n in widths for s in cost.tree_scales[n]]
        trees: tuple = ()
        if self.max_branches > 1:
            trees = tuple(round(32 * self._root_factor(n)) for n in range(2, self.max_branches + 1))
        return (
            num_other // 32,
            tuple((a * 32).astype(np.int64).tolist()),
            tuple((context // 32).astype(np.int64).tolist()),
            tuple(widths),
            tuple(round(25 * s.value) for s in scales),
            trees,
        )

    def _decide(
        self, a: np.ndarray, context: np.ndarray, num_other_tokens: int
    ) -> tuple[list[int], list[str | None], int]:
        """(K per request, why each is below K_max, tree branches): the batch's best rate."""
        batch, k_max = len(a), self.max_draft_tokens
        if batch == 1 and self.max_branches == 1:  # one request: plain numbers, no arrays
            best, a1, c1 = self.cost.best_chain_length, float(a[0]), float(context[0])
            k = best(a1, c1, num_other_tokens + 1, k_max)
            solo = best(a1, c1, 1, k_max) if num_other_tokens else k  # as _best_alone
            return [k], [None if k >= k_max else REASON_BATCH if k < solo else REASON_ACCEPTANCE], 1
        gains = a[:, None] ** np.arange(1, k_max + 1)[None, :]  # [batch, k_max]: d-th draft's
        ks, rate = self._best_prefix(gains, context, num_other_tokens)
        uniform_ks, uniform_rate = self._best_uniform(gains, context, num_other_tokens)
        if rate < (1 + self.uniform_margin) * uniform_rate:
            ks = uniform_ks
        solo = self._best_alone(gains, context)
        reasons: list[str | None] = []
        for k, k_solo in zip(ks, solo, strict=True):
            if k >= k_max:
                reasons.append(None)
            else:  # would it get more alone? then the batch is what cut it
                reasons.append(REASON_BATCH if k < k_solo else REASON_ACCEPTANCE)
        branches = 1
        if self.max_branches > 1:
            n, k_tree, tree_rate = self._best_tree(a, context, num_other_tokens)
            if n > 1 and tree_rate > (1 + self.uniform_margin) * max(rate, uniform_rate):
                ks, branches = np.full(batch, k_tree, dtype=np.int64), n
                reasons = [None] * batch
        return [int(k) for k in ks], reasons, branches

    def _seconds(
        self,
        base_tokens: float,
        drafts: np.ndarray,
        passes: np.ndarray,
        decode_pairs: float,
        draft_pairs: np.ndarray,
        branches: int = 1,
    ) -> np.ndarray:
        """Predicted step time: the target pass holds base_tokens (prefill tokens and every
        request's last token, each of the latter a query over its context: decode_pairs) plus
        the drafts, each of which is one more query over its request's context."""
        return self.cost.target_time(
            base_tokens + drafts, decode_pairs, decode_pairs + draft_pairs, branches
        ) + self.cost.draft_time(passes, drafts, draft_pairs, branches)

    def _best_uniform(
        self, gains: np.ndarray, context: np.ndarray, num_other: int
    ) -> tuple[np.ndarray, float]:
        """The best single K for every request, and its expected tokens per second."""
        rows, k_max = gains.shape
        k = np.arange(0, k_max + 1)
        tokens = rows + np.concatenate([[0.0], np.cumsum(gains.sum(axis=0))])
        total_context = float(context.sum())
        seconds = self._seconds(num_other + rows, rows * k, k, total_context, k * total_context)
        rates = tokens / seconds
        best = int(np.argmax(rates))
        return np.full(rows, best, dtype=np.int64), float(rates[best])

    def _best_prefix(
        self, gains: np.ndarray, context: np.ndarray, num_other: int
    ) -> tuple[np.ndarray, float]:
        """K per request from the best prefix of increments ranked by gain, and its expected
        tokens per second. Each draft adds a token to the target pass, a query over its
        request's context to both models, and possibly a draft pass (the deepest draft sets
        how many); the plain-decode part (every request's last token) is paid regardless."""
        rows, k_max = gains.shape
        order = np.argsort(-gains, axis=None, kind="stable")
        owner = order // k_max
        depth = order % k_max + 1
        m = np.arange(0, order.size + 1)  # prefix length = total draft tokens
        tokens = rows + np.concatenate([[0.0], np.cumsum(gains.reshape(-1)[order])])
        passes = np.concatenate([[0], np.maximum.accumulate(depth)])
        draft_pairs = np.concatenate([[0.0], np.cumsum(context[owner])])
        seconds = self._seconds(num_other + rows, m, passes, float(context.sum()), draft_pairs)
        rates = tokens / seconds
        best = int(np.argmax(rates))
        ks = np.zeros(rows, dtype=np.int64)
        np.add.at(ks, owner[:best], 1)
        return ks, float(rates[best])

    def _best_tree(
        self, a: np.ndarray, context: np.ndarray, num_other: int
    ) -> tuple[int, int, float]:
        """The best draft tree for every request (N candidates for the next token, each
        continued to depth K), and its expected tokens per second. N candidates find the
        target's token with `root_acceptance` (1 - (1 - a)^N as if independent, corrected by
        the tree steps measured), the positions after it with a each; the pass pays N x K
        draft tokens and K draft passes of N rows."""
        rows, k_max = len(a), self.max_draft_tokens
        total_context = float(context.sum())
        best = (1, 0, 0.0)
        for n in range(2, self.max_branches + 1):
            first = self.root_acceptance(a, n)  # [rows]
            depth = np.arange(1, k_max + 1)
            gains = first[:, None] * a[:, None] ** (depth[None, :] - 1)  # [rows, k_max]
            k = np.arange(1, k_max + 1)
            tokens = rows + np.cumsum(gains.sum(axis=0))
            seconds = self._seconds(
                num_other + rows, rows * k * n, k, total_context, k * n * total_context, n
            )
            rates = tokens / seconds
            i = int(np.argmax(rates))
            if rates[i] > best[2]:
                best = (n, int(k[i]), float(rates[i]))
        return best

    def _best_alone(self, gains: np.ndarray, context: np.ndarray) -> np.ndarray:
        """K per request if it were the only one decoding (vectorised over requests)."""
        rows, k_max = gains.shape
        drafts = np.arange(0, k_max + 1)[None, :]  # K = 0..k_max for each request
        tokens = 1 + np.concatenate([np.zeros((rows, 1)), np.cumsum(gains, 1)], axis=1)
        ctx = context[:, None]
        seconds = self.cost.target_time(1 + drafts, ctx, (1 + drafts) * ctx) + self.cost.draft_time(
            drafts, drafts, drafts * ctx
        )
        return np.argmax(tokens / seconds, axis=1)


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
