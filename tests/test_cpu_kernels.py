"""Tandem's CPU kernels (engine/cpu/csrc) against torch, their build, and the engine on them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.attention.backends import BACKENDS, select_backend
from engine.attention.cpu import CPU, STACK_MAX_QUERY
from engine.attention.paged import build_metadata
from engine.attention.reference import REFERENCE, reference_attention
from engine.config import SpecConfig
from engine.cpu import build as kernel_build
from engine.cpu import kernels as cpu_kernels
from engine.cpu import panels as cpu_panels
from engine.cpu.gguf_blocks import q4_0_as_q4_1
from engine.model.inputs import SeqInput
from engine.model.on_cpu import use_cpu_kernels
from engine.model.runner import ModelRunner
from tests.attention_helpers import poison_unread_slots
from tests.engine_utils import drain, greedy, make_engine, random_prompts

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"no CPU kernels: {cpu_kernels.unavailable_reason()}"
)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 70])
@pytest.mark.parametrize("out_features,in_features", [(16, 8), (17, 33), (300, 64)])
def test_linear_matches_torch(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    res = torch.randn(rows, out_features, generator=gen)
    panels = cpu_panels.pack_linear_weight(w)
    expected = F.linear(x, w, b)
    torch.testing.assert_close(cpu_kernels.linear(x, panels, b, out_features), expected)
    torch.testing.assert_close(
        cpu_kernels.linear(x, panels, None, out_features), F.linear(x, w), rtol=1e-5, atol=1e-5
    )
    got = cpu_kernels.linear(x, panels, b, out_features, residual=res.clone())
    torch.testing.assert_close(got, expected + res)


def test_bfloat16_panels_only_when_exact_and_then_bit_identical():
    """A bfloat16 checkpoint loaded in float32 packs to bfloat16 panels (half the bytes) with
    the float32 panels' results bit for bit; weights with more precision stay float32."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(40, 24, generator=gen).bfloat16().float()
    b, x = torch.randn(40, generator=gen), torch.randn(9, 24, generator=gen)
    narrow, wide = cpu_panels.pack_linear_weight(w), cpu_panels.pack_linear_weight(w, False)
    assert narrow.dtype == torch.bfloat16 and wide.dtype == torch.float32
    assert narrow.numel() == wide.numel()
    for rows in (1, 5, 9):
        got = cpu_kernels.linear(x[:rows], narrow, b, 40)
        assert torch.equal(got, cpu_kernels.linear(x[:rows], wide, b, 40))
        torch.testing.assert_close(got, F.linear(x[:rows], w, b))
    w[3, 5] += 1e-3  # no longer a bfloat16 value
    assert cpu_panels.pack_linear_weight(w).dtype == torch.float32


AMX_MIN_ROWS = 6  # AMX_MIN_ROWS in engine/cpu/csrc/gemm_quant.c


def _unit_switch(unit: str, switch):
    """`switch` (cpu_kernels.set_amx or set_vnni: it returns whether the unit is now on,
    never where the CPU or the OS has none) for a test, put back as it was afterwards."""
    before = f"+{unit}" in (cpu_kernels.isa() or "")
    yield switch
    switch(before)


@pytest.fixture
def amx():
    yield from _unit_switch("amx", cpu_kernels.set_amx)


@pytest.fixture
def vnni():
    yield from _unit_switch("vnni", cpu_kernels.set_vnni)


def _gguf_case(quant: str, out_features: int, in_features: int):
    """(GGUF panels, their dequantized float32 weights, a bias, a generator); Q4_0 blocks
    are packed as the Q4_1 blocks the engine runs them as (engine/cpu/gguf_blocks.py)."""
    gguf = pytest.importorskip("gguf")
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=gen)
    kind = gguf.GGMLQuantizationType[quant]
    blocks = gguf.quants.quantize(w.numpy(), kind)
    dequantized = torch.from_numpy(gguf.quants.dequantize(blocks, kind).astype("float32"))
    b = torch.randn(out_features, generator=gen)
    if quant == "Q4_0":
        blocks, quant = q4_0_as_q4_1(blocks), "Q4_1"
    return cpu_panels.pack_quant_weight(blocks, quant), dequantized, b, gen


