"""--cpu-attention bfloat16: attention on the CPU's bfloat16 dot products over a cache of
bfloat16 pairs (engine/cpu/csrc/attention_pairs.c). Its numbers are bfloat16 attention's
(queries, keys, values and softmax weights rounded, float32 sums); a query's output does not
depend on the rows beside it, so speculation stays lossless."""

from __future__ import annotations

import pytest
import torch

from engine.attention.cpu import CPU, STACK_MAX_QUERY
from engine.attention.paged import Tree, build_metadata
from engine.attention.reference import REFERENCE, reference_attention
from engine.config import ModelConfig, SpecConfig
from engine.cpu import kernels as cpu_kernels
from engine.cpu.pairs import attention_pairs, pack_pairs, pair_slots, unpack_pairs
from tests.attention_helpers import poison_unread_slots
from tests.engine_utils import drain, greedy, make_engine, random_prompts
from tests.tiny_models import build_model

pytestmark = pytest.mark.skipif(
    not attention_pairs(64, 16),
    reason=f"no bfloat16 dot products in the CPU kernels ({cpu_kernels.isa()})",
)


def _case(q_lens, ctx_lens, kv_heads, d, block, seed):
    """Float32 caches holding bfloat16 values, their PAIRS copies, scattered block tables."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block) for c in ctx_lens) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for ctx in ctx_lens:
        n = -(-ctx // block)
        tables.append(order[used : used + n] + [0])
        used += n
    k, v = (torch.randn(num_blocks, block, kv_heads, d, generator=gen).bfloat16().float()
            for _ in "kv")  # fmt: skip
    return k, v, pack_pairs(k, False), pack_pairs(v, True), tables, gen


def test_the_layout_holds_what_the_kernels_write():
    """tandem_rotary_cache writes a token's keys and values where pair_slots finds them, each
    rounded to bfloat16 as torch rounds (NaN and infinities included), and nothing else."""
    heads, kv_heads, d, block, tokens = 4, 2, 64, 32, 6
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 30
    qkv[1, -4:] = torch.tensor([float("nan"), float("inf"), -0.0, 1.0 + 2**-8])
    angles = torch.rand(64, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions, slots = torch.tensor([0, 5, 6, 7, 31, 2]), torch.tensor([3, 40, 1, 0, 63, 17])
    wide = [torch.zeros(3, block, kv_heads, d) for _ in "kv"]
    pairs = [torch.zeros(3, block, kv_heads, d, dtype=cpu_kernels.PAIRS) for _ in "kv"]
    q = cpu_kernels.rotary_cache(qkv, positions, slots, cos, sin, heads, *wide)
    assert torch.equal(cpu_kernels.rotary_cache(qkv, positions, slots, cos, sin, heads, *pairs), q)
    same = {"rtol": 0, "atol": 0, "equal_nan": True}  # the bits, but any NaN for a NaN
    for value, (w, p) in enumerate(zip(wide, pairs, strict=True)):
        unpacked = unpack_pairs(p, bool(value))
        torch.testing.assert_close(unpacked, w.bfloat16(), **same)
        repacked = unpack_pairs(pack_pairs(w, bool(value)), bool(value))
        torch.testing.assert_close(repacked, unpacked, **same)
        view, index = pair_slots(p, bool(value), slots)
        rows = view[index].reshape(tokens, kv_heads, d).view(torch.bfloat16)
        torch.testing.assert_close(rows, w.view(-1, kv_heads, d)[slots].bfloat16(), **same)


@pytest.mark.parametrize(
    "heads,kv_heads,d,block", [(9, 3, 64, 16), (4, 2, 32, 16), (8, 4, 128, 32), (6, 2, 96, 16)]
)
def test_attention_over_pairs_is_bfloat16_attention(heads, kv_heads, d, block):
    """Decodes, verifications, a prefill chunk, a request with one key and a draft tree in one
    batch: within bfloat16's rounding of the queries and the softmax weights of exact attention
    over the same (bfloat16) keys and values, and far closer than a wrong key or position."""
    q_lens = [1, 5, 1, STACK_MAX_QUERY + 3, 4, 1]
    ctx_lens = [1, 37, 300, 60, 21, 16]
    k, v, kp, vp, tables, gen = _case(q_lens, ctx_lens, kv_heads, d, block, d)
    trees = [None, None, None, None, Tree(base=17, bits=[0b1, 0b11, 0b101, 0b1001]), None]
    query = torch.randn(sum(q_lens), heads, d, generator=gen)
    scale = d**-0.5
    ref = build_metadata([(k, v)], block, q_lens, ctx_lens, tables, "cpu", REFERENCE, trees)
    md = build_metadata([(kp, vp)], block, q_lens, ctx_lens, tables, "cpu", CPU, trees)
    expected = reference_attention(query, k, v, ref, scale)
    got = CPU.attend(query, kp, vp, md, scale)
    error = (got - expected).abs().max().item()
    assert error < 2e-2, error
    shifted = build_metadata(
        [(k, v)], block, q_lens, [c + 1 for c in ctx_lens], tables, "cpu", REFERENCE, trees
    )  # fmt: skip  (every query one key later)
    assert (reference_attention(query, k, v, shifted, scale) - expected).abs().max() > 10 * error


@pytest.mark.parametrize("threads", [1, 2, 8])
@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (9, 3), (4, 1)])
def test_rows_over_pairs_do_not_depend_on_the_batch(heads, kv_heads, threads, monkeypatch):
    """Each query's output is bit-identical attended alone (a decode at its position) or as
    one query of a verification beside other requests (other sub-tiles of rows, other shares
    of the threads), on both sides of the 256-key spans' borders; NaN in every slot that holds
    no key (a lone last token of a pair included) changes nothing."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    d, block = 64, 16
    q_lens, ctx_lens = [5, 1, 5, 3, 4], [40, 90, 258, 513, 21]
    k, v, kp, vp, tables, gen = _case(q_lens, ctx_lens, kv_heads, d, block, 3)
    query = torch.randn(sum(q_lens), heads, d, generator=gen)
    both = build_metadata([(kp, vp)], block, q_lens, ctx_lens, tables, "cpu", CPU)
    together = CPU.attend(query, kp, vp, both, 0.125)
    row = 0
    for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        for j in range(q_len):
            alone = build_metadata([(kp, vp)], block, [1], [ctx - q_len + j + 1],
                                   tables[s : s + 1], "cpu", CPU)  # fmt: skip
            single = CPU.attend(query[row : row + 1], kp, vp, alone, 0.125)
            assert torch.equal(together[row], single[0]), (s, j)
            row += 1
    poisoned = [pack_pairs(c, bool(i))
                for i, c in enumerate(poison_unread_slots(k, v, ctx_lens, tables))]  # fmt: skip
    assert torch.equal(CPU.attend(query, *poisoned, both, 0.125), together)


