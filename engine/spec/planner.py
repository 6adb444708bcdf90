"""Speculation's one seam with the engine: `plan` what each decoding request verifies, `draft`
for what was scheduled, `observe` the verified step (acceptance, pass costs, features)."""

from __future__ import annotations

import functools
import time
from collections import Counter
from dataclasses import dataclass, field

from engine.config import SpecConfig
from engine.spec.cost.model import CostModel, PassShape
from engine.spec.policy import REASON_REQUEST, DraftLengthPolicy
from engine.spec.proposers.base import DraftBatch, Proposer, with_forced_drafts
from engine.spec.proposers.ngram import assist_lookup
from engine.spec.step import StepResult
from engine.types.batch import DraftPlan, SchedulerOutput
from engine.types.request import Request, SpecStats

FORCED_MAX = 4
"""The most grammar-forced drafts a step takes per request when K_max is smaller."""

LOOKUP_MAX = 16
"""The most drafts a prompt lookup offers a request decoding alone (copied text goes on)."""

PLAIN_TIMED_FIRST, PLAIN_TIMED_EVERY = 64, 8
"""Plain decode steps timed for the cost model: the first 64, then one in 8 (shapes repeat)."""


@dataclass
class SpecCounters:
    """What speculation did, engine-wide (EngineStats reads these)."""

    totals: SpecStats = field(default_factory=SpecStats)  # the proposer's drafts only
    reasons: Counter[str] = field(default_factory=Counter)  # request-steps with K < K_max
    forced_drafted: int = 0
    forced_accepted: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    tree_steps: int = 0


