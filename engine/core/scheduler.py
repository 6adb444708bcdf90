"""Continuous batching under a per-step token budget.

Each step every running request is given the tokens it is missing from the cache: a prefill
chunk, or its last sampled token plus K draft tokens to verify. New requests join (FCFS)
while budget, sequence slots and blocks last. When blocks run out the youngest running
request is preempted: its blocks are freed and it is re-queued to be recomputed later.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from engine.config import SchedulerConfig
from engine.kv.manager import KVCacheManager
from engine.spec.draft_length import (
    REASON_BUDGET,
    REASON_LENGTH,
    REASON_MEMORY,
    DraftLengthPolicy,
)
from engine.types.batch import ScheduledRequest, SchedulerOutput
from engine.types.outputs import RequestOutput, StepTokens
from engine.types.request import Request, RequestStatus, SpecStats

FORCED_MAX = 4
"""The most grammar-forced drafts a step takes per request when K_max is smaller."""


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        policy: DraftLengthPolicy,
        has_draft_model: bool = False,
        lookup: Callable[[list[int], int], list[int]] | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.policy = policy
        self.has_draft_model = has_draft_model
        self.lookup = lookup  # (context, K) -> up to K prompt-lookup drafts (ngram_assist)
        self.requests: dict[str, Request] = {}
        """Every unfinished request, waiting or running, by id."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_blocks_released = 0
        self.num_tree_steps = 0
        self.num_forced_drafted = 0
        """Drafts the grammars forced, and how many of them the target kept."""
        self.num_forced_accepted = 0
        self.num_lookup_drafted = 0  # drafts the lookup gave, and those kept
        self.num_lookup_accepted = 0
        self.num_prefix_hit_tokens = 0
        self.spec_totals = SpecStats()
        self.draft_length_reasons: Counter[str] = Counter()
        """Request-steps that got fewer than K_max drafts, by reason."""

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decoding = [r for r in self.running if not r.is_prefill]
        prefill = sum(r.num_tokens - r.num_computed_tokens for r in self.running if r.is_prefill)
        batch = len(decoding)
        choice = self.policy.choose(decoding, min(prefill, max(budget - batch, 0)))
        branches = choice.branches
        wanted = dict(zip(decoding, zip(choice.ks, choice.reasons, strict=True), strict=True))

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            k_wanted, reason = wanted.get(req, (0, None))
            forced = self._forced(req)
            looked_up = False
            if forced:  # the grammar's own drafts, whatever the policy chose
                k_wanted, reason = len(forced), None
            elif self._may_look_up(req, k_wanted, batch):
                found = self.lookup(req.all_token_ids, self.policy.max_draft_tokens)
                if found and (k := self.policy.lookup_length(req, k_wanted, len(found), batch)):
                    forced, looked_up, k_wanted = found[:k], True, k
            k = k_wanted
            width = 1 if req.grammar is not None or looked_up else branches  # those are chains
            if k > 0:
                # No point drafting past what the request may still emit or hold.
                room = min(
                    req.params.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens,
                )
                k = max(0, min(k, room, (budget - num_new) // width))
                if k < k_wanted:
                    reason = REASON_LENGTH if room <= k else REASON_BUDGET
            slots = self._allocate_or_preempt(req, num_new, k * width, out)
            if slots is None:
                break  # req itself was preempted; nothing younger is left running
            if slots < k * width:
                reason, k = REASON_MEMORY, 0
            if reason is not None:
                self.draft_length_reasons[reason] += 1
            given = forced[:k] if forced and k else None
            item = ScheduledRequest(req, num_new, k, width if k else 1, given, looked_up and k > 0)
            out.scheduled.append(item)
            budget -= num_new + item.num_draft_slots
            i += 1

        # After a preemption the pool is full: admitting now would only thrash.
        while (
            self.waiting
            and not out.preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            num_cached = len(cached) * self.kv.block_size
            num_new = min(req.num_tokens - req.num_computed_tokens - num_cached, budget)
            if not self.kv.allocate_slots(req, num_new, cached_blocks=cached):
                break
            if cached:
                req.num_computed_tokens = req.num_draft_computed_tokens = num_cached
                req.num_cached_tokens = max(req.num_cached_tokens, num_cached)
                self.num_prefix_hit_tokens += num_cached
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

        if any(item.branches > 1 for item in out.scheduled):
            self.num_tree_steps += 1
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def update(
        self,
        sched: SchedulerOutput,
        results: dict[str, StepTokens],
        prompt_logprobs: dict[str, list] | None = None,
    ) -> list[RequestOutput]:
        """Advance counters with the verified tokens; roll back and release rejected ones.
        `prompt_logprobs`: this step's chunks of them, per request (the verifier's)."""
        outputs = []
        for item in sched.scheduled:
            req = item.request
            if req.status.finished:
                continue  # aborted while the step ran
            chunk = (prompt_logprobs or {}).get(req.request_id)
            if chunk is not None:  # a chunk from the prompt's start (again, if preempted)
                start_over = req.num_computed_tokens == 0 or req.prompt_logprobs is None
                req.prompt_logprobs = chunk if start_over else req.prompt_logprobs + chunk
            result = results.get(req.request_id)
            if result is None:  # a prefill chunk that does not reach the end: nothing sampled
                req.num_computed_tokens += item.num_new_tokens
                self._cache(req)
                continue
            req.num_computed_tokens += item.num_new_tokens + result.num_accepted
            req.num_draft_computed_tokens = min(
                req.num_draft_computed_tokens, req.num_computed_tokens
            )
            num_drafted = result.num_drafted
            if item.looked_up:  # a lookup's or a grammar's drafts say nothing of the proposer's
                self.num_lookup_drafted += num_drafted
                self.num_lookup_accepted += result.num_accepted
                self.policy.observe_lookup(num_drafted, result.num_accepted)
            elif item.forced:
                self.num_forced_drafted += num_drafted
                self.num_forced_accepted += result.num_accepted
            elif num_drafted:
                req.spec.record(num_drafted, result.num_accepted)
                self.spec_totals.record(num_drafted, result.num_accepted)
                self.policy.observe(req, num_drafted, result.num_accepted, item.branches)
            new_tokens, logprobs = self._append(req, result)
            # Blocks past the verified tokens hold only rejected drafts: give them back now.
            self.num_blocks_released += self.kv.trim(req, req.num_computed_tokens)
            if req.status.finished:
                self.running.remove(req)
                self._finish(req)
            else:
                self._cache(req)
            out = make_output(req, new_tokens, logprobs)
            if chunk is not None and len(req.prompt_logprobs or ()) == req.num_prompt_tokens:
                out.prompt_logprobs = req.prompt_logprobs  # complete this step: sent once
            outputs.append(out)
        return outputs

    def _may_look_up(self, req: Request, k: int, batch: int) -> bool:
        """With `speculative.ngram_assist`, for a request without a grammar that drafts this step or
        decodes alone (in a batch the policy's search priced the rows: a lookup takes them)."""
        usable = self.lookup is not None and req.grammar is None and not req.is_prefill
        return usable and (k > 0 or batch == 1)

    def _forced(self, req: Request) -> list[int]:
        """Tokens a decoding request's grammar forces next, at most FORCED_MAX or K_max."""
        if req.grammar is None or req.is_prefill:
            return []
        return req.grammar.forced()[: max(self.policy.max_draft_tokens, FORCED_MAX)]

    def _allocate_or_preempt(
        self, req: Request, num_new: int, k: int, out: SchedulerOutput
    ) -> int | None:
        """Allocate req's slots, dropping its drafts and then preempting the youngest running
        requests as needed. Returns the K that fit, or None when req itself was preempted."""
        while not self.kv.allocate_slots(req, num_new, k):
            if k > 0:
                k = 0  # speculation is the first thing to give up under memory pressure
                continue
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return None
        return k

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self._remove(req, RequestStatus.FINISHED_ABORTED)
        return req

    def fail(self, req: Request, message: str) -> None:
        req.error = message
        self._remove(req, RequestStatus.FINISHED_ERROR)

    def _remove(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self._finish(req)

    def _append(self, req: Request, result: StepTokens) -> tuple[list[int], list | None]:
        """Append verified tokens one by one, cutting at a stop token or a length limit."""
        if req.params.max_tokens == 0:  # scoring only (echo + logprobs): nothing to emit
            req.status = RequestStatus.FINISHED_LENGTH
            return [], []
        stops = req.stop_token_ids
        appended = []
        grammar = req.grammar
        for token in result.token_ids:
            req.output_token_ids.append(token)
            appended.append(token)
            if grammar is not None and not grammar.commit(token):
                # The masks forbid a refused token: this is llguidance failing mid-document.
                req.error = grammar.failure or f"token {token} breaks the request's grammar"
                req.error_code = "invalid_grammar"
                req.status = RequestStatus.FINISHED_ERROR
            elif token in stops and req.num_output_tokens > req.params.min_tokens:
                req.status = RequestStatus.FINISHED_STOPPED
            elif grammar is not None and grammar.stopped:  # complete: nothing may follow
                req.status = RequestStatus.FINISHED_STOPPED
            elif (
                req.num_output_tokens >= req.params.max_tokens
                or req.num_tokens >= self.max_model_len
            ):
                req.status = RequestStatus.FINISHED_LENGTH
            if req.status.finished:
                break
        logprobs = result.logprobs[: len(appended)] if result.logprobs is not None else None
        return appended, logprobs

    def _cache(self, req: Request) -> None:
        cacheable = req.num_computed_tokens
        if self.has_draft_model:  # a shared block must hold valid draft KV too
            cacheable = min(cacheable, req.num_draft_computed_tokens)
        self.kv.cache_verified(req, cacheable)

    def _finish(self, req: Request) -> None:
        del self.requests[req.request_id]
        self.kv.free(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = req.num_draft_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)


def make_output(req: Request, new_tokens: list[int], logprobs: list | None) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=new_tokens,
        finished=req.status.finished,
        finish_reason=req.status.value if req.status.finished else None,
        new_logprobs=logprobs,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        num_cached_tokens=req.num_cached_tokens,
        num_drafted_tokens=req.spec.drafted,
        num_accepted_tokens=req.spec.accepted,
        error=req.error,
        error_code=req.error_code,
    )
