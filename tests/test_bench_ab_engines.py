"""bench/ab_engines.py: the sides' settings and one chunk's count of output tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.ab_engines import run_chunk, spec_with
from engine.config import SpecConfig
from tests.engine_utils import make_engine, random_prompts


def test_a_side_is_the_shipped_setting_with_its_fields_replaced():
    shipped = spec_with([])
    assert (shipped.method, shipped.draft_length, shipped.max_draft_tokens) == (
        "draft",
        "adaptive",
        4,
    )
    assert shipped.draft_branches == 1 and shipped.ngram_assist == 3
    side = spec_with(["draft_quantization=int4", "max_draft_tokens=1", "draft_length=fixed"])
    assert (side.draft_quantization, side.max_draft_tokens, side.draft_length) == (
        "int4",
        1,
        "fixed",
    )
    assert side.ngram_assist == 3  # what was not named stays the shipped value
    assert not spec_with(["method=off"]).enabled
    with pytest.raises(SystemExit, match="not a SpecConfig field"):
        spec_with(["no_such_field=1"])


def test_a_chunk_runs_its_prompts_to_the_end_and_counts_their_tokens(
    tiny_dirs: dict[str, Path],
):
    engine = make_engine(tiny_dirs["llama"], spec=SpecConfig(method="off"))
    prompts = random_prompts([5, 9, 3], vocab=200, seed=1)
    seconds, tokens = run_chunk(engine, "t", prompts, temperature=0.0, max_tokens=7)
    assert seconds > 0 and tokens == 3 * 7  # no EOS in a tiny random model's 7 greedy tokens
    assert not engine.has_work()
    stats = engine.stats()
    assert stats.num_blocks_free == stats.num_blocks_total


def test_optional_numbers_take_auto_and_flags_take_true_or_false():
    spec = spec_with(["draft_branches=auto", "recalibrate=true"])
    assert spec.draft_branches is None and spec.recalibrate is True
    assert spec_with(["recalibrate=false"]).recalibrate is False
