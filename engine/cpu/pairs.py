"""KV caches of bfloat16 pairs (`--cpu-attention bfloat16`, dtype PAIRS): bfloat16 bits laid out
for engine/cpu/csrc/attention_pairs.c's dot products; views of them by token slot."""

from __future__ import annotations

import torch

from engine.cpu import kernels as cpu_kernels
from engine.cpu.kernels import PAIRS


def attention_pairs(head_dim: int, block_size: int) -> bool:
    """Whether this build attends a PAIRS cache of these shapes (AVX-512 BF16)."""
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.tandem_attention_pairs(head_dim, block_size))


def pair_slots(cache: torch.Tensor, value: bool, slots: torch.Tensor) -> tuple:
    """(view, index): `view[index]` reads or writes the keys [slots, kv_heads, head_dim / 2, 2]
    (values: [slots, kv_heads, head_dim]) of `slots` in a PAIRS cache."""
    blocks, size, heads, dim = cache.shape
    block, at = slots // size, slots % size
    if value:
        view = cache.view(blocks, heads, size // 2, dim, 2).permute(0, 2, 4, 1, 3)
        return view, (block, at // 2, at % 2)
    view = cache.view(blocks, heads, size // 16, dim // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)
    return view, (block, at // 16, at % 16)


def unpack_pairs(cache: torch.Tensor, value: bool) -> torch.Tensor:
    """A PAIRS cache as [blocks, block_size, kv_heads, head_dim] bfloat16 (a copy)."""
    blocks, size, heads, dim = cache.shape
    view, index = pair_slots(cache, value, torch.arange(blocks * size))
    return view[index].reshape(blocks, size, heads, dim).view(torch.bfloat16)


def pack_pairs(cache: torch.Tensor, value: bool) -> torch.Tensor:
    """[blocks, block_size, kv_heads, head_dim] floats as a PAIRS cache (rounded to bfloat16)."""
    blocks, size, heads, dim = cache.shape
    out = torch.empty(cache.shape, dtype=PAIRS)
    view, index = pair_slots(out, value, torch.arange(blocks * size))
    rows = cache.to(torch.bfloat16).view(PAIRS).reshape(blocks * size, heads, dim)
    view[index] = rows if value else rows.view(-1, heads, dim // 2, 2)
    return out
