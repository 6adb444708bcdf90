"""The draft-tree verifier alone: greedy paths, and the exact distribution of its output."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.sample.tree_verifier import DraftTree, verify_tree, verify_tree_greedy

VOCAB, TRIALS = 4, 30_000


def test_greedy_keeps_the_longest_matching_path():
    # root -> a (1), b (2); a -> c (0); b -> d (2), e (1)
    tree = DraftTree([7, 1, 2, 0, 2, 1], [-1, 0, 0, 1, 2, 2])
    # target after root: 2 (b), after b: 1 (e), after e: 0 -> path b, e then 0
    argmax = [2, 0, 1, 9, 9, 0]
    assert verify_tree_greedy(tree, argmax) == ([2, 5], 0)
    assert verify_tree_greedy(tree, [0, 0, 1, 9, 9, 0]) == ([], 0)  # no child matches
    one_hot = torch.nn.functional.one_hot(torch.tensor([2, 0, 1, 0, 0, 0]), 3).double()
    assert verify_tree(tree, one_hot, None, torch.zeros(7)) == ([2, 5], 0)


def test_a_tree_lists_parents_first():
    with pytest.raises(ValueError):
        DraftTree([1, 2, 3], [-1, 2, 0])
    assert DraftTree([1, 2, 3], [-1, 0, 1]).ancestors(2) == [0, 1, 2]


def _tables(seed: int, peaked: float = 1.5):
    g = torch.Generator().manual_seed(seed)
    dists = {}
    for length in range(4):
        for prefix in itertools.product(range(VOCAB), repeat=length):
            dists[prefix] = torch.softmax(torch.randn(VOCAB, generator=g) * peaked, 0).double()
    return dists


@pytest.mark.parametrize("drafter", ["model", "model_free"])
def test_tree_output_follows_the_target(drafter):
    """Root with three children (drawn without replacement), each with one child: the first
    three tokens (kept path, emitted token, then the target's continuation) must follow the
    target's distribution of three tokens."""
    p, q = _tables(11, peaked=0.7), _tables(12, peaked=2.5)
    g = torch.Generator().manual_seed(13)
    counts = torch.zeros(VOCAB**3)
    kept = 0
    for _ in range(TRIALS):
        if drafter == "model":
            first = torch.multinomial(q[()], 3, replacement=False, generator=g).tolist()
            second = [int(torch.multinomial(q[(x,)], 1, generator=g)) for x in first]
        else:  # distinct candidates and arbitrary continuations
            first = torch.randperm(VOCAB, generator=g)[:3].tolist()
            second = torch.randint(VOCAB, (3,), generator=g).tolist()
        tree = DraftTree([0, *first, *second], [-1, 0, 0, 0, 1, 2, 3])
        prefixes = [(), *((x,) for x in first), *zip(first, second, strict=True)]
        target = torch.stack([p[pre] for pre in prefixes])
        draft = None if drafter == "model_free" else torch.stack([q[pre] for pre in prefixes])
        uniform = torch.rand(len(prefixes) + 1, generator=g, dtype=torch.float64)
        path, token = verify_tree(tree, target, draft, uniform)
        kept += len(path)
        seq = tuple(tree.tokens[v] for v in path) + (token,)
        while len(seq) < 3:
            seq += (int(torch.multinomial(p[seq], 1, generator=g)),)
        counts[sum(t * VOCAB**i for i, t in enumerate(reversed(seq[:3])))] += 1
    exact = torch.tensor(
        [
            math.prod(p[s[:i]][s[i]].item() for i in range(3))
            for s in itertools.product(range(VOCAB), repeat=3)
        ]
    )
    expected = exact * TRIALS
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = VOCAB**3 - 1
    bound = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3  # 99.9%
    assert stat < bound, f"chi-square {stat:.1f} >= {bound:.1f}"
    assert kept > 0.5 * TRIALS  # three candidates per level: drafts do get kept


def test_a_second_candidate_raises_acceptance():
    """Same target and draft, one candidate against two (without replacement): the first
    position is accepted more often with two, as recursive rejection sampling promises."""
    p, q = _tables(21), _tables(22)
    g = torch.Generator().manual_seed(23)
    hits = {1: 0, 2: 0}
    for _ in range(4000):
        for n in (1, 2):
            first = torch.multinomial(q[()], n, replacement=False, generator=g).tolist()
            tree = DraftTree([0, *first], [-1] + [0] * n)
            target = torch.stack([p[()]] + [p[(x,)] for x in first])
            draft = torch.stack([q[()]] + [q[(x,)] for x in first])
            uniform = torch.rand(n + 2, generator=g, dtype=torch.float64)
            hits[n] += len(verify_tree(tree, target, draft, uniform)[0])
    assert hits[2] > hits[1] + 4 * math.sqrt(hits[1])
