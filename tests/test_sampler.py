"""The sampler's distributions: greedy rows are one-hot at the argmax in any batch."""

from __future__ import annotations

import pytest
import torch

from engine.core.request import Request, SamplingParams
from engine.sample.sampler import RowSpec, logits_to_probs, request_uniforms, sample_from


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


def test_seeded_requests_draw_the_same_stream():
    def draws(seed: int) -> list[float]:
        req = Request("r", [1], SamplingParams(temperature=0.7, seed=seed))
        req.generator = torch.Generator().manual_seed(seed)  # as LLMEngine.enqueue seeds it
        return request_uniforms([req, req], [2, 1], torch.device("cpu")).tolist()

    assert draws(5) == draws(5) != draws(6)


@pytest.mark.gpu
def test_draws_and_samples_stay_on_the_engines_device():
    """On CUDA a request's generator is a CUDA generator: its draws are made there."""
    device = torch.device("cuda")
    req = Request("r", [1], SamplingParams(temperature=0.7, seed=3))
    req.generator = torch.Generator(device=device).manual_seed(3)
    uniform = request_uniforms([req], [4], device)
    assert uniform.device.type == "cuda" and uniform.dtype == torch.float64
    probs = torch.softmax(torch.randn(4, 50, device=device), dim=-1)
    tokens = sample_from(probs, uniform)
    assert tokens.device.type == "cuda" and bool(((tokens >= 0) & (tokens < 50)).all())
