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


def _count(counts: torch.Tensor, seq: tuple[int, ...], p, g: torch.Generator) -> None:
    """Count the first three tokens: the verified ones, then the target's continuation."""
    while len(seq) < 3:
        seq += (int(torch.multinomial(p[seq], 1, generator=g)),)
    counts[sum(t * VOCAB**i for i, t in enumerate(reversed(seq[:3])))] += 1


def _assert_follows_target(counts: torch.Tensor, p) -> None:
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
        _count(counts, tuple(tree.tokens[v] for v in path) + (token,), p, g)
    _assert_follows_target(counts, p)
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


def test_top_drafts_output_follows_the_target_and_beats_sampled_drafts():
    """The greedy draft sampler: the top two tokens of q fixed, a third drawn from q without
    them; its optimal verifier keeps the output exact (three tokens, chi-square) and its
    first-position acceptance matches 1 - sum_{x not top} max(0, p(x) - q'(x))."""
    p, q = _tables(11, peaked=0.7), _tables(12, peaked=2.5)
    g = torch.Generator().manual_seed(14)
    counts = torch.zeros(VOCAB**3)
    first_kept = 0
    top2 = q[()].topk(2).indices.tolist()
    rest = q[()].clone()
    rest[top2] = 0
    rest /= rest.sum()
    for _ in range(TRIALS):
        third = int(torch.multinomial(rest, 1, generator=g))
        first = [*top2, third]
        second = [int(torch.multinomial(q[(x,)], 1, generator=g)) for x in first]
        tree = DraftTree([0, *first, *second], [-1, 0, 0, 0, 1, 2, 3], fixed_root_children=2)
        prefixes = [(), *((x,) for x in first), *zip(first, second, strict=True)]
        target = torch.stack([p[pre] for pre in prefixes])
        draft = torch.stack([q[pre] for pre in prefixes])
        uniform = torch.rand(len(prefixes) + 1, generator=g, dtype=torch.float64)
        path, token = verify_tree(tree, target, draft, uniform)
        first_kept += bool(path)
        _count(counts, tuple(tree.tokens[v] for v in path) + (token,), p, g)
    _assert_follows_target(counts, p)
    off_top = p[()].clone()
    off_top[top2] = 0
    optimum = 1 - float((off_top - rest).clamp(min=0).sum())
    rate = first_kept / TRIALS
    assert abs(rate - optimum) < 4 * math.sqrt(optimum * (1 - optimum) / TRIALS) + 1e-9
