"""Cores of its own for the engine thread on the CPU (`--cpu-bind`).

In the server, the engine thread does all the arithmetic while the event loop, the
tokenizer and the clients' connections share the process. Left to the OS scheduler, the
engine thread migrates between cores and now and then shares one with the event loop (or a
client on the same machine), and a step stretches. vLLM's CPU backend binds its OpenMP
threads to chosen cores for the same reason (VLLM_CPU_OMP_THREADS_BIND) and runs its API
server beside them.

So when the process may run on more cores than torch's thread count, the engine thread binds
itself to the first `torch.get_num_threads()` of them (engine/core/async_engine.py); its OpenMP
workers, created by it, inherit that set. The server's event loop then binds itself to the
other cores (server/app.py), so the two never share one. With as many threads as cores
(torch's default), nothing is bound.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def engine_cores(num_threads: int, allowed: set[int]) -> set[int] | None:
    """The cores the engine thread takes out of `allowed`, or None to leave it unbound."""
    if num_threads < 1 or len(allowed) <= num_threads:
        return None
    return set(sorted(allowed)[:num_threads])


def others(engine: set[int]) -> set[int]:
    """The cores the calling thread may use that the engine thread does not take."""
    return os.sched_getaffinity(0) - engine