def _q4_1_minimums(quant: str, out_features: int, in_features: int) -> torch.Tensor:
    """The Q4_1 blocks' minimums m (w = d q + m) [out, in / 32] of `_gguf_case`'s weights."""
    gguf = pytest.importorskip("gguf")
    w = torch.randn(
        out_features, in_features, generator=torch.Generator().manual_seed(out_features)
    )
    blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[quant])
    if quant == "Q4_0":
        blocks = q4_0_as_q4_1(blocks)
    m = blocks.reshape(out_features, -1, 20)[:, :, 2:4].copy().view("float16")
    return torch.from_numpy(m.astype("float64")).reshape(out_features, -1)


@pytest.mark.parametrize("quant", [*cpu_panels.QUANT_TYPES, "Q4_0"])
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (37, 96), (300, 576)])
@pytest.mark.parametrize("use_vnni", [False, True])
def test_gguf_blocks_sum_as_closely_as_the_dequantized_weights_and_rows_keep_their_bits(
    quant, out_features, in_features, use_vnni, amx, vnni
):
    """Q8_0 / Q4_1 blocks: per block the quants' products summed, then scaled (gemm_quant.c,
    or with VNNI gemm_vnni.c: x in 24-bit fixed point per block, integer sums).
    As close to the exact (float64) result as the float32 panels of gguf's own dequantization
    (within 4x: on a single Q4_1 block the minimum's term cancels against the scaled sum,
    2.5x on average, 3x without FMA instructions; from a few blocks on the block sums are
    closer to it than the panels),
    and a row's output is the same bits in every call of the vector kernel, whatever the
    other rows: with AMX tiles on, calls of fewer than AMX_MIN_ROWS rows."""
    if vnni(use_vnni) != use_vnni:
        pytest.skip("no AVX-512 VNNI on this machine")
    quantized, dequantized, b, gen = _gguf_case(quant, out_features, in_features)
    quant = "Q4_1" if quant == "Q4_0" else quant  # the kernel's type (see _gguf_case)
    wide = cpu_panels.pack_linear_weight(dequantized, allow_bf16=False)
    assert quantized.numel() < wide.numel() * 4 / 3  # 5 (Q4_1) or 8.5 (Q8_0) bits a weight
    x = torch.randn(17, in_features, generator=gen) * 4
    res = torch.randn(17, out_features, generator=gen)
    amx(False)
    full = cpu_kernels.linear(x, quantized, b, out_features, res.clone(), quant)
    exact = x.double() @ dequantized.double().T + b.double() + res.double()
    error = (full.double() - exact).abs()
    panels = (cpu_kernels.linear(x, wide, b, out_features, res.clone()).double() - exact).abs()
    assert error.mean() <= 4 * panels.mean() and error.max() <= 4 * panels.max()
    if use_vnni:  # the integer sums did run: another rounding order
        vnni(False)
        other = cpu_kernels.linear(x, quantized, b, out_features, res.clone(), quant)
        assert not torch.equal(full, other)
        vnni(True)
    order = torch.randperm(17, generator=gen)
    shuffled = cpu_kernels.linear(x[order], quantized, b, out_features, res[order], quant)
    assert torch.equal(shuffled, full[order])
    for tiles in (False, True):
        if amx(tiles) != tiles:
            continue  # no AMX here: the first pass was the only kernel
        for rows in range(1, AMX_MIN_ROWS if tiles else 18):  # every tile shape, and tails
            part = slice(17 - rows, 17)
            got = cpu_kernels.linear(x[part], quantized, b, out_features, res[part].clone(), quant)
            assert torch.equal(got, full[part]), (tiles, rows)


@pytest.fixture
def activations():
    """cpu_kernels.use_activations for a test; float32 again afterwards."""
    yield cpu_kernels.use_activations
    cpu_kernels.use_activations("float32")


