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
        levels=[1, 4], requests=[2, 4], max_tokens=64, model=str(tiny_dirs["llama"]),
        port=free_port(),
    )  # fmt: skip
    rows = measure(args, step_ms=1.0)
    assert [(r["level"], r["requests"], r["chunks"]) for r in rows] == [(1, 2, 128), (4, 4, 256)]
    for row in rows:
        # The main thread streamed the chunks: at least a clock tick (10 ms) of its CPU.
        assert row["loop_ms"] > 0
        assert row["wall_s"] >= row["chunks"] / row["level"] * 1e-3  # one step a token
