"""bench/default_engine.py's closed-loop driver keeps the garbage collector's pauses out of the
timed run where it can (the heap is frozen first) and reports the ones that remain."""

from __future__ import annotations

import gc
import re

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
    for added, first, last, count, first_count, steps, drafted, kept in times.values():
        assert added < first < last and count == 4 and first_count == 1
        assert steps == 4 and drafted == kept == 0  # speculation off: a token a step


def test_interleave_runs_every_wave_on_every_engine_in_turn(tiny_dirs, monkeypatch, capsys):
    """`speed --interleave`: all engines up at once, each wave of --concurrency requests run
    on each in turn, the order reversed every other wave and round; prefix caching off."""
    import argparse

    import bench.default_engine as bench

    built, ran = {}, []

    def engine(spec, *args, caching=True):
        assert not caching  # each round prefills, as its first did
        built[spec.method] = make_engine(tiny_dirs["llama"], spec=spec, prefix_caching=caching)
        return built[spec.method]

    def workload(eng, name, requests, concurrency):
        families = [("chat", []), ("rag", [])] * (requests // 2)
        return families, random_prompts([5, 9, 7, 6] * 2, vocab=300, seed=5)[: requests + 4]

    closed_loop = bench._closed_loop

    def recording(eng, work, *args, **kw):
        name = next(n for n, e in built.items() if e is eng)
        ran.append((name, [i for i, _ in work]))
        return closed_loop(eng, work, *args, **kw)

    monkeypatch.setattr(bench, "engine", engine)
    monkeypatch.setattr(bench, "_workload", workload)
    monkeypatch.setattr(bench, "_closed_loop", recording)
    args = argparse.Namespace(
        configs=["off", "ngram"], concurrency=2, verification=["block"], branches=[1],
        tree_drafts="top", draft=bench.DRAFT, model="tiny", quantization="none",
        cpu_activations=["auto"], cpu_attention=["auto"], workload="families", requests=4,
        max_tokens=4, temperature=0.0, rounds=2,
    )  # fmt: skip
    bench.interleaved(args)
    warm = [("off", [4, 5, 6, 7]), ("ngram", [4, 5, 6, 7])]
    waves = [("off", [0, 1]), ("ngram", [0, 1]), ("ngram", [2, 3]), ("off", [2, 3])]
    assert ran == warm + waves + [waves[1], waves[0], waves[3], waves[2]]
    out = capsys.readouterr().out
    for what in ("decode", "end-to-end"):
        line = next(x for x in out.splitlines() if x.startswith(f"ngram / off, c=2 T=0.0, {what}"))
        assert "chat" in line and "rag" in line and "all" in line and "median of 2" in line
    line = next(x for x in out.splitlines() if x.startswith("ngram, decode tokens a step"))
    cells = re.findall(r"(\w+) ([\d.]+) \(([\d.]+) drafted, (\d+)% kept\)", line)
    assert [c[0] for c in cells] == ["chat", "rag", "all"]
    assert all(float(tokens) >= 1 and 0 <= int(kept) <= 100 for _, tokens, _, kept in cells)