@pytest.mark.parametrize("quant", [*cpu_panels.QUANT_TYPES, "Q4_0"])
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (37, 96), (300, 576)])
def test_int8_activations_are_x_rounded_per_block_and_rows_keep_their_bits(
    quant, out_features, in_features, activations, amx
):
    """--cpu-activations int8: per row and block of 32, x becomes round(x * 127 / max|x|)
    times max|x| / 127 and is multiplied exactly (the Q4_1 minimum's term takes x itself):
    the result is that product within float32's rounding, not the float32 kernel's, and a
    row's output is the same bits in every call, AMX tiles on or off (they never run)."""
    if not activations("int8"):
        pytest.skip("no AVX-512 VNNI on this machine")
    quantized, dequantized, b, gen = _gguf_case(quant, out_features, in_features)
    kind = "Q4_1" if quant == "Q4_0" else quant  # the kernel's type (see _gguf_case)
    x = torch.randn(17, in_features, generator=gen) * 4
    res = torch.randn(17, out_features, generator=gen)
    amx(False)
    full = cpu_kernels.linear(x, quantized, b, out_features, res.clone(), kind)
    blocks = x.reshape(17, -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    rounded = (torch.round(blocks * (127 / top)).double() * (top / 127).double()).reshape(x.shape)
    expected = rounded @ dequantized.double().T + b.double() + res.double()
    if quant in ("Q4_1", "Q4_0"):  # w = d q + m: m's term takes x itself
        minimum = _q4_1_minimums(quant, out_features, in_features)
        expected += (x.double() - rounded).reshape(17, -1, 32).sum(-1) @ minimum.T
    scale = expected.abs().max()
    assert (full.double() - expected).abs().max() <= 1e-6 * scale
    activations("float32")
    as_float = cpu_kernels.linear(x, quantized, b, out_features, res.clone(), kind)
    assert (full - as_float).abs().max() > 1e-4 * scale  # x was rounded
    activations("int8")
    for tiles in (False, True):
        amx(tiles)
        for rows in range(1, 18):  # every tile shape, and tails
            part = slice(17 - rows, 17)
            got = cpu_kernels.linear(x[part], quantized, b, out_features, res[part].clone(), kind)
            assert torch.equal(got, full[part]), (tiles, rows)


@pytest.mark.parametrize("quant", cpu_panels.QUANT_TYPES)
def test_vnni_sums_keep_non_finite_inputs_and_zero_blocks(quant, vnni):
    """A block of x holding inf or NaN gives NaN or inf where float32 sums would, not a
    finite number from a wrapped integer; an all-zero block adds only the bias."""
    if not vnni(True):
        pytest.skip("no AVX-512 VNNI on this machine")
    quantized, dequantized, b, gen = _gguf_case(quant, 16, 64)
    x = torch.randn(3, 64, generator=gen)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    x[2] = 0.0
    got = cpu_kernels.linear(x, quantized, b, 16, None, quant)
    assert got[0].isnan().all()
    assert not got[1].isfinite().any()
    assert torch.equal(got[2], b)


@pytest.mark.parametrize("quant", cpu_panels.QUANT_TYPES)
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (37, 96), (300, 576)])
def test_gguf_blocks_on_amx_tiles_sum_as_closely_and_rows_do_not_depend_on_the_batch(
    quant, out_features, in_features, amx
):
    """From AMX_MIN_ROWS rows on, the tiles (engine/cpu/csrc/gemm_amx.c) compute the same
    sums in another order: as close to the exact (float64) result as the vector kernel
    (within 2x: one lost bfloat16 part of x would be ~100x off), and each row's output the
    same bits in every call, whatever the other rows."""
    if not amx(True):
        pytest.skip("no AMX tiles on this machine (or TANDEM_AMX=0)")
    quantized, dequantized, b, gen = _gguf_case(quant, out_features, in_features)
    x = torch.randn(40, in_features, generator=gen) * 4
    res = torch.randn(40, out_features, generator=gen)
    exact = x.double() @ dequantized.double().T + b.double() + res.double()
    tiles = cpu_kernels.linear(x, quantized, b, out_features, res.clone(), quant)
    amx(False)
    vector = cpu_kernels.linear(x, quantized, b, out_features, res.clone(), quant)
    assert amx(True)
    tiles_error = (tiles.double() - exact).abs().max().item()
    vector_error = (vector.double() - exact).abs().max().item()
    assert tiles_error <= 2 * vector_error, (tiles_error, vector_error)
    assert not torch.equal(tiles, vector)  # the tiles did run: another rounding order
    order = torch.randperm(40, generator=gen)
    shuffled = cpu_kernels.linear(x[order], quantized, b, out_features, res[order], quant)
    assert torch.equal(shuffled, tiles[order])
    for start, rows in [(0, AMX_MIN_ROWS), (3, 17), (17, 23)]:  # 16-row tiles and tails
        part = slice(start, start + rows)
        got = cpu_kernels.linear(x[part], quantized, b, out_features, res[part].clone(), quant)
        assert torch.equal(got, tiles[part])


