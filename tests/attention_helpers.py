"""Helpers shared by the attention kernels' tests."""

from __future__ import annotations

import torch


def poison_unread_slots(
    key_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    context_lens: list[int],
    tables: list[list[int]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches with NaN in every slot that holds no request's key (a kernel that
    reads such a slot without masking it gives NaN)."""
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    block_size = key_cache.shape[1]
    keep = torch.zeros(key_cache.shape[0] * block_size, dtype=torch.bool)
    for ctx, table in zip(context_lens, tables, strict=True):
        for pos in range(ctx):
            keep[table[pos // block_size] * block_size + pos % block_size] = True
    for cache in (key_cache, value_cache):
        cache.view(-1, *cache.shape[2:])[~keep.to(cache.device)] = float("nan")
    return key_cache, value_cache
