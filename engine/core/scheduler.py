"""Continuous batching under a per-step token budget: each running request gets its missing
tokens (a prefill chunk, or its last token plus drafts) within budget, length and KV blocks;
new requests join FCFS; out of blocks, the youngest is preempted and recomputed later."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from engine.config import SchedulerConfig
from engine.kv.manager import KVCacheManager
from engine.spec.policy.base import REASON_BUDGET, REASON_LENGTH, REASON_MEMORY
from engine.types.batch import NO_DRAFTS, ScheduledRequest, SchedulerOutput
from engine.types.outputs import RequestOutput, StepTokens
from engine.types.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.spec.planner import SpecPlanner


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        planner: SpecPlanner,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.planner = planner
        self.requests: dict[str, Request] = {}
        """Every unfinished request, waiting or running, by id."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_blocks_released = 0
        self.num_prefix_hit_tokens = 0

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
        plans = self.planner.plan(decoding, min(prefill, max(budget - batch, 0)))
        out.prefills = batch < len(self.running)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            plan = plans.get(req, NO_DRAFTS)
            k, reason, width = plan.k, plan.reason, plan.width
            if k > 0:
                # No point drafting past what the request may still emit or hold.
                room = min(
                    req.params.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens,
                )
                k = max(0, min(k, room, (budget - num_new) // width))
                if k < plan.k:
                    reason = REASON_LENGTH if room <= k else REASON_BUDGET
            slots = self._allocate_or_preempt(req, num_new, k * width, out)
            if slots is None:
                break  # req itself was preempted; nothing younger is left running
            if slots < k * width:
                reason, k = REASON_MEMORY, 0
            given = plan.given[:k] if plan.given and k else None
            item = ScheduledRequest(
                req, num_new, k, width if k else 1, given, plan.lookup_match if k else 0, reason
            )
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
            out.prefills = True
            budget -= num_new

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
        outputs, chunks = [], prompt_logprobs or {}
        for item in sched.scheduled:
            req = item.request
            if req.status.finished:
                continue  # aborted while the step ran
            chunk = chunks.get(req.request_id) if chunks else None
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
        if self.planner.keeps_draft_kv:  # a shared block must hold valid draft KV too
            cacheable = min(cacheable, req.num_draft_computed_tokens)
        self.kv.cache_verified(req, cacheable)

    def _finish(self, req: Request) -> None:
        del self.requests[req.request_id]
        self.kv.free(req)
        self.planner.release(req)

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
        drafts_by_source=dict(req.spec.by_source),
        error=req.error,
        error_code=req.error_code,
    )
