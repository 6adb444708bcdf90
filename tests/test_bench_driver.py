"""bench/default_engine.py's closed-loop driver keeps the garbage collector's pauses out of the
timed run where it can (the heap is frozen first) and reports the ones that remain."""

from __future__ import annotations

import gc

from bench.default_engine import run_closed_loop
from tests.engine_utils import make_engine, random_prompts


def test_collector_pauses_inside_the_timed_run_are_reported(tiny_dirs, monkeypatch):
    engine = make_engine(tiny_dirs["llama"])
    prompts = random_prompts([5, 9], vocab=300, seed=3)
    callbacks = list(gc.callbacks)
    quiet = run_closed_loop(engine, "quiet", prompts, 2, 4, 2)
    assert quiet.output_tokens == 8 and quiet.gc_seconds >= 0
    assert gc.get_freeze_count() == 0  # unfrozen afterwards: later garbage stays collectable

    step, frozen = engine.step, []

    def step_with_a_full_collection():
        frozen.append(gc.get_freeze_count())
        gc.collect()
        return step()

    monkeypatch.setattr(engine, "step", step_with_a_full_collection)
    busy = run_closed_loop(engine, "busy", prompts, 2, 4, 2)
    assert busy.gc_full_collections >= busy.verify_steps > 0
    assert busy.gc_seconds > 0
    assert min(frozen) > 0  # the heap was frozen while the clock ran
    assert gc.callbacks == callbacks and gc.get_freeze_count() == 0


def test_the_speed_driver_times_each_requests_first_and_last_tokens(tiny_dirs):
    """`speed`'s driver (the per-family rates of `--workload families` read these)."""
    from bench.default_engine import _closed_loop
    from engine import SamplingParams

    engine = make_engine(tiny_dirs["llama"])
    prompts = list(enumerate(random_prompts([5, 9, 7], vocab=300, seed=4)))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    times: dict[int, list] = {}
    tokens, seconds = _closed_loop(engine, prompts, 2, lambda i: params, times=times)
    assert tokens == 12 and seconds > 0 and sorted(times) == [0, 1, 2]
    for added, first, last, count, first_count in times.values():
        assert added < first < last and count == 4 and first_count == 1
