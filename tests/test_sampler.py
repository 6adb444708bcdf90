"""The sampler's distributions: greedy rows are one-hot at the argmax in any batch."""

from __future__ import annotations

import torch

from engine.request import Request, SamplingParams
from engine.sampler import RowSpec, exponential_noise, logits_to_probs, sample_from


def _rows(temperatures: list[float]) -> list[RowSpec]:
    return [
        RowSpec(Request(f"r{i}", [1, 2], SamplingParams(temperature=t, seed=i)), 0)
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


def test_greedy_noise_is_ones_and_sampling_picks_the_argmax():
    rows = _rows([0.0, 0.0])
    noise = exponential_noise([r.request for r in rows], [2, 1], 50, torch.device("cpu"))
    assert torch.equal(noise, torch.ones(3, 50))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    probs = logits_to_probs(logits, _rows([0.0, 0.0, 0.0]))
    assert torch.equal(sample_from(probs, noise), logits.argmax(-1))
