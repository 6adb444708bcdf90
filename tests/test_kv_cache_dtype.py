"""--kv-cache-dtype: keys and values stored in 16 bits on the CPU (float16 or bfloat16), widened
exactly as attention reads them. The served numbers change (keys and values are rounded once,
as they are stored); everything after the rounding is what a float32 cache holding the
rounded values gives, bit for bit, and speculation stays lossless."""

from __future__ import annotations

import platform
import subprocess
import textwrap

import pytest
import torch

from engine.attention.cpu import CPU
from engine.attention.paged import build_metadata
from engine.attention.reference import REFERENCE, reference_attention
from engine.config import CacheConfig, SpecConfig
from engine.core.kv_budget import kv_cache_dtype
from engine.cpu import build as kernel_build
from engine.cpu import kernels as cpu_kernels
from tests.attention_helpers import poison_unread_slots
from tests.engine_utils import drain, greedy, make_engine, random_prompts

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"no CPU kernels: {cpu_kernels.unavailable_reason()}"
)
HALVES = [torch.float16, torch.bfloat16]
# Rounding's hard cases: ties (to even), values past float16's range and below its normals,
# signed zeros, infinities.
SPECIAL = [0.0, -0.0, 1.0, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-8, 1.0 + 3 * 2**-8,
           65504.0, 65519.0, 65520.0, 1e6, -1e6, 6.1e-5, 6.0e-8, 3.0e-8, 2.9e-8, 1e-10,
           -3.3e-6, 1.5e38, float("inf"), float("-inf")]  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("dtype", HALVES)
def test_rotary_cache_rounds_keys_and_values_as_torch_does(dtype):
    """The kernel's cache write of a 16-bit cache holds what torch's .to(dtype) makes of the
    float32 cache write (round to nearest even, overflow to inf), special values included."""
    heads, kv_heads, d, block, tokens = 4, 2, 16, 4, 6
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 30
    special = torch.tensor(SPECIAL)
    qkv[:, -len(SPECIAL) :] = special  # into the values, which are stored unrotated
    qkv[0, heads * d : heads * d + 5] = torch.tensor([65519.0, 65520.0, 3.0e-8, 1e-10, 0.5])
    angles = torch.rand(32, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions, slots = torch.tensor([0, 5, 6, 7, 31, 2]), torch.tensor([3, 9, 1, 0, 30, 17])
    wide = [torch.zeros(8, block, kv_heads, d) for _ in "kv"]
    narrow = [torch.zeros(8, block, kv_heads, d, dtype=dtype) for _ in "kv"]
    q = cpu_kernels.rotary_cache(qkv, positions, slots, cos, sin, heads, *wide)
    q16 = cpu_kernels.rotary_cache(qkv, positions, slots, cos, sin, heads, *narrow)
    assert torch.equal(q, q16)  # queries stay float32
    for w, n in zip(wide, narrow, strict=True):
        assert torch.equal(n.view(torch.int16), w.to(dtype).view(torch.int16))


def test_the_portable_conversions_round_as_torch_does(tmp_path):
    """vec.h's conversions without F16C and AVX2 (as on a CPU without them, or not x86):
    float32 -> float16 / bfloat16 -> float32, against torch, for the hard cases and a sweep."""
    cc = kernel_build.compiler()
    gen = torch.Generator().manual_seed(0)
    sweep = torch.randn(3000, generator=gen) * 10.0 ** torch.randint(-9, 6, (3000,), generator=gen)
    values = torch.cat([torch.tensor(SPECIAL), sweep])
    src = tmp_path / "conv.c"
    src.write_text(textwrap.dedent(f'''
        #include <stdio.h>
        #include "{kernel_build.CSRC / "vec.h"}"
        int main(void) {{
          float x;
          while (scanf("%a", &x) == 1) {{
            const uint16_t h = float_to_half(x), b = float_to_bf16(x);
            printf("%u %u %a %a\\n", h, b, half_to_float(h), kv_at(KV_BF16, &b, 0));
          }}
          return 0;
        }}
    '''))  # fmt: skip
    exe = tmp_path / "conv"
    x86 = platform.machine() in ("x86_64", "AMD64")
    flags = ["-O2", "-mno-f16c", "-mno-avx2"] if x86 else ["-O2"]
    subprocess.run([cc, *flags, str(src), "-o", str(exe), "-lm"], check=True)
    text = "\n".join(float(v).hex() for v in values.tolist())
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True)
    rows = [line.split() for line in out.stdout.splitlines()]
    assert len(rows) == len(values)
    half = torch.tensor([int(r[0]) for r in rows], dtype=torch.int32).to(torch.int16)
    bf16 = torch.tensor([int(r[1]) for r in rows], dtype=torch.int32).to(torch.int16)
    assert torch.equal(half, values.to(torch.float16).view(torch.int16))
    assert torch.equal(bf16, values.to(torch.bfloat16).view(torch.int16))
    back = torch.tensor([float.fromhex(r[2]) for r in rows])
    assert torch.equal(back, values.to(torch.float16).float())
    back = torch.tensor([float.fromhex(r[3]) for r in rows])
    assert torch.equal(back, values.to(torch.bfloat16).float())