class SpecPlanner:
    def __init__(
        self,
        spec: SpecConfig,
        policy: DraftLengthPolicy,
        proposer: Proposer | None,
        cost_model: CostModel | None = None,
    ) -> None:
        self.policy = policy
        self.proposer = proposer
        self.cost_model = cost_model
        self.lookup = assist_lookup(spec, proposer)
        self.method = spec.method
        self.keeps_draft_kv = proposer is not None and proposer.keeps_kv
        self.counters = SpecCounters()
        self._step_start = 0.0
        self._last_decode: tuple[float, int, float, bool] | None = None
        """The last step, if it decoded only and left work: (start, requests, passes, drafted)."""
        self._plain_steps = 0
        self._timed = False  # whether this step's costs are observed
        self._proposing = False
        self._tally: tuple[list[str | None], dict[str, int]] = ([], {})

    @property
    def max_draft_tokens(self) -> int:
        return self.policy.max_draft_tokens

    def plan(self, decoding: list[Request], num_other_tokens: int) -> dict[Request, DraftPlan]:
        """Per decoding request, what it should verify (a request left out verifies nothing)."""
        choice = self.policy.choose(decoding, num_other_tokens)
        batch = len(decoding)
        plans, self._proposing = {}, False
        if not any(choice.ks) and (self.lookup is None or batch > 1):
            if all(req.grammar is None for req in decoding):
                self._count_reasons(choice.reasons)  # here, as no scheduled request carries them
                return plans
        # max_draft_tokens caps K after the policy; without it forced drafts may pass K_max.
        no_cap = max(self.policy.max_draft_tokens, FORCED_MAX)
        for req, k, reason in zip(decoding, choice.ks, choice.reasons, strict=True):
            cap, grammar = req.params.max_draft_tokens, req.grammar
            if cap is None:
                cap = no_cap
            elif k > cap:
                k, reason = cap, REASON_REQUEST
            if grammar is not None and cap:  # the grammar's own drafts, whatever the policy chose
                if forced := grammar.forced()[: min(cap, no_cap)]:
                    plans[req] = DraftPlan(len(forced), None, 1, forced)
                    continue
            # A lookup where the request drafts or decodes alone (in a batch: the rows priced).
            if cap and self.lookup is not None and grammar is None and (k > 0 or batch == 1):
                limit = LOOKUP_MAX if req.params.max_draft_tokens is None else cap
                match, found = self.lookup(req.token_bytes(), limit)
                # Alone: a draft model's K is the lookup's rival; in a batch, its cap.
                rival = k if self.keeps_draft_kv or batch > 1 else 0
                n = self.policy.lookup_length(req, rival, match, len(found), batch) if found else 0
                if n := min(n, limit):
                    plans[req] = DraftPlan(n, reason, 1, found[:n], lookup_match=match)
                    continue
                k = k if self.keeps_draft_kv else 0
            if not k:
                plans[req] = _no_drafts(reason)
                continue
            width = 1 if grammar is not None else choice.branches  # a grammar's are chains
            plans[req] = DraftPlan(k, reason, width)
            self._proposing = True
        return plans

    def draft(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> DraftBatch | None:
        """The step's drafts: the proposer's (asked only if the plan drafts or a prompt is
        fed), with given ones (forced, looked up) in place."""
        drafts = None
        if self.proposer is not None and (self._proposing or sched.prefills):
            drafts = self.proposer.propose(sched, block_tables)
        return with_forced_drafts(sched, drafts)

    def release(self, req: Request) -> None:
        """The scheduler let the request go (finished, aborted, failed)."""
        if self.proposer is not None:
            self.proposer.release(req)

    def begin_step(self, now: float) -> None:
        """A step starts: the last decode step's time outside its passes is now known."""
        last, self._last_decode = self._last_decode, None
        self._step_start = now
        if last is not None and self.cost_model is not None:
            self.cost_model.observe_step(last[1], now - last[0], last[2], last[3])

    def observe(self, step: StepResult) -> None:
        """Learn from a verified step, before the scheduler moves its requests on."""
        counters, sched = self.counters, step.sched
        if self.proposer is not None and self.proposer.observes:
            start = time.perf_counter()
            self.proposer.observe(step)
            step.draft_seconds += time.perf_counter() - start  # the draft's time, not the target's
        results, policy = step.verified.tokens, self.policy
        chains: tuple[list[int], list[int]] = ([], [])  # the proposer's: drafted, accepted
        for item in sched.scheduled:
            if item.reason is not None:
                counters.reasons[item.reason] += 1
            req = item.request
            result = results.get(req.request_id)
            if result is None or req.status.finished:  # no sample yet, or aborted mid-step
                continue
            drafted, accepted = result.num_drafted, result.num_accepted
            if not drafted:
                continue
            if item.lookup_match:
                policy.observe_lookup(item.lookup_match, drafted, accepted, req)
            if item.lookup_match and self.keeps_draft_kv:  # says nothing of the draft model's
                counters.lookup_drafted += drafted
                counters.lookup_accepted += accepted
                req.spec.count("lookup", drafted, accepted)
            elif item.forced and not item.lookup_match:
                counters.forced_drafted += drafted
                counters.forced_accepted += accepted
                req.spec.count("grammar", drafted, accepted)
            else:
                req.spec.count(self.method, drafted, accepted)
                req.spec.record(drafted, accepted, by_position=False)
                chains[0].append(drafted)
                chains[1].append(accepted)
                policy.observe(req, drafted, accepted, item.branches)
        if chains[0]:
            counters.totals.record_many(*chains)
        if self._proposing and any(item.branches > 1 for item in sched.scheduled):
            counters.tree_steps += 1
        self._timed = self.cost_model is not None and step.timed and self._teaches(step)
        if self._timed:
            self._observe_costs(step)

    def end_step(self, step: StepResult, left_work: bool) -> None:
        """A decode-only step that left work is timed to the next start (streaming included)."""
        if not self._timed or not left_work:
            return
        sched = step.sched
        if sched.num_decodes != len(sched.scheduled):
            return
        drafted = step.drafts is not None and any(step.drafts.token_ids)
        passes = step.draft_seconds + step.target_seconds
        self._last_decode = (self._step_start, sched.num_decodes, passes, drafted)

    def _count_reasons(self, reasons: list[str | None]) -> None:
        """Count a plan's reasons; a reused decision's list (the same object) is tallied once."""
        if reasons is not self._tally[0]:
            tally: dict[str, int] = {}
            for reason in reasons:
                if reason is not None:
                    tally[reason] = tally.get(reason, 0) + 1
            self._tally = (reasons, tally)
        for reason, n in self._tally[1].items():
            self.counters.reasons[reason] += n

    def _teaches(self, step: StepResult) -> bool:
        """Whether the cost model learns from this step (PLAIN_TIMED_FIRST, PLAIN_TIMED_EVERY)."""
        fed = step.drafts is not None and step.drafts.fed_tokens
        if any(step.num_drafts) or fed or step.sched.prefills:
            return True
        self._plain_steps += 1
        return self._plain_steps <= PLAIN_TIMED_FIRST or self._plain_steps % PLAIN_TIMED_EVERY == 0

    def _observe_costs(self, step: StepResult) -> None:
        """Before the scheduler's update: num_computed_tokens is still this step's start."""
        assert self.cost_model is not None
        sched, drafts = step.sched, step.drafts
        num_drafts, proposed = step.num_drafts, step.proposed
        query_lens, context_lens = [], []
        for item, k in zip(sched.scheduled, num_drafts, strict=True):
            query_lens.append(item.num_new_tokens + k)
            context_lens.append(item.request.num_computed_tokens + item.num_new_tokens + k)
        branches = max((item.branches for item in sched.scheduled), default=1)
        if drafts is not None and (any(proposed) or drafts.fed_tokens):
            num_proposed = sum(proposed)
            self.cost_model.observe_draft(
                max(step.draft_passes, 1),
                num_proposed,
                drafts.fed_pairs,
                step.draft_seconds,
                branches,
                max(drafts.fed_tokens - num_proposed, 0),
            )
        shape = PassShape.of(query_lens, context_lens)
        self.cost_model.observe_target(shape, step.target_seconds, branches)


@functools.cache
def _no_drafts(reason: str | None) -> DraftPlan:
    return DraftPlan(0, reason)