def test_linear_rows_do_not_depend_on_the_batch():
    """A row's output is bit-identical whether it is computed alone or among others."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(100, 48, generator=gen), torch.randn(13, 48, generator=gen)
    panels = cpu_panels.pack_linear_weight(w)
    together = cpu_kernels.linear(x, panels, None, 100)
    for i in range(13):
        assert torch.equal(cpu_kernels.linear(x[i : i + 1], panels, None, 100)[0], together[i])


def test_elementwise_kernels_match_torch():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(7, 96, generator=gen), torch.randn(96, generator=gen)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (96,), w, 1e-5))
    for inter in (40, 37):  # vectors of 8, and a tail
        gu = torch.randn(5, 2 * inter, generator=gen) * 4
        gu[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 90.0])  # past exp's clamps
        torch.testing.assert_close(cpu_kernels.silu_mul(gu), F.silu(gu[:, :inter]) * gu[:, inter:])


def test_rotary_cache_matches_torch():
    heads, kv_heads, d, block, tokens = 4, 2, 16, 4, 6
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)
    angles = torch.rand(32, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions = torch.tensor([0, 5, 6, 7, 31, 2])
    slots = torch.tensor([3, 9, 1, 0, 30, 17])
    k_cache, v_cache = torch.zeros(8, block, kv_heads, d), torch.zeros(8, block, kv_heads, d)
    q = cpu_kernels.rotary_cache(qkv, positions, slots, cos, sin, heads, k_cache, v_cache)

    def rotate(x):  # x [tokens, h, d]
        c, s = cos[positions][:, None], sin[positions][:, None]
        return x * c + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1) * s

    q_ref = rotate(qkv[:, : heads * d].view(tokens, heads, d))
    k_ref = rotate(qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d))
    v_ref = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k_cache.view(-1, kv_heads, d)[slots], k_ref)
    assert torch.equal(v_cache.view(-1, kv_heads, d)[slots], v_ref)
    untouched = torch.ones(8 * block, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(-1, kv_heads, d)[untouched].any()


def _paged_case(q_lens, ctx_lens, heads, kv_heads, d, block, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block) for c in ctx_lens) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()  # scattered block tables
    tables, used = [], 0
    for ctx in ctx_lens:
        n = -(-ctx // block)
        tables.append(order[used : used + n] + [0, 0])  # longer than needed, as in the engine
        used += n
    k_cache = torch.randn(num_blocks, block, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_blocks, block, kv_heads, d, generator=gen)
    query = torch.randn(sum(q_lens), heads, d, generator=gen)
    return query, k_cache, v_cache, tables


@pytest.mark.parametrize(
    "heads,kv_heads,d,block",
    [(4, 2, 16, 4), (8, 4, 64, 16), (6, 2, 32, 16), (4, 4, 128, 1), (2, 1, 80, 32), (2, 2, 96, 5)],
)
def test_cpu_backend_matches_the_reference(heads, kv_heads, d, block):
    """Decodes, verifications, a prefill chunk and a request with one key, in one batch,
    against the reference backend: every one of them on the kernel."""
    q_lens = [1, 5, 1, STACK_MAX_QUERY + 3, 17, 1]
    ctx_lens = [1, 37, 250, 60, 17, 16]
    query, k_cache, v_cache, tables = _paged_case(q_lens, ctx_lens, heads, kv_heads, d, block, d)
    scale = d**-0.5
    caches = [(k_cache, v_cache)]
    ref = build_metadata(caches, block, q_lens, ctx_lens, tables, torch.device("cpu"), REFERENCE)
    md = build_metadata(caches, block, q_lens, ctx_lens, tables, torch.device("cpu"), CPU)
    assert md.kernel_seqs is not None and not md.groups  # nothing went to SDPA
    expected = reference_attention(query, k_cache, v_cache, ref, scale)
    got = CPU.attend(query, k_cache, v_cache, md, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 8])
@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (9, 3), (4, 1)])
def test_attention_rows_do_not_depend_on_the_batch(heads, kv_heads, threads, monkeypatch):
    """Each query's output is bit-identical attended alone (a decode at its position) or as
    one query of a verification beside other requests: a tile's rows, and the pairs of rows
    that share loads, differ between the two (9 heads over 3: odd groups of rows), and so do
    the threads' shares of the work. The verifications' queries sit on both sides of the
    kernel's key spans' borders (multiples of 64 keys: 128, 256), where a row's spans are
    merged."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    d, block = 64, 16
    # The verifications' queries sit at 35..39, 125..129 and 254..256.
    q_lens, ctx_lens = [5, 1, 5, 3], [40, 90, 130, 257]
    query, k_cache, v_cache, tables = _paged_case(q_lens, ctx_lens, heads, kv_heads, d, block, 3)
    caches = [(k_cache, v_cache)]
    both = build_metadata(caches, block, q_lens, ctx_lens, tables, "cpu", CPU)
    together = CPU.attend(query, k_cache, v_cache, both, 0.125)
    row = 0
    for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        for j in range(q_len):
            alone = build_metadata(caches, block, [1], [ctx - q_len + j + 1], tables[s : s + 1],
                                   "cpu", CPU)  # fmt: skip
            single = CPU.attend(query[row : row + 1], k_cache, v_cache, alone, 0.125)
            assert torch.equal(together[row], single[0]), (s, j)
            row += 1
    # The kernel scores 8 keys at a time past a request's last key (then masks them): NaN in
    # every slot that holds no key changes nothing.
    poisoned = poison_unread_slots(k_cache, v_cache, ctx_lens, tables)
    assert torch.equal(CPU.attend(query, *poisoned, both, 0.125), together)


