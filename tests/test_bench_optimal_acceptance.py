"""bench/optimal_acceptance.py's math against an independent max-flow on small alphabets.

The best acceptance of n drafts is a matching between p and the random draft set S: a max
flow from the draft sets (capacity P(S = T)) through the tokens they contain to the sink
(capacity p(x)). The bench computes it through the min-cut dual instead (a subset scan).
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import pytest

from bench.optimal_acceptance import (
    _draft_sets,
    greedy_sampler_optimum,
    optimum,
    rrs,
    rrs_iid_full,
)

pytestmark = pytest.mark.bench


def _max_flow(set_probs: dict[int, float], p: np.ndarray) -> float:
    m = len(p)
    sets = [t for t, w in set_probs.items() if w > 0]
    # nodes: 0 source, 1..len(sets) sets, then m tokens, then the sink
    n_nodes = 2 + len(sets) + m
    sink = n_nodes - 1
    cap = np.zeros((n_nodes, n_nodes))
    for i, t in enumerate(sets):
        cap[0, 1 + i] = set_probs[t]
        for x in range(m):
            if t >> x & 1:
                cap[1 + i, 1 + len(sets) + x] = 2.0  # unbounded
    for x in range(m):
        cap[1 + len(sets) + x, sink] = p[x]
    flow = 0.0
    while True:
        parent = [-1] * n_nodes
        parent[0] = 0
        queue = deque([0])
        while queue and parent[sink] < 0:
            u = queue.popleft()
            for v in np.nonzero(cap[u] > 1e-15)[0]:
                if parent[v] < 0:
                    parent[v] = u
                    queue.append(v)
        if parent[sink] < 0:
            return flow
        path, v = [], sink
        while v != 0:
            path.append((parent[v], v))
            v = parent[v]
        push = min(cap[u, v] for u, v in path)
        for u, v in path:
            cap[u, v] -= push
            cap[v, u] += push
        flow += push


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("replacement", [True, False])
def test_optimum_equals_max_flow(n, replacement):
    rng = np.random.default_rng(10 * n + replacement)
    m, pos = 5, 6
    p = rng.dirichlet([0.7] * m, size=pos)
    q = rng.dirichlet([0.7] * m, size=pos)
    got = optimum(p, q, n, replacement)
    sets = _draft_sets(q, n, replacement)
    assert np.allclose(sets.sum(1), 1)
    for i in range(pos):
        want = _max_flow(dict(enumerate(sets[i])), p[i])
        assert got[i] == pytest.approx(want, abs=1e-9)
    # Recursive rejection sampling is a verifier: it cannot beat the optimum; with one draft
    # both are sum min(p, q).
    assert np.all(rrs(p, q, n, replacement) <= got + 1e-9)
    if n == 1:
        assert np.allclose(got, np.minimum(p, q).sum(1))
        assert np.allclose(rrs(p, q, 1, replacement), got)


@pytest.mark.parametrize("n", [2, 3])
def test_greedy_sampler_optimum_equals_max_flow(n):
    rng = np.random.default_rng(n)
    m, pos = 6, 6
    p = rng.dirichlet([0.7] * m, size=pos)
    q = rng.dirichlet([0.7] * m, size=pos)
    q[:, -1] = 0  # the last bin stands for "the rest": never one of the fixed drafts
    q /= q.sum(1, keepdims=True)
    got = greedy_sampler_optimum(p, q, n)
    for i in range(pos):
        top = list(np.argsort(-q[i, :-1])[: n - 1])
        rest = [x for x in range(m) if x not in top]
        mass = q[i, rest].sum()
        sets = {}
        for x in rest:
            t = sum(1 << y for y in top) | 1 << x
            sets[t] = sets.get(t, 0.0) + q[i, x] / mass
        assert got[i] == pytest.approx(_max_flow(sets, p[i]), abs=1e-9)


def test_rrs_matches_simulation():
    """RRS's exact expectation against simulating its rule (drafts without replacement)."""
    rng = np.random.default_rng(3)
    m, n = 4, 3
    p = rng.dirichlet([1.0] * m, size=1)
    q = rng.dirichlet([1.0] * m, size=1)
    exact = rrs(p, q, n, False)[0]
    trials, hits = 100_000, 0
    for _ in range(trials):
        residual, qcur = p[0].copy(), q[0].copy()
        for _ in range(n):
            x = rng.choice(m, p=qcur)
            if rng.random() < min(1.0, residual[x] / qcur[x]):
                hits += 1
                break
            residual = np.clip(residual - qcur, 0, None)
            residual /= residual.sum()
            qcur[x] = 0
            qcur /= qcur.sum()
    assert abs(hits / trials - exact) < 4 * np.sqrt(exact * (1 - exact) / trials)


def test_draft_sets_enumerate_every_draw():
    q = np.array([[0.5, 0.3, 0.2]])
    sets = _draft_sets(q, 2, False)[0]
    # {0,1}: 0.5*0.3/0.5 + 0.3*0.5/0.7
    assert sets[0b011] == pytest.approx(0.5 * 0.6 + 0.3 * 0.5 / 0.7)
    assert sets[0b001] == 0  # without replacement no set has one element
    with_repl = _draft_sets(q, 2, True)[0]
    assert with_repl[0b001] == pytest.approx(0.25)
    assert list(itertools.compress(range(8), sets > 0)) == [3, 5, 6]


def test_rrs_iid_closed_form_equals_enumeration():
    rng = np.random.default_rng(4)
    p = rng.dirichlet([0.8] * 5, size=4)
    q = rng.dirichlet([0.8] * 5, size=4)
    for n in (1, 2, 3):
        assert np.allclose(rrs_iid_full(p, q, n), rrs(p, q, n, True))
