"""bench/draft_agreement.py's walk: what a greedy chain keeps, given where the draft is right."""

from __future__ import annotations

import pytest

from bench.draft_agreement import walk

pytestmark = pytest.mark.bench


def test_an_accepted_draft_skips_the_bonus_position():
    # Right everywhere: K = 1 drafts every other position (the rest are bonus tokens).
    assert walk([True] * 6, [True] * 6, 1) == (3, 3)
    # K = 2: two drafts and a bonus per pass.
    assert walk([True] * 6, [True] * 6, 2) == (2, 2)


def test_a_rejected_draft_is_drafted_again_at_the_next_position():
    assert walk([False] * 4, [True] * 4, 1) == (0, 4)
    # Right, wrong, right, right: K = 1 accepts at 0 (bonus 1), drafts 2 (bonus 3).
    assert walk([True, False, True, True], [False] * 4, 1) == (2, 2)
    # K = 2, depth 2 wrong at 1: accept 0, correction at 1; then 2 and 3 under the next pass.
    assert walk([True, True, True, True], [False, False, True, True], 2) == (2, 2)
    # Depth 1 wrong at 0: one pass for the correction, then 1 (with 2 from depth 2), bonus 3.
    assert walk([False, True, True, True], [False, False, True, False], 2) == (1, 2)