def test_unsupported_shapes_are_refused():
    assert cpu_kernels.attention_supports(8, 4, 64, 16)
    assert not cpu_kernels.attention_supports(8, 4, 48, 16)  # head size not compiled
    assert not cpu_kernels.attention_supports(8, 3, 64, 16)  # heads not a multiple
    assert not cpu_kernels.attention_supports(8, 4, 64, 512)  # block past MAX_BLOCK


def test_backend_selection_on_the_cpu(monkeypatch):
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu) == "cpu"
    assert select_backend("auto", cpu, torch.bfloat16) == "reference"
    with pytest.raises(ValueError, match="float32 on the CPU"):
        select_backend("cpu", cpu, torch.bfloat16)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert select_backend("auto", cpu) == "reference"
    with pytest.raises(ValueError, match="install a C compiler"):
        select_backend("cpu", cpu)


def test_runner_falls_back_for_a_head_size_the_kernel_lacks(tmp_path, tiny_dirs):
    from tests.tiny_models import build_model

    odd = build_model(
        tmp_path / "odd", hidden_size=48, num_heads=2, tokenizer_dir=tiny_dirs["llama"]
    )
    runner = ModelRunner(str(odd), torch.device("cpu"), torch.float32, "cpu")  # head_dim 24
    assert runner.attention_backend is BACKENDS["reference"]


def test_native_forward_on_the_kernels_matches_transformers(tiny_dirs):
    runner = ModelRunner(str(tiny_dirs["llama"]), torch.device("cpu"), torch.float32, "cpu")
    assert use_cpu_kernels(runner) == "native forward on the C kernels"
    assert runner.native.cpu_kernels
    assert runner.native_error(runner.native) < 1e-4


def test_a_verification_pass_gives_the_decode_pass_logits(tiny_dirs):
    """On the kernels every step of the forward is computed per row, so a token's logits in
    a 1 + K verification pass equal, bit for bit, those of a plain decode of that token."""
    runner = ModelRunner(str(tiny_dirs["llama"]), torch.device("cpu"), torch.float32, "cpu")
    use_cpu_kernels(runner)
    runner.allocate_kv(32, 4)
    prompt = random_prompts([9], vocab=runner.vocab_size, seed=5)[0]
    runner.forward([SeqInput(prompt, 0, [0, 1, 2, 3, 4], [])])
    feed = random_prompts([4], vocab=runner.vocab_size, seed=6)[0]
    verify = runner.forward([SeqInput(feed, 9, [0, 1, 2, 3, 4], [0, 1, 2, 3])])
    for j in range(4):  # the same tokens again, one pass each (same cache slots)
        decode = runner.forward([SeqInput([feed[j]], 9 + j, [0, 1, 2, 3, 4], [0])])
        assert torch.equal(decode[0], verify[j])


