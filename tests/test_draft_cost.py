"""The draft's cost: four parts fitted at start-up, each corrected by the steps measured."""

from __future__ import annotations

import numpy as np
import pytest

from engine.spec.cost.calibration import _nonneg_lstsq
from engine.spec.cost.draft import DraftCost
from engine.spec.cost.model import CostModel
from engine.spec.policy import AdaptiveDraftLength
from tests.test_draft_length import SIZES, _requests

# (passes, drafts, pairs, fed): steps as a batch of 1..16 requests drafting K = 1..2 runs
# them, some with a lagging request's catch-up, and steps that only feed prompt chunks.
SHAPES = [
    *[(k, b * k, b * k * 200, 0) for b in (1, 4, 9, 16) for k in (1, 2)],
    *[(2, 32, 32 * 200 + 40 * 180, 40), (1, 16, 16 * 200 + 90 * 150, 90)],
    *[(1, 0, n * 120, n) for n in (64, 128, 200)],
]


def _seconds(cost: list[float], shape: tuple[int, int, int, int]) -> float:
    passes, drafts, pairs, fed = shape
    return cost[0] * passes + cost[1] * drafts + cost[2] * pairs + cost[3] * fed


def test_parts_off_by_different_factors_are_each_corrected():
    """A start-up fit whose per-pass part is half the truth (the proposer's host work) and
    whose fed tokens are priced like drafts (they cost a third): one shared factor misprices
    one kind of step or the other; a factor per part predicts every shape within 3%."""
    calibrated = [1e-4, 2e-5, 1e-9, 2e-5]
    truth = [2e-4, 2e-5, 1e-9, 0.67e-5]
    draft = DraftCost(*calibrated)
    rng = np.random.default_rng(0)
    for _ in range(400):
        shape = SHAPES[rng.integers(len(SHAPES))]
        noisy = _seconds(truth, shape) * rng.uniform(0.97, 1.03)
        draft.observe(*shape, noisy)
    for shape in SHAPES:
        assert draft.at(*shape) == pytest.approx(_seconds(truth, shape), rel=0.03)
    # One shared factor (the mean of the ratios) cannot: small steps and chunks pull apart.
    ratios = [_seconds(truth, s) / _seconds(calibrated, s) for s in SHAPES]
    shared = float(np.mean(ratios))
    assert max(abs(shared * _seconds(calibrated, s) / _seconds(truth, s) - 1) for s in SHAPES) > 0.3


def test_parts_the_steps_do_not_tell_apart_keep_their_calibration():
    """Steps that all draft K = 2 for 16 requests and feed nothing else say what that shape
    costs, not what a fed token costs: that part stays as calibrated."""
    draft = DraftCost(1e-4, 2e-5, 1e-9, 1e-5)
    shape = (2, 32, 32 * 200, 0)
    for _ in range(100):
        draft.observe(*shape, 1.5 * _seconds(draft.calibrated, shape))
    assert draft.at(*shape) == pytest.approx(1.5 * _seconds(draft.calibrated, shape), rel=0.02)
    assert draft.scales[3] == pytest.approx(1.0)
    assert draft.at(1, 0, 0, 100) == pytest.approx(draft.at(1, 0, 0, 0) + 100 * 1e-5)


def test_one_pause_moves_the_draft_fit_a_little():
    draft = DraftCost(1e-4, 2e-5, 1e-9, 1e-5)
    shape = (1, 16, 16 * 200, 0)
    for _ in range(50):
        draft.observe(*shape, _seconds(draft.calibrated, shape))
    before = draft.at(*shape)
    draft.observe(*shape, 10 * before)
    assert before < draft.at(*shape) < 1.1 * before
    # A model-free drafter costs nothing to predict and teaches nothing.
    free = DraftCost(0.0, 0.0, 0.0, 0.0)
    free.observe(2, 8, 100, 0, 1e-3)
    assert free.count == 0 and free.at(2, 8, 100) == 0.0


def test_calibration_separates_fed_tokens_from_drafts():
    """Decode batches (a draft per row) and prompt chunks (tokens fed, one logit) timed at
    start-up, weighted by their time: the fit recovers what each kind costs."""
    truth = np.array([1e-4, 3e-5, 2e-9, 1e-5])
    rows = [[1.0, b, b * ctx, 0.0] for b in (1, 2, 4, 8, 16, 64) for ctx in (64, 256)]
    rows += [[1.0, 1.0, n * ctx, n - 1.0] for ctx in (64, 256) for n in (16, 64)]
    a = np.array(rows)
    times = a @ truth
    fit = _nonneg_lstsq(a / times[:, None], np.ones(len(times)))
    assert fit == pytest.approx(truth.tolist(), rel=1e-6)


def test_cheap_catch_ups_let_a_lagging_request_draft_again():
    """A request 120 tokens behind its draft, charged 120 / 32 tokens a step: priced as
    drafts the catch-up outweighs a draft kept 60% of the time; priced at what a fed token
    costs (a quarter of a draft here), drafting pays again."""
    seconds = [0.0040, 0.0042] + [0.0042 + 0.001 * n for n in SIZES[2:]]

    def k_for(per_fed: float) -> int:
        cost = CostModel(SIZES, seconds, 0.0004, 0.0004, draft_per_fed=per_fed)
        policy = AdaptiveDraftLength(1, cost, probe_interval=10**6, reuse_steps=1)
        behind = _requests(1, accepted=60, trials=100, context=140)[0]
        behind.num_draft_computed_tokens = behind.num_tokens - 121
        return policy.choose([behind]).ks[0]

    assert k_for(0.0004) == 0
    assert k_for(0.0001) == 1
