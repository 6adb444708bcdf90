"""Cores of its own for the engine thread (`--cpu-bind`): the first `torch.get_num_threads()`
allowed cores, the event loop the others; nothing is bound when none would be left."""

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