def test_speculative_greedy_equals_plain_greedy_on_the_kernels(tiny_dirs):
    prompts = random_prompts([5, 17, 40], vocab=300, seed=11)
    spec = SpecConfig(
        method="draft", draft_model=str(tiny_dirs["llama_draft"]), draft_length="fixed"
    )
    outputs = []
    for spec_config in (None, spec):
        engine = make_engine(tiny_dirs["llama"], spec=spec_config, max_num_batched_tokens=32)
        assert engine.runner.attention_backend is BACKENDS["cpu"]
        assert engine.runner.native is not None and engine.runner.native.cpu_kernels
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy(12))
        outputs.append(drain(engine))
        engine.check_invariants()
    assert outputs[0] == outputs[1]


def test_without_a_compiler_the_engine_runs_on_torch(tmp_path, tiny_dirs):
    """No compiler on PATH and an empty kernel cache: the kernels are unavailable, auto picks
    the reference backend, --cpu-packed-linear is ignored with a warning, and it serves."""
    script = textwrap.dedent(
        f"""
        import logging, sys
        logging.basicConfig(level=logging.WARNING)
        sys.path.insert(0, {os.getcwd()!r})
        from engine.cpu import kernels as cpu_kernels
        from tests.engine_utils import drain, greedy, make_engine
        assert not cpu_kernels.available()
        assert "no C compiler" in cpu_kernels.unavailable_reason()
        engine = make_engine({str(tiny_dirs["llama"])!r})
        assert engine.attention_backend == "reference"
        assert not engine.runner.native.cpu_kernels
        engine.add_request("r", [5, 6, 7], greedy(4))
        print("tokens", drain(engine)["r"])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env |= {"PATH": str(tmp_path), "TANDEM_KERNEL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tokens [" in proc.stdout
    assert "--cpu-packed-linear ignored" in proc.stderr


def _small_sources(root: Path) -> Path:
    """A source tree of one small C file: the build's caching does not depend on what the
    sources are, and it compiles in a blink where engine/cpu/csrc takes half a minute of CPU
    (a test that rebuilt the real sources paid that for every build it checked)."""
    root.mkdir(parents=True)
    (root / "small.c").write_text("int tandem_small(int x) { return 2 * x; }\n")
    (root / "small.h").write_text("int tandem_small(int x);\n")
    return root


def test_the_library_is_cached_per_cpu_and_source(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "cache"))
    csrc = _small_sources(tmp_path / "csrc")
    first = kernel_build.build(csrc)
    assert first.is_relative_to(tmp_path / "cache") and first.exists()
    assert kernel_build.build(csrc) == first  # built once, then found
    monkeypatch.setattr(kernel_build, "cpu_identity", lambda: "another cpu")
    assert kernel_build.build(csrc) != first


def test_another_copy_of_the_sources_builds_its_own_library(tmp_path, monkeypatch):
    """`build(csrc)` (bench.cpu_kernels gguf-vs builds a commit's sources): keyed by what the
    copy holds, not by where it lies."""
    copy = tmp_path / "csrc"
    shutil.copytree(kernel_build.CSRC, copy)
    original = kernel_build.build()  # the library the tests run on
    assert kernel_build.build(copy) == original
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "cache"))
    small = _small_sources(tmp_path / "small")
    first = kernel_build.build(small)
    (small / "small.c").write_text((small / "small.c").read_text() + "\n/* another version */\n")
    other = kernel_build.build(small)
    assert other.is_relative_to(tmp_path / "cache") and other.exists()
    assert other.parent.name != first.parent.name  # another key


def test_an_unwritable_cache_falls_back_to_the_temp_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(blocker / "cache"))  # mkdir fails
    monkeypatch.setattr(kernel_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    built = kernel_build.build(_small_sources(tmp_path / "csrc"))
    assert built.is_relative_to(tmp_path / "tmp") and built.exists()
