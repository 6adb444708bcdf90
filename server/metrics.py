"""Prometheus export: latency histograms measured here, engine numbers read at scrape time.

Each app owns its `CollectorRegistry` (two apps in one process, as in tests, never share or
collide). Engine statistics stay plain dataclasses in `engine.types.stats`; `EngineCollector`
turns the latest `EngineStats` into metric families when Prometheus scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from engine import EngineStats

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""What generate_latest() writes (the classic text format every Prometheus reads)."""
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:  # still loading
            return
        yield _gauge("requests_running", "Requests in the running batch.", stats.num_running)
        yield _gauge("requests_waiting", "Requests waiting for admission.", stats.num_waiting)
        yield _gauge("kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", stats.kv_usage)
        yield _gauge(
            "kv_cache_blocks_total", "KV cache blocks in the pool.", stats.num_blocks_total
        )
        yield _counter("prompt_tokens", "Prompt tokens processed.", stats.prompt_tokens)
        yield _counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield _counter(
            "prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache.",
            stats.prefix_cache_hit_tokens,
        )
        yield _counter(
            "preemptions", "Requests preempted for lack of KV blocks.", stats.preemptions
        )
        yield _counter("engine_steps", "Engine steps run.", stats.steps)
        yield _counter(
            "spec_verify_passes",
            "Verification passes over drafted tokens.",
            stats.spec_verify_passes,
        )
        yield _counter("spec_drafted_tokens", "Draft tokens proposed.", stats.spec_drafted_tokens)
        yield _counter(
            "spec_accepted_tokens",
            "Draft tokens accepted by the target.",
            stats.spec_accepted_tokens,
        )
        yield _counter(
            "spec_blocks_released",
            "KV blocks released because they held only rejected tokens.",
            stats.spec_blocks_released,
        )
        yield _counter(
            "spec_tree_steps",
            "Steps that drafted trees (several candidates for a next token).",
            stats.spec_tree_steps,
        )
        yield _by_label(
            "spec_drafted_tokens_by_position",
            "Draft tokens proposed at each draft position.",
            "position",
            dict(enumerate(stats.spec_drafted_by_position)),
        )
        yield _by_label(
            "spec_accepted_tokens_by_position",
            "Draft tokens accepted at each draft position.",
            "position",
            dict(enumerate(stats.spec_accepted_by_position)),
        )
        yield _gauge(
            "spec_mean_draft_length",
            "Mean draft length K of the latest step.",
            stats.mean_draft_length,
        )
        yield _by_label(
            "spec_draft_length_reductions",
            "Request-steps whose K was cut below K_max, by reason.",
            "reason",
            stats.draft_length_reasons,
        )
        yield _by_label(
            "step_seconds",
            "Wall time of engine steps by part: target_forward, draft "
            "(proposer), verify (sampling and verification), schedule (the rest of a step).",
            "part",
            step_split(stats),
        )
        yield _counter(
            "spec_lookup_drafted_tokens",
            "Drafts a prompt lookup gave in place of the draft model's (speculative.ngram_assist).",
            stats.spec_lookup_drafted,
        )
        yield _counter(
            "spec_lookup_accepted_tokens",
            "Prompt-lookup drafts (speculative.ngram_assist) the target kept.",
            stats.spec_lookup_accepted,
        )
        yield _counter(
            "grammar_forced_drafted_tokens",
            "Drafts a structured-output grammar forced (not the proposer's).",
            stats.grammar_forced_drafted,
        )
        yield _counter(
            "grammar_forced_accepted_tokens",
            "Grammar-forced drafts the target kept.",
            stats.grammar_forced_accepted,
        )
        yield _counter(
            "grammar_seconds",
            "Of the engine steps' wall time, structured output's grammar masks and matchers.",
            stats.grammar_seconds,
        )
        sol = GaugeMetricFamily(
            "tandem_spec_speed_of_light",
            "Speed-of-light model of speculation.",
            labels=["quantity"],
        )
        for name, value in sorted(stats.speed_of_light.items()):
            sol.add_metric([name], float(value))
        yield sol


def step_split(stats: EngineStats) -> dict[str, float]:
    """Where engine steps spent their wall time, in seconds, by part."""
    verify = max(stats.target_seconds - stats.forward_seconds, 0.0)
    rest = stats.step_seconds - stats.target_seconds - stats.draft_seconds
    return {
        "target_forward": stats.forward_seconds,
        "draft": stats.draft_seconds,
        "verify": verify,
        "schedule": max(rest, 0.0),
    }


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"tandem_{name}", doc, value=float(value))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"tandem_{name}", doc, value=float(value))


def _by_label(name: str, doc: str, label: str, values: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(f"tandem_{name}", doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([str(key)], float(value))
    return family


class Metrics:
    """Server-side measurements plus the engine collector, in a registry of their own."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "tandem_time_to_first_token_seconds",
            "From request arrival to the first generated token, per choice.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "tandem_inter_token_latency_seconds",
            "Time between engine outputs, split evenly over the tokens each one carried.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "tandem_e2e_request_latency_seconds",
            "From request arrival to the last token, per choice.",
            buckets=_REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.requests_finished = Counter(
            "tandem_requests_finished",
            "Finished choices by reason: stop, length, abort (client left), error, rejected, "
            "timeout.",
            ["finish_reason"],
            registry=self.registry,
        )
        self.request_errors = Counter(
            "tandem_request_errors",
            "HTTP requests answered with an error, by status code.",
            ["status"],
            registry=self.registry,
        )
        self.registry.register(EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_tokens(self, gap: float, num_tokens: int) -> None:
        """One engine output that carried num_tokens after `gap` seconds of waiting."""
        if num_tokens <= 0:
            return
        per_token = gap / num_tokens
        for _ in range(num_tokens):
            self.inter_token_latency.observe(per_token)
