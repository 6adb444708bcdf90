"""Fused steps of the native Llama forward on CUDA as Triton kernels (RMSNorm, rotary + cache
write, SiLU x up): the same math as the torch operators, only reduction order differs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_out,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    HALF: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    if HALF:  # normalised in float32, rounded, then scaled in the input type
        y = y.to(w.dtype).to(tl.float32)
    out = w.to(tl.float32) * y
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x rounded to `dtype` and back: what a torch operator on that type returns."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rotate_half(x1, x2, cos1, cos2, sin1, sin2, dtype: tl.constexpr):
    """x * cos + rotate_half(x) * sin on the two halves, rounded as torch rounds it."""
    o1 = _round(_round(x1 * cos1, dtype) + _round(-x2 * sin1, dtype), dtype)
    o2 = _round(_round(x2 * cos2, dtype) + _round(x1 * sin2, dtype), dtype)
    return o1, o2


@triton.jit
def _rotary_cache_kernel(
    qkv_ptr,
    stride_qkv,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    cos_ptr,
    sin_ptr,
    stride_rope,
    positions_ptr,
    slots_ptr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    dtype = q_ptr.dtype.element_ty
    half = HEAD_DIM // 2
    pos = tl.load(positions_ptr + tok)
    slot = tl.load(slots_ptr + tok)
    i = tl.arange(0, HALF_PAD)
    col_ok = i < half
    rope = pos * stride_rope + i
    cos1 = tl.load(cos_ptr + rope, mask=col_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + rope + half, mask=col_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + rope, mask=col_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + rope + half, mask=col_ok, other=0.0).to(tl.float32)
    row = qkv_ptr + tok * stride_qkv

    # q: rotated into its own tensor [tokens, HEADS, HEAD_DIM]
    h = tl.arange(0, HEADS_PAD)[:, None]
    ok = (h < HEADS) & col_ok[None, :]
    src = row + h * HEAD_DIM + i[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=ok, other=0.0).to(tl.float32)
    o1, o2 = _rotate_half(x1, x2, cos1[None, :], cos2[None, :], sin1[None, :], sin2[None, :], dtype)
    dst = q_ptr + tok * HEADS * HEAD_DIM + h * HEAD_DIM + i[None, :]
    tl.store(dst, o1.to(dtype), mask=ok)
    tl.store(dst + half, o2.to(dtype), mask=ok)

    # k rotated and v as is, into the cache slot of this token
    g = tl.arange(0, KV_HEADS_PAD)[:, None]
    ok = (g < KV_HEADS) & col_ok[None, :]
    src = row + HEADS * HEAD_DIM + g * HEAD_DIM + i[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=ok, other=0.0).to(tl.float32)
    o1, o2 = _rotate_half(x1, x2, cos1[None, :], cos2[None, :], sin1[None, :], sin2[None, :], dtype)
    dst = slot * KV_HEADS * HEAD_DIM + g * HEAD_DIM + i[None, :]
    cache_type = key_cache_ptr.dtype.element_ty
    tl.store(key_cache_ptr + dst, o1.to(cache_type), mask=ok)
    tl.store(key_cache_ptr + dst + half, o2.to(cache_type), mask=ok)
    src += KV_HEADS * HEAD_DIM
    v1 = tl.load(src, mask=ok, other=0.0)
    v2 = tl.load(src + half, mask=ok, other=0.0)
    tl.store(value_cache_ptr + dst, v1.to(cache_type), mask=ok)
    tl.store(value_cache_ptr + dst + half, v2.to(cache_type), mask=ok)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu, rounded to the input type
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[rows, n] -> [rows, n]: x / rms(x) * weight, as transformers' RMSNorm computes it."""
    rows, n = x.shape
    out = torch.empty_like(x)
    half = x.dtype != torch.float32
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](x, weight, out, x.stride(0), out.stride(0), n, eps, block, half)
    return out


def rotary_cache(
    qkv: torch.Tensor,  # [tokens, (heads + 2 * kv_heads) * head_dim]: the fused projection
    cos: torch.Tensor,  # [max positions, head_dim]: the whole table
    sin: torch.Tensor,
    positions: torch.Tensor,  # [tokens] int64
    slots: torch.Tensor,  # [tokens] int64 cache slot of each token
    key_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> torch.Tensor:  # [tokens, heads, head_dim]: q, rotated
    """Rotary embedding (rotate-half) of q and k, with k and v written to their slots."""
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()) or qkv.stride(1) != 1:
        raise ValueError("rotary_cache needs contiguous caches and projection rows")
    tokens = qkv.shape[0]
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rotary_cache_kernel[(tokens,)](
        qkv,
        qkv.stride(0),
        q,
        key_cache,
        value_cache,
        cos,
        sin,
        cos.stride(0),
        positions,
        slots,
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(heads),
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HALF_PAD=triton.next_power_of_2(max(head_dim // 2, 1)),
    )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * n] (gate, then up) -> [rows, n]: silu(gate) * up."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), n, block)
    return out
