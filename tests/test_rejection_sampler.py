"""The rejection sampler alone: exact greedy cases and a statistical test."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.cpu import kernels as cpu_kernels
from engine.cpu import sampling as cpu_sampling
from engine.sample.rejection_sampler import (
    PAD,
    emitted_tokens,
    greedy_verify,
    rejection_sample,
    verify_sampled,
)


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


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("draft_q", ["model_free", "one_hot"])
def test_greedy_verify_matches_both_methods_on_one_hot_rows(method, draft_q):
    """On one-hot rows (greedy and seeded requests) both methods keep exactly the drafts
    that match, whether q is absent (n-gram) or one-hot (a greedy draft model)."""
    gen = torch.Generator().manual_seed(0)
    vocab = 5
    for _ in range(200):
        ks = torch.randint(0, 5, (4,), generator=gen).tolist()
        argmax = torch.randint(0, vocab, (sum(ks) + len(ks),), generator=gen).tolist()
        drafts = [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in ks]
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
        q = _one_hot(flat.tolist(), vocab) if draft_q == "one_hot" and flat.numel() else None
        uniform = torch.zeros(len(argmax))
        out = rejection_sample(_one_hot(argmax, vocab), flat, q, ks, uniform, method)
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


def _chain_tables(vocab: int, depth: int, seed: int, zero_q: bool):
    """Random target and draft next-token tables keyed by prefix (tuples of token ids)."""
    g = torch.Generator().manual_seed(seed)

    def table(n: int, peaked: float) -> dict[tuple[int, ...], torch.Tensor]:
        out = {}
        for length in range(n):
            for prefix in itertools.product(range(vocab), repeat=length):
                out[prefix] = torch.softmax(torch.randn(vocab, generator=g) * peaked, 0).double()
        return out

    p, q = table(depth + 2, 1.5), table(depth, 1.2)
    if zero_q:  # q misses token 0 everywhere: such drafts never come up, p must still be met
        for prefix, dist in q.items():
            dist[0] = 0.0
            q[prefix] = dist / dist.sum()
    return p, q


def _rows(table: dict[tuple[int, ...], torch.Tensor], prefixes: torch.Tensor) -> torch.Tensor:
    """table[prefix] for each row of `prefixes` [n, length], stacked: `_chain_tables` keys
    are inserted by length, then in itertools.product order, so a prefix's place is its
    base-vocab number after the shorter ones."""
    vocab, length = len(next(iter(table.values()))), prefixes.shape[1]
    place = torch.full((len(prefixes),), sum(vocab**n for n in range(length)))
    for i in range(length):
        place = place + prefixes[:, i] * vocab ** (length - 1 - i)
    return torch.stack(list(table.values()))[place]


def _draw(rows: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One token per probability row, by inverse CDF."""
    u = torch.rand(len(rows), 1, generator=g, dtype=rows.dtype)
    return (rows.cumsum(-1) < u).sum(-1).clamp(max=rows.shape[1] - 1)


def _draft_chains(q, vocab: int, k: int, trials: int, g, model_free: bool) -> torch.Tensor:
    """[trials, k] drafts: each from q given the chain so far, or uniform (model-free)."""
    chains = torch.zeros(trials, 0, dtype=torch.long)
    for _ in range(k):
        if model_free:  # any drafts independent of the target's draws
            nxt = torch.randint(vocab, (trials,), generator=g)
        else:
            nxt = _draw(_rows(q, chains), g)
        chains = torch.cat([chains, nxt[:, None]], 1)
    return chains


def _along_chains(table, chains: torch.Tensor, positions: int) -> torch.Tensor:
    """table[chain[:j]] for j < positions, chain by chain: [trials * positions, vocab]."""
    rows = [_rows(table, chains[:, :j]) for j in range(positions)]
    return torch.stack(rows, 1).reshape(-1, rows[0].shape[1])


