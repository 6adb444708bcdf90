"""The rejection sampler alone: exact greedy cases and a statistical test."""

from __future__ import annotations

import torch

from engine.sample.rejection_sampler import PAD, greedy_verify, rejection_sample


def _one_hot(ids: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_greedy_accepts_matching_prefix_then_emits_target_argmax():
    vocab = 6
    # Request 0: target argmax per row 1, 2, 3, 4; drafts 1, 2, 5 -> accept 2, recover 3.
    # Request 1: target 0, 0; draft 0 -> accept it, bonus 0.
    # Request 2: no drafts -> just the target's token 5.
    target = _one_hot([1, 2, 3, 4, 0, 0, 5], vocab)
    drafts = torch.tensor([1, 2, 5, 0])
    out = rejection_sample(target, drafts, None, [3, 1, 0], torch.zeros(7))
    assert out.tolist() == [[1, 2, 3, PAD], [0, 0, PAD, PAD], [5, PAD, PAD, PAD]]


def test_greedy_verify_matches_rejection_sampling_on_one_hot_rows():
    gen = torch.Generator().manual_seed(0)
    vocab = 5
    for _ in range(200):
        ks = torch.randint(0, 5, (4,), generator=gen).tolist()
        argmax = torch.randint(0, vocab, (sum(ks) + len(ks),), generator=gen).tolist()
        drafts = [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in ks]
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
        out = rejection_sample(_one_hot(argmax, vocab), flat, None, ks, torch.zeros(len(argmax)))
        expected = [[t for t in row if t != PAD] for row in out.tolist()]
        assert greedy_verify(argmax, drafts) == expected


def test_first_draft_rejected_gives_recovered_token_only():
    target = _one_hot([4, 4, 4], 5)
    out = rejection_sample(target, torch.tensor([1, 4]), None, [2], torch.zeros(3))
    assert out.tolist() == [[4, PAD, PAD]]


def test_draft_with_zero_probability_is_never_accepted():
    target = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    draft_probs = torch.tensor([[0.0, 0.0, 1.0]])
    for u in (0.0, 0.5):
        out = rejection_sample(target, torch.tensor([2]), draft_probs, [1], torch.tensor([u, u]))
        assert out[0, 0].item() != 2 and out[0, 1].item() == PAD


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability zero"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# 99.9th percentile of chi-square with 7 degrees of freedom: a correct sampler fails ~1/1000.
CHI2_7_999 = 24.32


def test_emitted_token_follows_the_target_distribution():
    """With one draft from q, the first emitted token (accepted or recovered) must be ~ p."""
    g = torch.Generator().manual_seed(0)
    vocab, trials = 8, 40_000
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=0)
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=0)
    p[3], q[5] = 0.0, 0.0  # zero-probability tokens on both sides
    p, q = p / p.sum(), q / q.sum()
    drafts = torch.multinomial(q, trials, replacement=True, generator=g)
    target = p.expand(2 * trials, vocab).contiguous()
    out = rejection_sample(
        target,
        drafts,
        q.expand(trials, vocab).contiguous(),
        [1] * trials,
        torch.rand(2 * trials, generator=g, dtype=torch.float64),
    )
    first = torch.bincount(out[:, 0], minlength=vocab).float()
    assert _chi_square(first, p) < CHI2_7_999
    # The acceptance rate is sum(min(p, q)).
    accepted = (out[:, 1] != PAD).float().mean().item()
    assert abs(accepted - torch.minimum(p, q).sum().item()) < 0.01


def test_model_free_draft_is_one_hot_q():
    """An n-gram draft has no q: the first emitted token must still be ~ p."""
    g = torch.Generator().manual_seed(1)
    vocab, trials = 8, 40_000
    p = torch.softmax(torch.randn(vocab, generator=g), dim=0)
    drafts = torch.full((trials,), 2)
    out = rejection_sample(
        p.expand(2 * trials, vocab).contiguous(),
        drafts,
        None,
        [1] * trials,
        torch.rand(2 * trials, generator=g, dtype=torch.float64),
    )
    first = torch.bincount(out[:, 0], minlength=vocab).float()
    assert _chi_square(first, p) < CHI2_7_999
    accepted = (out[:, 1] != PAD).float().mean().item()
    assert abs(accepted - p[2].item()) < 0.01
