"""bench/paired.py's pieces that need no servers: its arguments and the pairs' summary."""

from __future__ import annotations

import pytest

from bench.paired import split_argv, summarize


def _row(config, c, temp, tok_s, outside):
    return {
        "config": config, "concurrency": c, "temperature": temp, "tokens_per_s": tok_s,
        "time_split": {"outside_steps": outside},
    }  # fmt: skip


def test_arguments_after_the_separator_go_to_the_benchmark():
    assert split_argv(["abc123", "--pairs", "2"]) == (["abc123", "--pairs", "2"], [])
    ours, bench = split_argv(["abc123", "--", "--configs", "off", "--levels", "16"])
    assert ours == ["abc123"] and bench == ["--configs", "off", "--levels", "16"]


def test_summary_pairs_rows_by_config_level_and_temperature():
    runs = {
        "new": [
            [_row("off", 1, 0.0, 150.0, 0.08), _row("off", 16, 0.0, 400.0, 0.05)],
            [_row("off", 1, 0.0, 120.0, 0.10), _row("off", 16, 0.0, 300.0, 0.06)],
        ],
        "old": [
            [_row("off", 16, 0.0, 200.0, 0.07), _row("off", 1, 0.0, 100.0, 0.09)],
            [_row("off", 1, 0.0, 120.0, 0.11), _row("off", 16, 0.0, 400.0, 0.05)],
        ],
    }
    lines = summarize(runs, ("new", "old"))
    assert lines[0] == (
        "pair 1 off c=1 T=0: new 150.0 tok/s, 8% outside steps | old 100.0 tok/s, 9% outside "
        "steps | new/old 1.500"
    )
    assert lines[1].endswith("new/old 2.000") and lines[3].endswith("new/old 0.750")
    # ratios 1.5, 2.0, 1.0, 0.75: the median of four is the mean of the middle two
    assert lines[-1] == "median new/old: 1.250 over 4 pairs (range 0.750-2.000)"


def test_summary_needs_the_same_rows_on_both_sides():
    runs = {"new": [[_row("off", 1, 0.0, 1.0, 0.1)]], "old": [[_row("off", 16, 0.0, 1.0, 0.1)]]}
    with pytest.raises(KeyError):
        summarize(runs, ("new", "old"))