TRIALS = 40_000


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("drafter", ["model", "model_free", "zero_q"])
@pytest.mark.parametrize("path", ["tensors", "kernel"])
def test_multi_token_output_follows_the_target(method, drafter, path):
    """K = 3 drafts from a draft chain (or fixed model-free drafts): the first K + 1 tokens
    (kept drafts, the recovered or bonus token, then the target's own continuation) must be
    distributed as the target's K + 1 tokens, for both verification methods, on probability
    rows (`rejection_sample`) and on the CPU kernel that takes logits (`verify_sampled`)."""
    if path == "kernel" and not cpu_kernels.available():
        pytest.skip("Tandem's CPU kernels did not build")
    vocab, k, trials = 3, 3, TRIALS
    p, q = _chain_tables(vocab, k, seed=7, zero_q=drafter == "zero_q")
    g = torch.Generator().manual_seed(8)
    chains = _draft_chains(q, vocab, k, trials, g, model_free=drafter == "model_free")
    target = _along_chains(p, chains, k + 1)
    draft_probs = None if drafter == "model_free" else _along_chains(q, chains, k)
    flat = chains.flatten()
    uniform = torch.rand(trials * (k + 1), generator=g, dtype=torch.float64)
    if path == "kernel":  # logits whose softmax is p, at T = 1
        q32 = draft_probs.float() if draft_probs is not None else None
        emitted = verify_sampled(
            target.float().log(), [1.0] * trials, flat.tolist(), q32, [k] * trials, uniform, method
        )
        out = torch.tensor([e + [PAD] * (k + 1 - len(e)) for e in emitted])
    else:
        out = rejection_sample(target, flat, draft_probs, [k] * trials, uniform, method=method)

    seqs = out.clone()
    for j in range(k + 1):  # the target continues after the step
        missing = seqs[:, j] == PAD
        seqs[missing, j] = _draw(_rows(p, seqs[missing, :j]), g)
    cell = sum(seqs[:, j] * vocab ** (k - j) for j in range(k + 1))
    counts = torch.bincount(cell, minlength=vocab ** (k + 1)).double()
    exact = torch.tensor(
        [
            math.prod(p[seq[:i]][seq[i]].item() for i in range(k + 1))
            for seq in itertools.product(range(vocab), repeat=k + 1)
        ]
    )
    stat, cells = _chi_square(counts, exact), int((exact > 0).sum())
    dof = cells - 1
    bound = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3  # 99.9%
    assert stat < bound, f"chi-square {stat:.1f} >= {bound:.1f} ({dof} dof)"


def test_block_verification_keeps_at_least_as_many_drafts():
    """Same drafts, same draws: block verification keeps more drafts on average than token
    verification (never fewer in expectation; strictly more here), and where it keeps a
    draft that token verification rejected, that is the point of deciding jointly."""
    vocab, k, trials = 4, 3, 20_000
    p, q = _chain_tables(vocab, k, seed=3, zero_q=False)
    g = torch.Generator().manual_seed(4)
    chains = _draft_chains(q, vocab, k, trials, g, model_free=False)
    target, draft_probs = _along_chains(p, chains, k + 1), _along_chains(q, chains, k)
    flat = chains.flatten()
    uniform = torch.rand(trials * (k + 1), generator=g, dtype=torch.float64)
    kept = {}
    for method in ("token", "block"):
        out = rejection_sample(target, flat, draft_probs, [k] * trials, uniform, method=method)
        kept[method] = ((out != PAD).sum(dim=1) - 1).double()
    diff = kept["block"] - kept["token"]
    assert diff.mean() > 4 * diff.std() / math.sqrt(trials), kept


@pytest.mark.skipif(not cpu_kernels.available(), reason="Tandem's CPU kernels did not build")
@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("drafter", ["model", "model_free"])
def test_the_final_token_kernel_draws_what_the_tensor_residual_gives(method, drafter, monkeypatch):
    """On the CPU the recovered and bonus tokens come from one kernel call (csrc/sample.c)
    that computes the residual max(0, w p - q) a block at a time: for the same draws it must
    give the tokens the tensor formulas and `sample_from` give, for every request."""
    g = torch.Generator().manual_seed(11)
    vocab, ks = 3000, [2, 0, 1, 3, 1, 2]
    p = torch.softmax(3 * torch.randn(sum(ks) + len(ks), vocab, generator=g), -1)
    q = torch.softmax(3 * torch.randn(sum(ks), vocab, generator=g), -1)
    # Half the drafts the argmax of the row that checks them (often kept), half anywhere.
    rows = [sum(ks[:r]) + r + j for r, k in enumerate(ks) for j in range(k)]
    likely = p[rows].argmax(-1)
    anywhere = torch.randint(vocab, (sum(ks),), generator=g)
    drafts = torch.where(torch.arange(sum(ks)) % 2 == 0, likely, anywhere)
    draft_probs = q if drafter == "model" else None
    trials = [torch.rand(len(p), generator=g, dtype=torch.float64) for _ in range(60)]
    got = [emitted_tokens(p, drafts, draft_probs, ks, u, method) for u in trials]
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    want = [emitted_tokens(p, drafts, draft_probs, ks, u, method) for u in trials]
    assert got == want
    ends = {tuple(out[-1] for out in step) for step in got}
    assert len(ends) > 50  # the draws moved the final tokens
    kept = [len(out) - 1 for step in got for out in step]
    assert 0 < sum(kept) < sum(ks) * len(trials)  # both kept and rejected drafts