@needs_kernels
@pytest.mark.parametrize("dtype", HALVES)
def test_attention_over_a_16_bit_cache_is_attention_over_its_values(dtype):
    """The C kernel (decodes, a verification, a tree-free batch beside a long query that goes
    to SDPA) and the reference path over a 16-bit cache give, bit for bit, what they give over
    a float32 cache holding the same values; unread slots stay unread."""
    heads, kv_heads, d, block = 9, 3, 64, 16
    q_lens, ctx_lens = [1, 5, 40, 1], [1, 37, 60, 250]
    gen = torch.Generator().manual_seed(7)
    blocks = sum(-(-c // block) for c in ctx_lens) + 2
    order = torch.randperm(blocks, generator=gen).tolist()
    tables, used = [], 0
    for ctx in ctx_lens:
        n = -(-ctx // block)
        tables.append(order[used : used + n])
        used += n
    k16, v16 = (torch.randn(blocks, block, kv_heads, d, generator=gen).to(dtype) for _ in "kv")
    query = torch.randn(sum(q_lens), heads, d, generator=gen)
    for backend in (CPU, REFERENCE):
        md = build_metadata([(k16, v16)], block, q_lens, ctx_lens, tables, "cpu", backend)
        got = backend.attend(query, k16, v16, md, 0.125)
        want = backend.attend(query, k16.float(), v16.float(), md, 0.125)
        assert torch.equal(got, want), backend
        if backend is CPU:  # the kernel's rows (SDPA's gathers whole blocks, masked)
            poisoned = poison_unread_slots(k16, v16, ctx_lens, tables)
            rows = [0, 1, 2, 3, 4, 5, 46]
            assert torch.equal(backend.attend(query, *poisoned, md, 0.125)[rows], got[rows])
    ref = build_metadata([(k16, v16)], block, q_lens, ctx_lens, tables, "cpu", REFERENCE)
    expected = reference_attention(query, k16, v16, ref, 0.125)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize(
    ("kv", "branches", "impl"),
    [("float16", 1, "auto"), ("bfloat16", 1, "auto"), ("float16", 2, "auto"),
     ("float16", 1, "transformers")],
)  # fmt: skip
def test_speculative_greedy_equals_plain_greedy_over_a_16_bit_cache(kv, branches, impl, tiny_dirs):
    """Over a 16-bit cache the pool holds twice the blocks of a float32 one for the same
    bytes, and speculation stays lossless: draft and target both store and read 16 bits, chains
    and draft trees (whose accepted path's keys and values are moved) alike, on the native
    forward and on transformers' (which writes the cache through engine/attention/paged.py)."""
    prompts = random_prompts([5, 17, 40], vocab=300, seed=11)
    spec = SpecConfig(
        method="draft", draft_model=str(tiny_dirs["llama_draft"]), draft_length="fixed",
        draft_branches=branches,
    )  # fmt: skip
    outputs = []
    for spec_config in (None, spec):
        engine = make_engine(
            tiny_dirs["llama"], spec=spec_config, max_num_batched_tokens=32, kv_cache_dtype=kv,
            model_impl=impl,
        )  # fmt: skip
        assert engine.runner.model_impl == ("transformers" if impl == "transformers" else "native")
        for runner in engine.runners:
            assert runner.kv_caches[0][0].dtype == getattr(torch, kv)
            wide = runner.kv_bytes_per_block(4) * (1 if runner.kv_dtype == torch.float32 else 2)
            assert wide == 2 * runner.num_layers * 4 * runner.num_kv_heads * runner.head_dim * 4
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy(12))
        outputs.append(drain(engine))
        engine.check_invariants()
        if spec_config is not None and branches > 1:
            assert engine.stats().spec_tree_steps > 0
    assert outputs[0] == outputs[1]


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        CacheConfig(kv_cache_dtype="fp8")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kv_cache_dtype("auto", cpu, torch.float32) == torch.float32
    assert kv_cache_dtype("float16", cpu, torch.float32) == torch.float16
    assert kv_cache_dtype("bfloat16", cpu, torch.float32) == torch.bfloat16
    assert kv_cache_dtype("auto", cuda, torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("bfloat16", cuda, torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="runs on the CPU"):
        kv_cache_dtype("float16", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="does not read"):
        cpu_kernels.kv_type(torch.float64)
