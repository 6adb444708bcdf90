"""The engine thread's cores on the CPU (--cpu-bind)."""

from __future__ import annotations

import os

import pytest
import torch

from engine.core.async_engine import AsyncEngine
from engine.cpu.affinity import engine_cores, others
from tests.engine_utils import make_engine


def test_engine_takes_the_first_cores_and_leaves_the_rest():
    assert engine_cores(1, {0, 1}) == {0}
    assert engine_cores(2, {3, 1, 7, 5}) == {1, 3}
    assert engine_cores(2, {0, 1}) is None  # no core would be left for the rest
    assert engine_cores(4, {0, 1}) is None
    assert engine_cores(0, {0, 1}) is None


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two cores",
)
def test_with_one_torch_thread_the_engine_thread_gets_a_core_of_its_own(tiny_dirs):
    allowed = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engines = {
            bind: AsyncEngine(make_engine(tiny_dirs["llama"], cpu_bind=bind))
            for bind in (True, False)
        }
        for engine in engines.values():
            engine.start()
        try:
            masks = {b: os.sched_getaffinity(e._thread.native_id) for b, e in engines.items()}
        finally:
            for engine in engines.values():
                engine.shutdown()
    finally:
        torch.set_num_threads(threads)
    first = {min(allowed)}
    assert engines[True].cores == first and masks[True] == first
    assert engines[False].cores is None and masks[False] == allowed
    assert os.sched_getaffinity(0) == allowed  # the caller is the server's to bind
    assert others(first) == allowed - first
