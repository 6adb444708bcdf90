"""The native forward's fused Triton kernels (engine/model/native/triton_ops.py) against the
torch operators they replace: on the CPU through Triton's interpreter (conftest.py), on CUDA
compiled (gpu tests)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.backends import triton_available
from engine.model.inputs import SeqInput
from engine.model.native.llama import _rms_norm, _rotate
from engine.model.runner import ModelRunner
from tests.engine_utils import random_prompts

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# bfloat16 on CUDA only: Triton's interpreter truncates to bfloat16 where a GPU rounds.
CASES = [
    ("cpu", torch.float32),
    pytest.param("cuda", torch.float32, marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module")
def ops():
    from engine.attention import triton_kernel
    from engine.model.native import triton_ops

    if not torch.cuda.is_available() and not triton_kernel.INTERPRETED:
        pytest.skip("no CUDA and Triton is not interpreted here")
    return triton_ops


def _on(device: str) -> torch.device:
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("Triton is compiled for the GPU here: the cuda cases run")
    return torch.device(device)


def _close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6) -> None:
    """Equal up to a unit in the last place of the type (float32: a few; the kernels may
    order a sum or contract a multiply-add differently from torch), or `atol`."""
    step = 1e-5 if want.dtype == torch.float32 else 2.0**-6  # bfloat16: 8 significant bits
    gap = (got.float() - want.float()).abs()
    assert (gap <= step * want.float().abs() + atol).all(), f"largest gap {gap.max():.3g}"


@pytest.mark.parametrize(("device", "dtype"), CASES)
def test_rms_norm_is_transformers_rms_norm(ops, device, dtype):
    dev = _on(device)
    g = torch.Generator().manual_seed(1)
    for rows, n in ((5, 96), (3, 576)):  # 576: not a power of two
        x = (3 * torch.randn(rows, n, generator=g)).to(dev, dtype)
        w = (1 + torch.randn(n, generator=g) / 4).to(dev, dtype)
        _close(ops.rms_norm(x, w, 1e-5), _rms_norm(x, w, 1e-5))


@pytest.mark.parametrize(("device", "dtype"), CASES)
def test_rotary_cache_is_rotate_then_cache_write(ops, device, dtype):
    dev = _on(device)
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, d, tokens, blocks, block = 9, 3, 64, 7, 4, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dev, dtype)
    angles = torch.randn(32, d // 2, generator=g)
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dev, dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dev, dtype)
    positions = torch.tensor([0, 5, 6, 6, 31, 2, 9], device=dev)
    slots = torch.tensor([3, 4, 5, 6, 7, 12, 1], device=dev)
    poison = torch.full((blocks, block, kv_heads, d), float("nan"), dtype=dtype, device=dev)
    key_cache, value_cache = poison.clone(), poison.clone()

    q = ops.rotary_cache(
        qkv, cos, sin, positions, slots, key_cache, value_cache, heads, kv_heads, d
    )

    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want_q = _rotate(qkv[:, : heads * d].view(tokens, heads, d), c, s)
    want_k = _rotate(qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d), c, s)
    want_v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
    # x cos + rotate(x) sin: two products that may nearly cancel, so the gap is measured
    # against the products' size (up to ~4 here; a unit in bfloat16's last place there is
    # 2^-6, seen on an H100), not the result's.
    atol = 1e-6 if dtype == torch.float32 else 2.0**-5
    _close(q, want_q, atol)
    flat_k, flat_v = key_cache.view(-1, kv_heads, d), value_cache.view(-1, kv_heads, d)
    _close(flat_k[slots], want_k, atol)
    torch.testing.assert_close(flat_v[slots], want_v, rtol=0, atol=0)
    untouched = torch.ones(blocks * block, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert flat_k[untouched.to(dev)].isnan().all() and flat_v[untouched.to(dev)].isnan().all()


@pytest.mark.parametrize(("device", "dtype"), CASES)
def test_silu_mul_is_silu_times_up(ops, device, dtype):
    dev = _on(device)
    gate_up = (4 * torch.randn(6, 2 * 1536, generator=torch.Generator().manual_seed(3))).to(
        dev, dtype
    )
    want = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    _close(ops.silu_mul(gate_up), want)


@pytest.mark.parametrize("device", DEVICES)
def test_a_native_forward_on_the_fused_kernels_gives_the_torch_forward(ops, tiny_dirs, device):
    """The whole model (prefill, then a verification of 3 tokens beside a decode) on
    `forward_triton` against the torch operators, float32."""
    dev = _on(device)
    logits = {}
    for fused in (False, True):
        runner = ModelRunner(str(tiny_dirs["llama"]), dev, torch.float32, "triton", "native")
        runner.native.triton_ops = fused
        runner.allocate_kv(32, 4)
        a, b = random_prompts([9, 6], runner.vocab_size, seed=71)
        first = runner.forward([SeqInput(a, 0, [0, 1, 2, 3], [8]), SeqInput(b, 0, [4, 5], [5])])
        second = runner.forward(
            [SeqInput([5, 6, 7], 9, [0, 1, 2, 3], [0, 1, 2]), SeqInput([8], 6, [4, 5], [0])]
        )
        logits[fused] = torch.cat([first, second])
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_the_native_forward_takes_the_fused_kernels_on_cuda(tiny_dirs):
    runner = ModelRunner(str(tiny_dirs["llama"]), torch.device("cuda"), torch.bfloat16, "triton")
    assert runner.model_impl == "native" and runner.kernels == "triton"
    assert runner.native.triton_ops
