"""Paged attention as one Triton kernel reading K/V straight from the block tables: a program
per (request, query block, KV head), fp32 online softmax, a grid fixed by the batch size and a
query-length bound (CUDA graphs replay it). CPU tensors need TRITON_INTERPRET=1 set early."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# tl.dot needs at least 16 rows, columns and reduction length on the GPU.
_MIN_DOT = 16
# Query rows per program for batches with a prefill chunk; decode and verification use 16.
_PREFILL_ROWS = 64
_KV_TILE = 32


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, heads, head_dim]
    q_ptr,  # [num_tokens, heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    context_lens_ptr,  # [num_seqs] int32
    tree_ptr,  # [num_tokens] int64 draft-tree bits (0 = causal); read only with HAS_TREE
    tree_base_ptr,  # [num_seqs] int32 the slot of bit 0; read only with HAS_TREE
    scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_table,
    block_size,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two, at least 16
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: a power of two >= BLOCK_Q * GROUP
    BLOCK_N: tl.constexpr,  # key positions per tile
    DOT_PRECISION: tl.constexpr,  # "ieee" keeps fp32 inputs out of TF32
    HAS_TREE: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP  # query token within the request
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len - q_len + q_idx  # the position each row's query token sits at
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    tok = (q_start + q_idx).to(tl.int64)
    # One past the last key position the block's last query token sees.
    kv_end = tl.minimum(ctx_len, ctx_len - q_len + (q_block + 1) * BLOCK_Q)
    if HAS_TREE:
        bits = tl.load(tree_ptr + tok, mask=row_ok, other=0)
        base = tl.load(tree_base_ptr + seq)
        in_tree = bits != 0
        q_pos = tl.where(in_tree, ctx_len - 1, q_pos)  # the new keys are masked by the bits
        kv_end = ctx_len

    q_ptrs = q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        kv_pos = start + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < kv_end
        block = tl.load(
            block_tables_ptr + seq * stride_table + kv_pos // block_size, mask=kv_ok, other=0
        ).to(tl.int64)
        slot = kv_pos % block_size
        k_off = block * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head
        v_off = block * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
        kv_mask = kv_ok[None, :] & dim_ok[:, None]
        k = tl.load(k_cache_ptr + k_off[None, :] + dims[:, None], mask=kv_mask, other=0.0)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N] fp32
        visible = row_ok[:, None] & kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if HAS_TREE:
            rel = kv_pos - base  # the key's bit (< 0: before the tree, always seen)
            shift = tl.maximum(rel, 0).to(tl.int64)
            named = ((bits[:, None] >> shift[None, :]) & 1) != 0
            visible = visible & (~in_tree[:, None] | (rel[None, :] < 0) | named)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 so exp gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + v_off[:, None] + dims[None, :],
            mask=kv_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


# `@triton.jit` returns an interpreter-backed function instead when TRITON_INTERPRET=1.
INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)
if INTERPRETED and isinstance(tl.zeros, triton.runtime.JITFunction):
    raise ImportError(
        "TRITON_INTERPRET=1 was set after triton had been imported (torch imports it when "
        "transformers loads a model); set it in the environment before Python starts"
    )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    max_query_len: int,
    scale: float,
    tree: torch.Tensor | None = None,  # [num_tokens] int64 draft-tree bits, or None
    tree_base: torch.Tensor | None = None,  # [num_seqs] int32 the slot of bit 0, with tree
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """Attend each request's queries to its cached keys (the new keys cached already);
    max_query_len bounds every query length and may exceed the longest (a padded batch)."""
    if query.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            "the Triton attention kernel got CPU tensors but is compiled for the GPU; set "
            "TRITON_INTERPRET=1 before engine.attention.triton_kernel is imported to interpret it"
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {kv_heads} KV heads")
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("paged_attention needs the head dimension contiguous")
    group = num_heads // kv_heads
    rows = _PREFILL_ROWS if max_query_len * group > _MIN_DOT else _MIN_DOT
    block_m = max(rows, triton.next_power_of_2(group))
    block_q = block_m // group
    out = torch.empty_like(query)
    num_seqs = context_lens.shape[0]
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        tree if tree is not None else context_lens,  # not read without HAS_TREE
        tree_base if tree_base is not None else context_lens,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=_KV_TILE,
        DOT_PRECISION="ieee" if key_cache.dtype == torch.float32 else "tf32",
        HAS_TREE=tree is not None,
    )
    return out
