"""The sampler's distributions: greedy rows are one-hot at the argmax in any batch."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.cpu import kernels as cpu_kernels
from engine.cpu import sampling as cpu_sampling
from engine.sample.sampler import (
    RowSpec,
    couple_seeded_rows,
    coupled_tokens,
    coupled_winner,
    logits_to_probs,
    plain_sampling,
    race_key,
    race_times,
    request_uniforms,
    sample_from,
    sample_logits,
    target_tokens,
)
from engine.types.request import Request, SamplingParams


def _rows(temperatures: list[float]) -> list[RowSpec]:
    return [
        RowSpec(Request(f"r{i}", [1, 2], SamplingParams(temperature=t, seed=i)))
        for i, t in enumerate(temperatures)
    ]


def test_greedy_rows_are_the_same_alone_and_beside_sampled_rows():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    alone = logits_to_probs(logits[[0, 2]], _rows([0.0, 0.0]))  # the all-greedy path
    mixed = logits_to_probs(logits, _rows([0.0, 0.7, 0.0]))
    torch.testing.assert_close(alone, mixed[[0, 2]], rtol=0, atol=0)
    assert torch.equal(alone.argmax(-1), logits[[0, 2]].argmax(-1))
    assert torch.equal(alone.sum(-1), torch.ones(2)) and int((alone > 0).sum()) == 2
    torch.testing.assert_close(mixed[1], torch.softmax(logits[1] / 0.7, -1))


def test_greedy_draws_are_zero_and_sampling_picks_the_argmax():
    rows = _rows([0.0, 0.0])
    uniform = request_uniforms([r.request for r in rows], [2, 1], torch.device("cpu"))
    assert torch.equal(uniform, torch.zeros(3, dtype=torch.float64))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    probs = logits_to_probs(logits, _rows([0.0, 0.0, 0.0]))
    assert torch.equal(sample_from(probs, uniform), logits.argmax(-1))
    # Any draw picks the one token of a one-hot row.
    assert torch.equal(sample_from(probs, torch.full((3,), 1 - 1e-17)), logits.argmax(-1))


def test_inverse_cdf_sampling_follows_the_distribution_and_skips_zero_mass():
    """sample_from against the distribution it is given (unnormalised, zero-mass tokens at
    both ends and inside): a chi-square goodness-of-fit test, and the edges of [0, 1)."""
    g = torch.Generator().manual_seed(2)
    mass = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 2.5, 0.0, 1.0, 2.0, 0.0])
    trials = 40_000
    uniform = torch.rand(trials, generator=g, dtype=torch.float64)
    drawn = sample_from(mass.expand(trials, -1), uniform)
    counts = torch.bincount(drawn, minlength=len(mass)).double()
    assert counts[mass == 0].sum() == 0
    expected = mass[mass > 0].double() / mass.sum() * trials
    chi2 = float(((counts[mass > 0] - expected) ** 2 / expected).sum())
    assert chi2 < 22.46  # 99.9th percentile of chi-square with 6 degrees of freedom
    edges = sample_from(mass.expand(2, -1), torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64))
    assert edges.tolist() == [1, 8]  # the first and the last token with mass


def _cdf_sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The float64-CDF definition sample_from's torch path computes."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    point = torch.minimum(uniform[:, None] * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True)[:, 0]


@pytest.mark.skipif(not cpu_kernels.available(), reason="Tandem's CPU kernels did not build")
@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152])
def test_the_cpu_kernel_samples_as_the_float64_cdf_does(vocab):
    """engine/cpu/csrc/sample.c (blocks of 256, then a scan of one) against the float64 CDF:
    the same token for every draw here (they can differ only within a float64 rounding of a
    boundary), always a token with mass, on rows with mass everywhere, only at the start, only
    at the end, on one token, and at the edges of [0, 1)."""
    g = torch.Generator().manual_seed(vocab)
    rows = []
    for sharpness in (0.5, 2.0, 6.0):
        rows.append(torch.softmax(torch.randn(vocab, generator=g) * sharpness, -1))
    head, tail, single = rows[0].clone(), rows[1].clone(), torch.zeros(vocab)
    head[max(1, vocab // 10) :] = 0
    tail[: vocab - max(1, vocab // 10)] = 0
    single[vocab // 3] = 0.25
    probs = torch.stack([*rows, head, tail, single]).repeat(40, 1)
    uniform = torch.rand(probs.shape[0], generator=g, dtype=torch.float64)
    uniform[:6], uniform[6:12] = 0.0, 1 - 2**-53
    got = cpu_sampling.sample_rows(probs, uniform)
    assert torch.equal(got, _cdf_sample(probs, uniform))
    assert bool((probs.gather(1, got[:, None]) > 0).all())
    assert torch.equal(sample_from(probs, uniform), got)  # the CPU path of sample_from


@pytest.mark.skipif(not cpu_kernels.available(), reason="Tandem's CPU kernels did not build")
@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152])
def test_sampling_from_logits_draws_as_the_softmax_then_the_cdf_does(vocab, monkeypatch):
    """engine/cpu/csrc/sample.c's logits path (the softmax's numerators, never written out)
    against torch's softmax of logits / T sampled by the float64 CDF: the same token for every
    draw here (they can differ only within a rounding of a boundary), at several temperatures,
    on rows with masked (-inf) tokens, and at the edges of [0, 1); `sample_logits` gives them
    on the kernel and on torch's path (what other devices run)."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=g) * torch.tensor([0.5, 2, 6, 3, 3, 1, 4, 8])[:, None]
    logits[3, : max(1, vocab // 2)] = float("-inf")  # masked: a stop token, a grammar
    logits[4, 1:] = float("-inf")  # one token left
    logits = logits.repeat(30, 1)
    temperatures = [0.1, 0.7, 1.0, 1.5, 0.7, 2.0, 0.3, 1.0] * 30
    uniform = torch.rand(logits.shape[0], generator=g, dtype=torch.float64)
    uniform[:8], uniform[8:16] = 0.0, 1 - 2**-53
    scale = torch.tensor(temperatures)[:, None]
    expected = _cdf_sample(torch.softmax(logits / scale, dim=-1), uniform)
    got = cpu_sampling.sample_logits(logits, [1 / t for t in temperatures], uniform)
    assert torch.equal(got, expected)
    assert bool((logits.gather(1, got[:, None]) > float("-inf")).all())
    assert torch.equal(sample_logits(logits, temperatures, uniform), got)  # the CPU path
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert torch.equal(sample_logits(logits, temperatures, uniform), expected)


@pytest.mark.skipif(not cpu_kernels.available(), reason="Tandem's CPU kernels did not build")
def test_a_row_without_finite_mass_gets_the_vocabulary_size_as_sample_rows_gives_it():
    bad = torch.zeros(4, 300)
    bad[0, 5] = float("nan")
    bad[1] = float("-inf")
    bad[2, 3] = float("inf")
    bad[3, 7] = 1.0  # a sound row among them
    uniform = torch.full((4,), 0.5, dtype=torch.float64)
    got = cpu_sampling.sample_logits(bad, [1.0] * 4, uniform).tolist()
    assert (
        got[:3]
        == [300] * 3
        == cpu_sampling.sample_rows(torch.softmax(bad[:3], -1), uniform[:3]).tolist()
    )
    assert 0 <= got[3] < 300


@pytest.mark.skipif(not cpu_kernels.available(), reason="Tandem's CPU kernels did not build")
@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152])
def test_drafts_over_a_restricted_head_are_drawn_from_the_q_they_return(vocab):
    """csrc/sample.c `tandem_sample_head`: q is torch's softmax of logits / T on the head's
    tokens (within float32 rounding) and 0 elsewhere, each row's q the same bits alone or in a
    batch, a row without finite mass NaN with the vocabulary's size as its token; the token is
    the float64 CDF's draw from q over the head's tokens (here the same token for every draw,
    near the edges of [0, 1) too)."""
    g = torch.Generator().manual_seed(vocab)
    head = torch.randperm(vocab, generator=g)[: max(1, vocab // 3)].sort().values
    n = len(head)
    logits = torch.randn(8, n, generator=g) * torch.tensor([0.5, 2, 6, 3, 3, 1, 4, 8])[:, None]
    logits[3, : max(1, n // 2)] = float("-inf")
    logits[4, 1:] = float("-inf")  # one token left
    logits = logits.repeat(8, 1)
    temperatures = [0.1, 0.7, 1.0, 1.5, 0.7, 2.0, 0.3, 1.0] * 8
    uniform = torch.rand(logits.shape[0], generator=g, dtype=torch.float64)
    uniform[:8], uniform[8:16] = 0.0, 1 - 1e-9  # (1 - 2**-53 lands within a rounding of the total)
    tokens, q = cpu_sampling.sample_head(
        logits, [1 / t for t in temperatures], head, uniform, vocab
    )
    want = torch.zeros(len(logits), vocab)
    want[:, head] = torch.softmax(logits / torch.tensor(temperatures)[:, None], dim=-1)
    torch.testing.assert_close(q, want, rtol=2e-5, atol=1e-7)
    assert torch.equal(q[:, head].sum(-1) > 0, torch.ones(len(q), dtype=torch.bool))
    assert tokens == head[_cdf_sample(q[:, head], uniform)].tolist()
    assert set(tokens) <= set(head.tolist()) and tokens[4] == int(head[0])
    for r in (0, 5):
        _, alone = cpu_sampling.sample_head(
            logits[r : r + 1], [1 / temperatures[r]], head, uniform[r : r + 1], vocab
        )
        assert torch.equal(alone[0], q[r])
    bad = torch.zeros(3, n)
    bad[0, n // 2] = float("nan")
    bad[1] = float("-inf")
    bad[2, n - 1] = float("inf")
    tokens, q = cpu_sampling.sample_head(bad, [1.0] * 3, head, uniform[:3], vocab)
    assert tokens == [vocab] * 3 and bool(q[:, head].isnan().all())


def test_plain_sampling_is_temperature_alone():
    assert plain_sampling(SamplingParams(temperature=0.7))
    assert not plain_sampling(SamplingParams(temperature=0.0))  # greedy: one-hot
    assert not plain_sampling(SamplingParams(temperature=0.7, seed=3))  # the coupled race
    assert not plain_sampling(SamplingParams(temperature=0.7, top_k=20))
    assert not plain_sampling(SamplingParams(temperature=0.7, top_p=0.9))


def test_a_requests_generator_gives_its_stream():
    def draws(seed: int) -> list[float]:
        req = Request("r", [1], SamplingParams(temperature=0.7))
        req.generator = torch.Generator().manual_seed(seed)  # as LLMEngine.enqueue seeds it
        return request_uniforms([req, req], [2, 1], torch.device("cpu")).tolist()

    assert draws(5) == draws(5) != draws(6)


def test_seeded_noise_depends_on_seed_position_and_token_only():
    tokens = np.arange(1000)
    alone = race_times(11, 5, tokens)
    assert np.array_equal(race_times(11, 5, tokens[[7, 3]]), alone[[7, 3]])  # token by token
    assert not np.array_equal(race_times(11, 6, tokens), alone)
    assert not np.array_equal(race_times(12, 5, tokens), alone)
    assert bool((alone > 0).all()) and len(set(alone.tolist())) > 990
    # Exp(1): mean 1, P(E > 1) = 1/e, within a few standard errors over 1000 tokens.
    assert abs(alone.mean() - 1) < 0.15 and abs((alone > 1).mean() - np.exp(-1)) < 0.06


def test_coupled_race_equals_the_plain_race_and_follows_p():
    """The pruned race picks argmin E / p over the whole vocabulary exactly, and over seeds
    it samples p; top-k and top-p rows race over what they keep."""
    gen = torch.Generator().manual_seed(3)
    vocab = 50
    logits = torch.randn(vocab, generator=gen) * 2
    logits[7] = float("-inf")  # a token without mass never wins
    logits[9] = -60.0  # nor, in practice, one this far below the others
    p = torch.softmax(logits, -1).double()
    counts = torch.zeros(vocab)
    for seed in range(4000):
        row = RowSpec(Request("r", [1], SamplingParams(temperature=1.0, seed=seed)))
        token = coupled_tokens(logits[None], [row])[0]
        times = torch.from_numpy(race_times(seed, 0, np.arange(vocab)))
        assert token == int((times / p).argmin())
        counts[token] += 1
    expected = p * 4000
    keep = expected > 1e-9
    assert counts[~keep].sum() == 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert chi2 < 85.35  # 99.9th percentile of chi-square with 48 degrees of freedom
    top3 = SamplingParams(temperature=1.0, seed=0, top_k=3)
    allowed = set(logits.topk(3).indices.tolist())
    picks = {coupled_tokens(logits[None], [RowSpec(Request("r", [1], replace(top3, seed=s)))])[0]
             for s in range(200)}  # fmt: skip
    assert picks == allowed


@pytest.mark.skipif(not cpu_kernels.available(), reason="Tandem's CPU kernels did not build")
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernels_race_is_the_numpy_race(threads):
    """CPU rows race in C (engine/cpu/csrc/sample.c): the same token as `coupled_winner` on
    the rows over their temperatures, of every spread, with masked (-inf) tokens, one row or
    several (a row split between threads); a NaN row is left to numpy (-1)."""
    gen, before = torch.Generator().manual_seed(0), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for trial in range(120):
            vocab, rows = (50, 1003, 49152)[trial % 3], (4, 1, 2)[trial // 3 % 3]
            spread = float(torch.rand(1, generator=gen)) * 8 + 0.3
            z = torch.randn(rows, vocab, generator=gen) * spread
            z[rows // 2, : vocab // 2] = float("-inf")
            z[-1, 5] = z[-1].max() + 30  # one token far ahead: it nearly always wins
            t = [(1.0, 0.7, 0.31, 1.3)[(trial + j) % 4] for j in range(rows)]
            keys = [race_key(trial, position) for position in range(rows)]
            expected = [coupled_winner((z[j] / t[j]).numpy(), trial, j) for j in range(rows)]
            assert cpu_sampling.race_rows(z, t, keys) == expected
        # Two logits a float apart with one quotient: the first is the top, as numpy's argmax.
        z, t = torch.randn(2, 49152, generator=gen), 3.0
        top = np.float32(13.0)  # quotients in [4, 8) are spaced wider than 13's floats / 3
        while np.nextafter(top, np.float32(0)) / np.float32(t) != top / np.float32(t):
            top = np.nextafter(top, np.float32(0))
        z[:, 100], z[:, 30000] = float(np.nextafter(top, np.float32(0))), float(top)
        keys = [race_key(7, position) for position in range(2)]
        expected = [coupled_winner((z[j] / t).numpy(), 7, j) for j in range(2)]
        assert cpu_sampling.race_rows(z, [t, t], keys) == expected
        z = torch.randn(4, 4099, generator=gen)
        z[0, 3] = float("nan")
        z[3] = float("-inf")
        keys = [race_key(1, position) for position in range(4)]
        raced = cpu_sampling.race_rows(z, [0.7] * 4, keys)
        assert raced[0] == -1 and raced[3] == -1 and min(raced[1:3]) >= 0
    finally:
        torch.set_num_threads(before)


def test_seeded_rows_are_one_hot_at_their_coupled_sample():
    seeded = Request("a", [1], SamplingParams(temperature=1.0, seed=4))
    plain = Request("b", [1], SamplingParams(temperature=1.0))
    greedy = Request("c", [1], SamplingParams(temperature=0.0))
    rows = [RowSpec(seeded), RowSpec(plain), RowSpec(seeded, [7]), RowSpec(greedy)]
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, rows)
    coupled = couple_seeded_rows(probs.clone(), rows, logits)
    assert torch.equal(coupled[1], probs[1]) and torch.equal(coupled[3], probs[3])
    for i, position in ((0, 0), (2, 1)):  # output positions 0 and 1 (one prior draft)
        token = coupled_tokens(
            logits[i : i + 1], [RowSpec(Request("c", [1], seeded.params), [7] * position)]
        )[0]
        assert coupled[i].sum() == 1 and coupled[i, token] == 1
    # The verifier's one-hot tokens: the race's for seeded rows, the argmax for greedy ones.
    one_hot = [rows[i] for i in (0, 2, 3)]
    assert target_tokens(logits[[0, 2, 3]], one_hot) == coupled[[0, 2, 3]].argmax(-1).tolist()
    assert request_uniforms([seeded], [3], torch.device("cpu")).tolist() == [0.0] * 3


@pytest.mark.gpu
def test_draws_and_samples_stay_on_the_engines_device():
    """On CUDA a request's generator is a CUDA generator: its draws are made there."""
    device = torch.device("cuda")
    req = Request("r", [1], SamplingParams(temperature=0.7))
    req.generator = torch.Generator(device=device).manual_seed(3)
    uniform = request_uniforms([req], [4], device)
    assert uniform.device.type == "cuda" and uniform.dtype == torch.float64
    probs = torch.softmax(torch.randn(4, 50, device=device), dim=-1)
    tokens = sample_from(probs, uniform)
    assert tokens.device.type == "cuda" and bool(((tokens >= 0) & (tokens < 50)).all())


def test_argmax_is_the_first_largest_index_as_torch_gives_it():
    from engine.sample.sampler import argmax

    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (64, 300), generator=gen).float()  # many ties in each row
    logits[5, 7] = float("nan")  # a NaN counts as the largest
    logits[9, :] = float("-inf")
    for rows in (logits, logits[::2], logits.double()):
        got = argmax(rows)
        assert got.dtype == torch.int64 and torch.equal(got, rows.argmax(dim=-1))
    assert argmax(logits)[5] == 7
