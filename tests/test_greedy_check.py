"""bench/gpu_bench.py's greedy check: where two greedy outputs first differ, and the
reference's logit gap there (how near a tie the flip was)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bench.gpu_bench import compare, first_difference


class FixedLogits:
    """A stand-in reference model: the same logits after any input, inputs recorded."""

    device = torch.device("cpu")

    def __init__(self, logits: list[float]) -> None:
        self.logits = torch.tensor(logits)
        self.seen: list[list[int]] = []

    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        self.seen.append(ids[0].tolist())
        return SimpleNamespace(logits=self.logits.expand(1, ids.shape[1], -1))


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # the shorter ends there


def test_compare_without_a_model_counts_agreeing_prefixes():
    out = compare([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert out == {
        "greedy_match": False,
        "prompts": 2,
        "tokens_each": 3,
        "agreeing_prefix_mean": 2.0,
    }


def test_compare_reports_the_logit_gap_at_each_first_difference():
    model = FixedLogits([0.0, 3.0, 2.75, -1.0])
    prompts = [[7, 7], [8]]
    got, want = [[1, 1, 2], [1, 3]], [[1, 1, 1], [1, 3]]
    out = compare(got, want, prompts, model)
    assert out["greedy_match"] is False and out["agreeing_prefix_mean"] == (2 + 2) / 2
    # prompt 0 differs at position 2: HF's token 1 (logit 3.0) against Tandem's 2 (2.75)
    assert out["differences"] == [{"prompt": 0, "position": 2, "logit_gap": 0.25}]
    assert model.seen == [[7, 7, 1, 1]]  # the prompt and the agreed prefix, nothing more


def test_compare_with_a_model_and_no_difference():
    model = FixedLogits([1.0, 0.0])
    out = compare([[1, 0]], [[1, 0]], [[5]], model)
    assert out["greedy_match"] is True and out["differences"] == [] and model.seen == []
