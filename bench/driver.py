"""A closed-loop load driver over an in-process LLMEngine.

`concurrency` requests are kept in flight: when one finishes the next prompt is added. Time
to first token is measured from a request's arrival to the step that returned its first
token; inter-token latency is (last token time - first token time) / (tokens - 1). Tokens
that arrive together in one speculative step share a timestamp, as a client sees them.

Before the clock starts the driver collects and freezes the process's heap, as the server does
once at start-up (server/app.py), and unfreezes it when the run ends. A benchmark process
holding transformers, the models and the results so far has a few hundred thousand objects,
and a full collection of them takes about 0.2 s (2-core AMD EPYC, 2026-11-27), enough to turn
one short timed run into an outlier. The collector's pauses inside the timed run are reported
beside its other numbers (on an H100 with the 146M pair they stayed under 1 ms a run, with
the freeze or without).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass

from engine.core.engine import LLMEngine
from engine.types.request import SamplingParams


@dataclass
class RunResult:
    setting: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_mean_ms: float
    itl_mean_ms: float
    acceptance: float
    """Per-token acceptance: accepted / judged drafts (nan when nothing was drafted)."""
    mean_k: float
    """Drafts per decode request-step, K = 0 steps included (0 when speculation is off)."""
    tokens_per_pass: float
    draft_seconds: float
    target_seconds: float
    draft_passes: int
    verify_steps: int
    gc_seconds: float = 0.0
    """Time the garbage collector ran inside the timed run."""
    gc_full_collections: int = 0
    """Of those runs, the ones over the oldest generation."""

    def as_dict(self) -> dict:
        return asdict(self)


def run_closed_loop(
    engine: LLMEngine,
    setting: str,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    num_requests: int,
) -> RunResult:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = _counters(engine)
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    submitted = finished = tokens = 0
    steps = 0
    gc.collect()
    gc.freeze()
    pauses = _GcPauses()
    gc.callbacks.append(pauses)
    start = time.perf_counter()
    try:
        while finished < num_requests:
            while submitted - finished < concurrency and submitted < num_requests:
                rid = f"{setting}-{concurrency}-{submitted}"
                engine.add_request(rid, prompts[submitted % len(prompts)], params)
                arrival[rid] = time.perf_counter()
                submitted += 1
            outputs = engine.step()
            steps += 1
            now = time.perf_counter()
            for out in outputs:
                if out.new_token_ids:
                    first.setdefault(out.request_id, now)
                    last[out.request_id] = now
                    counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
                    tokens += len(out.new_token_ids)
                finished += out.finished
        seconds = time.perf_counter() - start
    finally:
        gc.callbacks.remove(pauses)
        gc.unfreeze()  # what the run leaves behind (an engine dropped later) stays collectable
    after = _counters(engine)
    delta = {k: after[k] - before[k] for k in after}
    ttft = [first[r] - arrival[r] for r in first]
    itl = [(last[r] - first[r]) / (counts[r] - 1) for r in first if counts[r] > 1]
    return RunResult(
        setting=setting,
        concurrency=concurrency,
        requests=num_requests,
        output_tokens=tokens,
        seconds=seconds,
        tokens_per_s=tokens / seconds,
        ttft_mean_ms=1e3 * statistics.fmean(ttft),
        itl_mean_ms=1e3 * statistics.fmean(itl) if itl else float("nan"),
        acceptance=delta["accepted"] / delta["trials"] if delta["trials"] else float("nan"),
        mean_k=delta["drafted"] / delta["decodes"] if delta["decodes"] else 0.0,
        tokens_per_pass=(delta["accepted"] + delta["passes"]) / delta["passes"]
        if delta["passes"]
        else 1.0,
        draft_seconds=delta["draft_seconds"],
        target_seconds=delta["target_seconds"],
        draft_passes=int(delta["draft_passes"]),
        verify_steps=steps,
        gc_seconds=pauses.seconds,
        gc_full_collections=pauses.full,
    )


class _GcPauses:
    """A `gc.callbacks` entry: the time the collector ran, and its full collections."""

    def __init__(self) -> None:
        self.seconds, self.full, self._began = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._began
        self.full += info["generation"] == 2


def _counters(engine: LLMEngine) -> dict[str, float]:
    stats = engine.stats()
    spec = engine.scheduler.spec_totals
    return {
        "accepted": spec.accepted,
        "drafted": spec.drafted,
        "trials": spec.trials,
        "passes": spec.verify_passes,
        "draft_seconds": stats.draft_seconds,
        "target_seconds": stats.target_seconds,
        "draft_passes": stats.draft_passes,
        "decodes": stats.decode_request_steps,
    }
