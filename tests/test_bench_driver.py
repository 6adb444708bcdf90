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
