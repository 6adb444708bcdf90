"""LLMEngine: one synchronous step at a time (schedule, draft, one target pass, verify, book
the results). AsyncEngine (async_engine.py) runs it on a thread."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from engine.attention.backends import select_backend
from engine.attention.cpu import CPU
from engine.config import EngineConfig
from engine.core.kv_budget import kv_cache_dtype, num_kv_blocks
from engine.core.scheduler import Scheduler, make_output
from engine.cpu import kernels as cpu_kernels
from engine.cpu import memory as cpu_memory
from engine.cpu.pairs import attention_pairs
from engine.kv.manager import KVCacheManager
from engine.model import files as model_files
from engine.model.decode_graphs import BATCH_BUCKETS
from engine.model.on_cpu import draft_beside_gguf_blocks, quantized_linears, use_cpu_kernels
from engine.model.quantization import check_runs_here
from engine.model.runner import ModelRunner, resolve_device, resolve_dtype
from engine.sample.grammar import Grammars
from engine.spec.cost.calibration import calibrate
from engine.spec.cost.model import CostModel
from engine.spec.planner import FORCED_MAX, SpecPlanner
from engine.spec.policy import policy_for
from engine.spec.proposers import build_proposer
from engine.spec.speed_of_light import SpeedOfLight
from engine.spec.step import StepResult
from engine.spec.verifier import Verifier
from engine.types.batch import SchedulerOutput
from engine.types.outputs import RequestOutput
from engine.types.request import Request, SamplingParams
from engine.types.stats import EngineStats
from engine.types.validation import check_request

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config = model_files.prepare_config(config)  # GGUF files -> (cached) HF directories
        self.config = config
        self.device = resolve_device(config.model.device)
        dtype = resolve_dtype(config.model.dtype, self.device)
        if self.device.type == "cpu":
            cpu_memory.keep_freed_memory()
        self.attention_backend = select_backend(config.model.attention_backend, self.device, dtype)
        quantization = config.model.quantization
        gguf = draft_beside_gguf_blocks(config, self.device, dtype)
        draft_quantization = config.spec.draft_weights(quantization, gguf)
        check_runs_here("--quantization", quantization, self.device, dtype)
        check_runs_here("--draft-quantization", draft_quantization, self.device, dtype)
        impl = config.model.model_impl
        self.runner = ModelRunner(
            config.model.model, self.device, dtype, self.attention_backend, impl, quantization
        )
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = model_files.eos_token_ids(config.model.model, self.runner.hf_config)
        self.proposer = build_proposer(
            config.spec,
            self.device,
            dtype,
            self.runner,
            self.attention_backend,
            impl,
            draft_quantization,
        )

        block_size = config.cache.block_size
        draft = self.proposer.runner if self.proposer is not None else None
        self.runners = [self.runner] + ([draft] if draft is not None else [])
        self.max_model_len = self._max_model_len()
        kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, self.device, dtype)
        for runner in self.runners:  # what the KV cache holds (--kv-cache-dtype)
            runner.kv_dtype = kv_dtype
        if config.model.cpu_packed_linear and self.device.type == "cpu" and dtype == torch.float32:
            self._pack_linears()
        self._set_attention(block_size)
        self.cpu_isa = cpu_kernels.isa() if self.runner.kernels != "torch" else None
        """The instruction set of the CPU kernels the target runs on, or None (/version)."""
        num_blocks = config.cache.num_blocks or num_kv_blocks(
            config, self.device, self.runners, self.max_model_len
        )
        self.runner.allocate_kv(num_blocks, block_size)
        if self.proposer is not None:
            self.proposer.allocate_kv(num_blocks, block_size)
        self.kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        pool_tokens = num_blocks * block_size
        if pool_tokens < self.max_model_len:
            msg = "the KV pool holds %d tokens, less than max_model_len %d: capping it"
            logger.warning(msg, pool_tokens, self.max_model_len)
            self.max_model_len = pool_tokens
        self.decode_graphs = config.model.cuda_graphs and self._enable_decode_graphs()
        self.cost_model: CostModel | None = None
        if config.spec.enabled and config.spec.draft_length == "adaptive":
            max_tokens = min(config.scheduler.max_num_batched_tokens, num_blocks * block_size)
            self.cost_model = calibrate(
                self.runners,
                fresh=config.spec.recalibrate,
                block_size=block_size,
                num_blocks=num_blocks,
                max_tokens=max_tokens,
                max_batch=config.scheduler.max_num_seqs,
                max_context=self.max_model_len,
            )
        policy = policy_for(config.spec, self.cost_model)
        self.planner = SpecPlanner(config.spec, policy, self.proposer, self.cost_model)
        self.speed_of_light = SpeedOfLight()
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.planner)
        self.verifier = Verifier(
            self.vocab_size,
            self.device,
            self.speed_of_light,
            config.spec.verification,
            config.spec.tree_drafts,
        )
        self.grammars = Grammars(config.model.model, self.vocab_size, self.eos_token_ids)
        """Structured output's compiled grammars (engine/sample/grammar.py)."""
        self.totals = EngineStats()
        self._seeds = itertools.count(config.model.seed)
        logger.info(
            "engine ready: %s on %s/%s (%s forward, %s attention, decode graphs %s), %d KV "
            "blocks of %d tokens (%s), max_model_len %d, spec %s",
            config.model.model,
            self.device,
            dtype,
            self.runner.model_impl,
            self.attention_backend,
            "on" if self.decode_graphs else "off",
            num_blocks,
            block_size,
            self.runner.kv_dtype,
            self.max_model_len,
            config.spec.method if config.spec.enabled else "off",
        )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        """Validate and queue a request; raise ValueError (bad input) or QueueFullError."""
        self.validate(prompt_token_ids, params)
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are already waiting")
        return self.enqueue(request_id, prompt_token_ids, params)

    def enqueue(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        """Queue a request validated and admitted already (AsyncEngine admits on the caller's
        side, where a 503 is still possible): a queue refilled since must not fail it."""
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids)
        if params.grammar is not None:
            req.grammar = self.grammars.state(params.grammar)
        seed = params.seed if params.seed is not None else next(self._seeds)
        req.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.scheduler.add(req)
        return req

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest (a ValueError) unless this request can be served."""
        pool_tokens = self.kv.num_blocks * self.kv.block_size
        check_request(
            prompt_token_ids,
            params,
            self.vocab_size,
            self.max_model_len,
            pool_tokens,
            self.planner.max_draft_tokens,
        )
        if params.grammar is not None:  # compiles it (cached): off the server's event loop
            self.grammars.check(params.grammar)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        return make_output(req, [], None) if req is not None else None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        step_start = time.perf_counter()
        self.planner.begin_step(step_start)
        sched = self.scheduler.schedule()
        self.totals.steps += 1
        if not sched.scheduled:
            return []
        try:
            tables = [self.kv.block_table(s.request.request_id) for s in sched.scheduled]
            captures = self.graph_captures()
            start = time.perf_counter()
            drafts = self.planner.draft(sched, tables)
            drafted = time.perf_counter()
            verified = self.verifier.run(self.runner, sched, tables, drafts)
            done = time.perf_counter()  # run() ends with a host copy, so the GPU is done
            # A step that captured a CUDA graph says nothing about what steps cost.
            timed = self.graph_captures() == captures
            step = StepResult(sched, drafts, verified, drafted - start, done - drafted, timed)
            self.planner.observe(step)
        except Exception as exc:  # a failed forward fails this step's requests, not the engine
            logger.exception("engine step failed")
            return self._fail(sched, f"internal error in the engine step: {exc}")
        self._count(step)
        outputs = self.scheduler.update(sched, verified.tokens, verified.prompt_logprobs)
        self.totals.generation_tokens += sum(len(o.new_token_ids) for o in outputs)
        self.totals.step_seconds += time.perf_counter() - step_start
        self.planner.end_step(step, self.has_work())
        return outputs

    def stats(self) -> EngineStats:
        s = self.totals
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.num_blocks_total = self.kv.num_blocks
        s.num_blocks_free = self.kv.num_free_blocks
        s.preemptions = self.scheduler.num_preemptions
        s.prefix_cache_hit_tokens = self.scheduler.num_prefix_hit_tokens
        s.spec_blocks_released = self.scheduler.num_blocks_released
        spec_counts = self.planner.counters
        s.spec_tree_steps = spec_counts.tree_steps
        s.grammar_forced_drafted = spec_counts.forced_drafted
        s.grammar_forced_accepted = spec_counts.forced_accepted
        s.spec_lookup_drafted = spec_counts.lookup_drafted
        s.spec_lookup_accepted = spec_counts.lookup_accepted
        s.grammar_seconds = self.grammars.seconds
        spec = spec_counts.totals
        s.spec_verify_passes = spec.verify_passes
        s.spec_drafted_tokens = spec.drafted
        s.spec_accepted_tokens = spec.accepted
        s.spec_drafted_by_position = list(spec.drafted_by_position)
        s.spec_accepted_by_position = list(spec.accepted_by_position)
        s.draft_length_reasons = dict(spec_counts.reasons)
        capacity = (
            self.cost_model.capacity() if self.cost_model else 1 + self.planner.max_draft_tokens
        )
        s.speed_of_light = self.speed_of_light.snapshot(capacity)
        return s

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        if not self.scheduler.has_work():
            assert self.kv.num_free_blocks == self.kv.num_blocks, "idle engine holds KV blocks"

    def graph_captures(self) -> int:
        return sum(r.decode_graphs.captures for r in self.runners if r.decode_graphs is not None)

    def _count(self, step: StepResult) -> None:
        """Count the step's inputs and times before the scheduler's update moves requests on."""
        t, sched = self.totals, step.sched
        t.forward_seconds += step.verified.forward_seconds
        t.draft_seconds += step.draft_seconds
        t.target_seconds += step.target_seconds
        t.draft_passes += step.draft_passes
        for item in sched.scheduled:  # prompt tokens (recomputed ones after preemption count)
            left = item.request.num_prompt_tokens - item.request.num_computed_tokens
            t.prompt_tokens += max(0, min(item.num_new_tokens, left))
        drafted = sum(item.num_draft_tokens for item in sched.scheduled)
        t.mean_draft_length = drafted / max(sched.num_decodes, 1)
        t.decode_request_steps += sched.num_decodes

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every unfinished request with an error (shutdown)."""
        reqs = list(self.scheduler.requests.values())
        for req in reqs:
            self.scheduler.fail(req, message)
        return [make_output(req, [], None) for req in reqs]

    def _fail(self, sched: SchedulerOutput, message: str) -> list[RequestOutput]:
        outputs = []
        for item in sched.scheduled:
            req = item.request
            if not req.status.finished:
                self.scheduler.fail(req, message)
                outputs.append(make_output(req, [], None))
        return outputs

    def _pack_linears(self) -> None:
        if not cpu_kernels.available():
            logger.warning(
                "--cpu-packed-linear ignored: Tandem's CPU kernels did not build (%s)",
                cpu_kernels.unavailable_reason(),
            )
            return
        cpu_kernels.use_activations("float32")  # for the probes; _set_activations after
        logger.info("Tandem's CPU kernels: compiled for %s", cpu_kernels.isa())
        for runner in self.runners:
            logger.info(
                "%s: %s", runner.name, use_cpu_kernels(runner, self.config.model.gguf_blocks)
            )
        self._set_activations()

    def _set_activations(self) -> None:
        """--cpu-activations for both runners, after the (float32) start-up probes: auto is
        int8 where the CPU has VNNI and a linear runs on quantized blocks, else float32."""
        asked = self.config.model.cpu_activations
        quantized = any(quantized_linears(r) for r in self.runners)
        if asked == "int8" and not quantized:
            raise ValueError(
                "--cpu-activations int8 applies to quantized linears (a .gguf model's blocks "
                "or --quantization int8/int4); this model runs none on the CPU kernels"
            )
        int8 = asked != "float32" and quantized and cpu_kernels.use_activations("int8")
        if asked == "int8" and not int8:
            raise ValueError(
                f"--cpu-activations int8 needs AVX-512 VNNI; this CPU's kernels are "
                f"{cpu_kernels.isa()}: use --cpu-activations float32"
            )
        mode = "int8" if int8 else "float32"
        for runner in self.runners:
            runner.cpu_activations = mode
        cpu_kernels.use_activations(mode)

    def _set_attention(self, block_size: int) -> None:
        """--cpu-attention bfloat16 (auto: where it can): each runner able to, on bfloat16 pairs."""
        asked, cache = self.config.model.cpu_attention, self.config.cache.kv_cache_dtype
        if asked == "float32":
            return
        if cache not in ("auto", "bfloat16"):
            if asked == "bfloat16":
                raise ValueError(
                    f"--cpu-attention bfloat16 keeps keys and values in bfloat16: use "
                    f"--kv-cache-dtype auto or bfloat16, not {cache}"
                )
            return
        for runner in self.runners:
            why = _pairs_unsupported(runner, block_size)
            if why is None:
                runner.kv_dtype = cpu_kernels.PAIRS
                logger.info("%s: attention on bfloat16 dot products", runner.name)
            elif asked == "bfloat16" and runner is self.runner:
                raise ValueError(f"--cpu-attention bfloat16: {runner.name}: {why}")

    def _max_model_len(self) -> int:
        limit, why = self.runner.max_positions, "the model's limit"
        for runner in self.runners:  # every path attends to the whole context: keep within
            if runner.sliding_window and runner.sliding_window < limit:
                limit, why = runner.sliding_window, f"the sliding window of {runner.name}"
        wanted = self.config.model.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"--max-model-len {wanted} exceeds {why}, {limit}")
        if wanted is None and limit < self.runner.max_positions:
            logger.info("max_model_len %d: %s", limit, why)
        return wanted or limit

    def _enable_decode_graphs(self) -> bool:
        spec = self.config.spec
        # A verification feeds 1 + K tokens (K up to FORCED_MAX for grammar-forced drafts,
        # speculation on or off), a draft tree's pass 1 + its nodes.
        drafted = spec.max_draft_tokens * spec.max_branches if spec.enabled else 0
        max_query_len = 1 + max(drafted, FORCED_MAX)
        max_batch = min(self.config.scheduler.max_num_seqs, BATCH_BUCKETS[-1])
        enabled = [
            runner.enable_decode_graphs(max_batch, max_query_len, self.max_model_len)
            for runner in self.runners
        ]
        return all(enabled)


def _pairs_unsupported(runner: ModelRunner, block_size: int) -> str | None:
    """Why `runner` cannot attend on bfloat16 pairs (its cache is the C kernels' alone), or None."""
    native = getattr(runner, "native", None)
    if runner.device.type != "cpu" or native is None or not native.cpu_kernels:
        return "it does not run the native forward on Tandem's CPU kernels"
    if runner.attention_backend is not CPU:
        return "its attention is not the cpu backend's"
    if not attention_pairs(runner.head_dim, block_size):
        return (
            f"the kernels ({cpu_kernels.isa()}) have no bfloat16 dot products for head_dim "
            f"{runner.head_dim} with blocks of {block_size} (they need AVX-512 BF16, a "
            "head_dim that is a multiple of 32 up to 128, blocks a multiple of 16)"
        )
    return None
