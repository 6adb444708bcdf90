"""Per-request timing traces and the summary every peer row reports.

A trace is the list of moments tokens reached the client, with how many tokens each moment
carried. Servers (and speculative steps) deliver several tokens at once, so inter-token
latency is normalised per token: a gap of g seconds before a chunk of n tokens counts as n
samples of g / n. Its mean is then (last token time - first token time) / (tokens - first
chunk's tokens), which is the engine driver's definition; its percentiles show how bursty
delivery is without rewarding or punishing systems for how they group tokens into chunks.
The raw per-chunk gaps are kept beside it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class Trace:
    """One request as the client saw it. Times are time.perf_counter() seconds."""

    start: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    """(arrival time, tokens in the chunk); chunks with no tokens are not recorded."""
    output_tokens: int = 0
    """Tokens the system says it produced (usage), else the sum over chunks."""
    error: str | None = None


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(traces: list[Trace], seconds: float) -> dict[str, float | int]:
    """Throughput and latency over the finished traces of one measured run."""
    ok = [t for t in traces if t.error is None and t.chunks]
    ttft = [t.chunks[0][0] - t.start for t in ok]
    itl: list[float] = []
    gaps: list[float] = []
    tpot: list[float] = []
    for t in ok:
        for (prev, _), (now, n) in zip(t.chunks, t.chunks[1:], strict=False):
            itl += [(now - prev) / n] * n
            gaps.append(now - prev)
        later = sum(n for _, n in t.chunks[1:])
        if later:
            tpot.append((t.chunks[-1][0] - t.chunks[0][0]) / later)
    tokens = sum(t.output_tokens for t in ok)
    ms = 1e3
    return {
        "requests": len(traces),
        "failed": len(traces) - len(ok),
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else math.nan,
        "requests_per_s": len(ok) / seconds if seconds > 0 else math.nan,
        "ttft_p50_ms": ms * percentile(ttft, 50),
        "ttft_p99_ms": ms * percentile(ttft, 99),
        "ttft_mean_ms": ms * statistics.fmean(ttft) if ttft else math.nan,
        "itl_p50_ms": ms * percentile(itl, 50),
        "itl_p99_ms": ms * percentile(itl, 99),
        "itl_mean_ms": ms * statistics.fmean(itl) if itl else math.nan,
        "tpot_p50_ms": ms * percentile(tpot, 50),
        "tpot_p99_ms": ms * percentile(tpot, 99),
        "chunk_gap_p50_ms": ms * percentile(gaps, 50),
        "chunk_gap_p99_ms": ms * percentile(gaps, 99),
        "tokens_per_chunk": sum(n for t in ok for _, n in t.chunks)
        / max(1, sum(len(t.chunks) for t in ok)),
    }
