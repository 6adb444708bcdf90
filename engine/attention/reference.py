"""The reference attention backend, which runs anywhere: key blocks gathered into a padded
batch, one masked SDPA call per group of requests with the same query count (none padded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.paged import AttentionGroup, AttentionMetadata, BatchLayout


class ReferenceBackend:
    """One SDPA call per group of requests with the same query count (module docstring)."""

    graph_safe = False

    def unsupported(
        self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> str | None:
        return None

    def prepare(
        self, metadata: AttentionMetadata, layout: BatchLayout, device: torch.device
    ) -> None:
        metadata.groups = build_groups(layout, device)

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return reference_attention(query, key_cache, value_cache, metadata, scale)


REFERENCE = ReferenceBackend()


def build_groups(
    layout: BatchLayout, device: torch.device, members: list[int] | None = None
) -> list[AttentionGroup]:
    """Groups of `members` (default: every request) by query count."""
    by_len: dict[int, list[int]] = {}
    for i in range(len(layout.query_lens)) if members is None else members:
        by_len.setdefault(layout.query_lens[i], []).append(i)
    return [
        _build_group(
            members,
            layout.query_starts,
            q_len,
            layout,
            device,
        )
        for q_len, members in by_len.items()
    ]


def _build_group(
    members: list[int],
    starts: list[int],
    q_len: int,
    layout: BatchLayout,
    device: torch.device,
) -> AttentionGroup:
    block_size, block_tables = layout.block_size, layout.block_tables
    ctx_lens = torch.tensor([layout.context_lens[i] for i in members])
    max_blocks = -(-int(ctx_lens.max()) // block_size)
    tables = torch.zeros(len(members), max_blocks, dtype=torch.long)
    for row, i in enumerate(members):
        table = block_tables[i][:max_blocks]
        tables[row, : len(table)] = torch.tensor(table, dtype=torch.long)
    # Keys are gathered whole blocks at a time; positions past a request's context are masked.
    kv_pos = torch.arange(max_blocks * block_size)
    # Query j of request r sits at position ctx_r - q_len + j and sees keys up to that position.
    q_pos = ctx_lens[:, None] - q_len + torch.arange(q_len)[None, :]
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]
    for row, i in enumerate(members):
        tree = layout.trees[i] if layout.trees else None
        if tree is not None:  # the keys from the tree's base on: the bits say which
            span = int(ctx_lens[row]) - tree.base
            bits = torch.tensor(tree.bits)[:, None] >> torch.arange(span)[None, :] & 1
            mask[row, :, tree.base : tree.base + span] = bits.bool()
    contiguous = members == list(range(members[0], members[-1] + 1))
    token_slice = slice(starts[members[0]], starts[members[-1] + 1]) if contiguous else None
    token_index = (
        None
        if contiguous
        else torch.cat([torch.arange(starts[i], starts[i + 1]) for i in members]).to(device)
    )
    return AttentionGroup(
        token_index=token_index,
        gather_blocks=tables.to(device),
        mask=mask[:, None].to(device),
        q_len=q_len,
        token_slice=token_slice,
    )


def reference_attention(
    query: torch.Tensor,  # [num_tokens, heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """Attend the requests in `metadata.groups`; their rows are written into `out` when given
    (the other rows are left as they are)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = key_cache.shape[2]
    if out is None and not _covers(metadata, query):
        out = torch.empty_like(query)
    for g in metadata.groups:
        num_seqs = g.gather_blocks.shape[0]
        if g.token_slice is not None:
            q = query[g.token_slice]
        else:
            q = query.index_select(0, g.token_index)
        q = q.view(num_seqs, g.q_len, num_heads, head_dim)
        # [seqs, max_blocks * block_size, kv_heads, head_dim]; on a 2-D view (`_rows`) each
        # block is one row, which index_select copies with one memcpy
        rows = g.gather_blocks.view(-1)
        k = _rows(key_cache).index_select(0, rows).view(num_seqs, -1, kv_heads, head_dim)
        v = _rows(value_cache).index_select(0, rows).view(num_seqs, -1, kv_heads, head_dim)
        if k.dtype != q.dtype:  # a 16-bit cache (--kv-cache-dtype): widened exactly
            k, v = k.to(q.dtype), v.to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=g.mask,
            scale=scale,
            enable_gqa=kv_heads != num_heads,
        )  # [seqs, heads, q_len, head_dim]
        o = o.transpose(1, 2).reshape(-1, num_heads, head_dim)
        if out is None:  # one group holding every token in order
            return o
        if g.token_slice is not None:
            out[g.token_slice] = o
        else:
            out.index_copy_(0, g.token_index, o)
    return out


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """[blocks, block_size, kv_heads, head_dim] -> [blocks, block_size * kv_heads * head_dim]."""
    return cache.view(cache.shape[0], -1)


def _covers(metadata: AttentionMetadata, query: torch.Tensor) -> bool:
    groups = metadata.groups
    return (
        len(groups) == 1
        and groups[0].token_slice is not None
        and groups[0].token_slice == slice(0, query.shape[0])
    )
