"""The reference paged attention against plain causal attention on contiguous keys."""

from __future__ import annotations

import pytest
import torch

from engine.attention.paged import build_metadata
from engine.attention.reference import REFERENCE, reference_attention


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [q_len, heads, d] at the last q_len positions of k/v [ctx, kv_heads, d]."""
    q_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(ctx - q_len, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_mixed_query_lengths_match_dense_attention(block_size: int, kv_heads: int):
    torch.manual_seed(block_size * 10 + kv_heads)
    heads, head_dim = 4, 8
    # Decodes, verifications with different K (non-contiguous equal lengths), prefill chunks.
    query_lens = [1, 3, 1, 9, 3, 40, 1, 17]
    context_lens = [5, 30, 64, 9, 3, 40, 100, 50]
    num_blocks = sum(-(-ctx // block_size) + 1 for ctx in context_lens) + 8
    free = torch.randperm(num_blocks).tolist()  # scattered blocks, as after churn
    tables, keys, values = [], [], []
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    for ctx in context_lens:
        table = [free.pop() for _ in range(-(-ctx // block_size) + 1)]  # one spare block
        k, v = torch.randn(ctx, kv_heads, head_dim), torch.randn(ctx, kv_heads, head_dim)
        for pos in range(ctx):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        tables.append(table)
        keys.append(k)
        values.append(v)
    query = torch.randn(sum(query_lens), heads, head_dim)
    meta = build_metadata(
        [(k_cache, v_cache)],
        block_size,
        query_lens,
        context_lens,
        tables,
        torch.device("cpu"),
        REFERENCE,
    )
    out = reference_attention(query, k_cache, v_cache, meta, head_dim**-0.5)
    start = 0
    for q_len, k, v in zip(query_lens, keys, values, strict=True):
        expected = _naive(query[start : start + q_len], k, v, head_dim**-0.5)
        torch.testing.assert_close(out[start : start + q_len], expected, rtol=1e-4, atol=1e-5)
        start += q_len
    # One SDPA call per distinct query length, none padded.
    assert sorted(g.q_len for g in meta.groups) == sorted(set(query_lens))
