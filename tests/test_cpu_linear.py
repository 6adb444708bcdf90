"""Packed linears on the CPU (Tandem's C GEMM): same results as nn.Linear, lossless end to end."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import SpecConfig
from engine.cpu import linear as cpu_linear
from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts

pytestmark = pytest.mark.skipif(
    not cpu_linear.available(), reason="Tandem's CPU kernels did not build (no C compiler?)"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 64])
def test_packed_linear_matches_nn_linear(rows: int, bias: bool):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    packed = cpu_linear.PackedLinear(linear)
    x = torch.randn(1, rows, 96)  # the packed batch shape the runner feeds
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert packed.weight is linear.weight  # parameters shared, not copied


def test_pack_linears_replaces_every_linear_and_only_those():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    assert cpu_linear.pack_linears(model) == 2
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("PackedLinear") == 2 and "Linear" not in kinds


def test_packed_target_stays_lossless(tiny_dirs):
    """Greedy speculative output with packed models (and, native, the fused layer kernels)
    equals HF's greedy output."""
    target = tiny_dirs["llama"]
    prompts = random_prompts([5, 12, 20, 33], vocab=300, seed=41)
    expected = hf_greedy(target, prompts, 24)
    spec = SpecConfig("draft", str(target), max_draft_tokens=4, draft_length="fixed")
    engine = make_engine(target, spec=spec, cpu_packed_linear=True)
    assert any(type(m) is cpu_linear.PackedLinear for m in engine.runner.forward_module.modules())
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, greedy(24))
    outputs = drain(engine)
    assert [outputs[f"p{i}"] for i in range(4)] == expected
    assert engine.stats().spec_accepted_tokens > 0  # verification passes of 5 rows ran