@pytest.fixture(scope="module")
def head32(tmp_path_factory):
    """A tiny target and draft with heads of 32 (the tiny models' 16 have no pairs kernel)."""
    root = tmp_path_factory.mktemp("pairs")
    target = build_model(root / "t", seed=0, num_heads=2, num_kv_heads=1)
    draft = build_model(root / "d", seed=1, tokenizer_dir=target, num_heads=2, num_kv_heads=1,
                        num_layers=1)  # fmt: skip
    return target, draft


@pytest.mark.parametrize("branches", [1, 2])
def test_speculative_greedy_equals_plain_greedy_over_pairs(branches, head32):
    """Draft and target both on pairs; chains and draft trees (whose accepted path's keys and
    values are moved within the pairs' layout) give speculation off's output."""
    target, draft = head32
    prompts = random_prompts([5, 17, 40], vocab=300, seed=11)
    spec = SpecConfig(method="draft", draft_model=str(draft), draft_length="fixed",
                      draft_branches=branches)  # fmt: skip
    outputs = []
    for spec_config in (None, spec):
        engine = make_engine(target, spec=spec_config, block_size=16, num_blocks=64,
                             max_num_batched_tokens=32, cpu_attention="bfloat16")  # fmt: skip
        assert all(r.kv_caches[0][0].dtype == cpu_kernels.PAIRS for r in engine.runners)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy(16))
        outputs.append(drain(engine))
        engine.check_invariants()
        if spec_config is not None and branches > 1:
            assert engine.stats().spec_tree_steps > 0
    assert outputs[0] == outputs[1]


def test_the_setting_is_checked(head32, tiny_dirs):
    target, _ = head32
    with pytest.raises(ValueError, match="--cpu-attention"):
        ModelConfig(model="m", cpu_attention="int8")
    with pytest.raises(ValueError, match="--kv-cache-dtype auto or bfloat16, not float16"):
        make_engine(target, block_size=16, kv_cache_dtype="float16", cpu_attention="bfloat16")
    with pytest.raises(ValueError, match="its attention is not the cpu backend's"):
        make_engine(target, block_size=16, attention_backend="reference", cpu_attention="bfloat16")
    with pytest.raises(ValueError, match="head_dim 16 with blocks of 16"):
        make_engine(tiny_dirs["llama"], block_size=16, cpu_attention="bfloat16")
    with pytest.raises(ValueError, match="blocks of 8"):
        make_engine(target, block_size=8, cpu_attention="bfloat16")
    auto = {"block_size": 16, "cpu_attention": "auto"}
    assert make_engine(target, **auto).runner.kv_dtype == cpu_kernels.PAIRS
    assert make_engine(tiny_dirs["llama"], **auto).runner.kv_dtype == torch.float32
    assert make_engine(target, kv_cache_dtype="float16", **auto).runner.kv_dtype == torch.float16
    assert make_engine(target, block_size=16).runner.kv_dtype == torch.float32  # float32 asked