@pytest.mark.skipif(not cpu_kernels.available(), reason="Tandem's CPU kernels did not build")
def test_the_final_token_kernel_falls_back_to_p_where_the_residual_is_empty():
    """A rejected draft whose q covers w p everywhere leaves no residual mass: the token is
    then drawn from p, as the tensor path's guard does."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    u = [0.05, 0.25, 0.55, 0.95]
    for w in (1.0, 0.5):
        got = [cpu_sampling.sample_final(p, [0], p.clone(), [0], [2], [w], [x])[0] for x in u]
        assert got == [0, 1, 2, 3]  # p's own inverse CDF
    # A one-hot q (model-free) at token 3 with w = 1: the residual is p without token 3.
    got = [cpu_sampling.sample_final(p, [0], None, [0], [3], [1.0], [x])[0] for x in u]
    assert got == [0, 1, 2, 2]  # mass 0.1, 0.2, 0.3 over 0.6: 0.95 * 0.6 = 0.57 -> token 2


@pytest.mark.skipif(not cpu_kernels.available(), reason="Tandem's CPU kernels did not build")
@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("drafter", ["model", "model_free"])
def test_verifying_from_logits_in_one_call_decides_as_emitted_tokens(method, drafter):
    """csrc/sample.c `tandem_verify_sampled` (softmax rows, decisions, final token in one call)
    against `emitted_tokens` on the same softmax rows: the same kept drafts and final tokens
    for every request and draw, with requests at several temperatures and K = 0..3."""
    g = torch.Generator().manual_seed(12)
    vocab, ks, temps = 3000, [2, 0, 1, 3, 1, 2], [0.7, 1.0, 0.3, 1.3, 0.7, 0.9]
    logits = 3 * torch.randn(sum(ks) + len(ks), vocab, generator=g)
    inv_rows = [1 / t for t, k in zip(temps, ks, strict=True) for _ in range(k + 1)]
    everything = torch.arange(vocab)  # a "head" of every token: q is the softmax rows
    zeros = torch.zeros(len(logits), dtype=torch.float64)
    _, p = cpu_sampling.sample_head(logits, inv_rows, everything, zeros, vocab)
    q = torch.softmax(3 * torch.randn(sum(ks), vocab, generator=g), -1)
    rows = [sum(ks[:r]) + r + j for r, k in enumerate(ks) for j in range(k)]
    # Half the drafts the argmax of the row that checks them (often kept), half q's own
    # (rejected more often than not).
    drafts = torch.where(torch.arange(sum(ks)) % 2 == 0, p[rows].argmax(-1), q.argmax(-1))
    draft_probs = q if drafter == "model" else None
    trials = [torch.rand(len(p), generator=g, dtype=torch.float64) for _ in range(80)]
    got = [
        verify_sampled(logits, temps, drafts.tolist(), draft_probs, ks, u, method) for u in trials
    ]
    want = [emitted_tokens(p, drafts, draft_probs, ks, u, method) for u in trials]
    assert got == want
    kept = [len(out) - 1 for step in got for out in step]
    assert 0 < sum(kept) < sum(ks) * len(trials)  # both kept and rejected drafts
    assert len({tuple(out[-1] for out in step) for step in got}) > 70  # the draws moved them


@pytest.mark.skipif(not cpu_kernels.available(), reason="Tandem's CPU kernels did not build")
@pytest.mark.parametrize("method", ["token", "block"])
def test_a_draft_outside_the_vocabulary_is_rejected_in_the_one_call_path(method):
    """A draft row without mass draws the vocabulary's size (engine/cpu/sampling.py): the
    kernel reads its p and q as 0, so it is never kept, and the final token comes from the
    target's row, never from past its end."""
    g = torch.Generator().manual_seed(5)
    vocab = 50
    logits = torch.randn(3, vocab, generator=g)
    q = torch.softmax(torch.randn(2, vocab, generator=g), -1)
    for _ in range(20):
        u = torch.rand(3, generator=g, dtype=torch.float64)
        out = verify_sampled(logits, [0.8], [vocab, 3], q, [2], u, method)
        assert len(out[0]) == 1 and 0 <= out[0][0] < vocab
