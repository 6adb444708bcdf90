"""bench/acceptance_weight.py's fit: the weight that predicts a request's next chains best."""

import numpy as np

from bench.acceptance_weight import WEIGHTS, fit


def _best_weights(rates: list[float], chains: int = 80, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    requests = [list((rng.random(chains) < r).astype(int)) for r in rates]
    return [WEIGHTS[int(np.argmin(errors))] for _, _, errors in fit(requests)]


def test_requests_that_differ_favour_their_own_chains():
    best = _best_weights([0.05, 0.95] * 20)
    assert all(w <= 8 for w in best)


def test_requests_alike_favour_the_engine_wide_rate():
    best = _best_weights([0.6] * 40)
    assert all(w >= 32 for w in best)
