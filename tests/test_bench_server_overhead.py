"""bench/server_overhead.py: the real app and AsyncEngine around a paced stand-in engine.

Every token the stand-in makes must reach the client as one streamed content chunk, and
the child's CPU must be split by thread (the event loop did the streaming)."""

from __future__ import annotations

import argparse

import pytest

from bench.server_overhead import measure
from tests.deploy_helpers import free_port

pytestmark = pytest.mark.bench


def test_every_token_is_one_chunk_and_the_loop_pays_for_it(tiny_dirs):
    args = argparse.Namespace(
        levels=[1, 4], requests=[8, 16], max_tokens=64, model=str(tiny_dirs["llama"]),
        port=free_port(),
    )  # fmt: skip
    rows = measure(args, step_ms=1.0)
    assert [(r["level"], r["requests"], r["chunks"]) for r in rows] == [(1, 8, 512), (4, 16, 1024)]
    for row in rows:
        # The main thread streamed the chunks. /proc counts CPU in whole 10 ms clock ticks,
        # and the loop spends ~0.02-0.1 ms a chunk, so 128 chunks could read 0 (seen once in
        # CI); 512 and 1,024 chunks keep it on the CPU for a few ticks.
        assert row["loop_ms"] > 0
        assert row["wall_s"] >= row["chunks"] / row["level"] * 1e-3  # one step a token
