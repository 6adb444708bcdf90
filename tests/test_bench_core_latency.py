"""bench.core_latency: the compiled probe hands a cache line between two pinned cores."""

from __future__ import annotations

import os

import pytest

from bench import core_latency

pytestmark = pytest.mark.bench


def test_the_probe_reads_a_round_trip_between_two_cores():
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("needs two cores")
    trips = list(core_latency.readings((cores[0], cores[1]), 2, 0.0, trips=20_000))
    assert len(trips) == 2
    # A round trip is two cache-line transfers: tens to hundreds of ns (under a millisecond
    # even where another process shares a core and each hand-over waits for its turn).
    assert all(5.0 < ns < 1e6 for ns in trips)


def test_the_benchmarks_probe_reads_once_per_call_or_says_none():
    probe = core_latency.Probe()
    if probe.cores is None:
        assert probe.reading() is None
        return
    assert 5.0 < probe.reading(trips=20_000) < 1e6
    probe.cores = (probe.cores[0], max(os.sched_getaffinity(0)) + 1)  # cannot be pinned
    assert probe.reading(trips=20_000) is None


def test_without_a_compiler_the_probe_reads_none(monkeypatch):
    def missing() -> str:
        raise RuntimeError("no C compiler found")

    monkeypatch.setattr(core_latency, "compiler", missing)
    probe = core_latency.Probe()
    assert probe.binary is None and probe.reading() is None


def test_a_core_outside_the_process_is_refused(capsys):
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(SystemExit, match="two different cores"):
        core_latency.main(["--cores", "0", str(outside), "--seconds", "1"])
    with pytest.raises(SystemExit, match="two different cores"):
        core_latency.main(["--cores", "0", "0", "--seconds", "1"])
