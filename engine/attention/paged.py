"""Paged attention behind transformers' AttentionInterface.

Tandem loads every model with `attn_implementation="tandem_paged"`. The model runs one packed
sequence `[1, num_tokens]` holding the scheduled tokens of all requests; the runner passes an
`AttentionMetadata` as the keyword `tandem_metadata`, which transformers forwards untouched
to `paged_attention_forward`. That function writes the new keys/values into their cache slots
and hands the queries to the metadata's `AttentionBackend`, which attends each request's
queries to that request's cached keys, causally. Backends are registered by name in
engine/attention/backends.py; this module holds the contract and the reference backend.

The reference path gathers each request's key blocks from the block table into a padded batch
and runs `scaled_dot_product_attention` with a boolean mask, one call per group of requests
with the same number of queries, so no query is ever padded (neither a decode next to a long
prefill chunk, nor a K = 1 verification next to a K = 8 one). It runs anywhere; the Triton
kernel (engine/attention/triton_kernel.py) reads the block tables directly and is the
default on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTN_IMPLEMENTATION = "tandem_paged"


@dataclass
class AttentionGroup:
    """Requests with the same number of queries, attended together in one SDPA call."""

    token_index: torch.Tensor | None
    """[group_tokens] positions of the group's tokens in the packed batch; None when they are
    the contiguous `token_slice`."""
    gather_blocks: torch.Tensor  # [group_seqs, max_blocks] block table rows (0 = pad)
    mask: torch.Tensor  # [group_seqs, 1, q_len, max_blocks * block_size] True = may attend
    q_len: int
    token_slice: slice | None = None
    """The group's tokens as a slice of the batch when they are contiguous (a decode step with
    one K): queries are then a view, no gather."""


@dataclass(frozen=True)
class BatchLayout:
    """The packed batch, per request, as host lists."""

    block_size: int
    query_lens: list[int]
    context_lens: list[int]
    """Request i's new tokens sit at [context_lens[i] - query_lens[i], context_lens[i])."""
    block_tables: list[list[int]]
    query_starts: list[int]
    """[num_seqs + 1]: request i's tokens are [query_starts[i], query_starts[i + 1])."""


class AttentionBackend(Protocol):
    """One way to attend the packed batch to the paged cache.

    Rules: `prepare` fills the AttentionMetadata fields this backend reads and no others, so
    one backend never pays for another's metadata; it runs once per forward (all layers share
    it) and builds device tensors from host lists without reading device memory. `attend` runs
    per layer after the batch's new keys/values are in the cache. Query j of request i sits at
    position context_lens[i] - query_lens[i] + j and sees request i's keys at positions <= its
    own; the result is [num_tokens, heads, head_dim] in the query's dtype. `attend` never
    writes the cache.
    """

    graph_safe: bool
    """Its metadata is device tensors of fixed shape (block tables, query starts, context
    lengths), so engine/model/decode_graphs.py can pad a step to a bucket and replay it."""

    def unsupported(
        self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> str | None:
        """Why a model of these shapes cannot use this backend, or None when it can."""
        ...

    def prepare(
        self, metadata: AttentionMetadata, layout: BatchLayout, device: torch.device
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


@dataclass
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer (key_cache, value_cache), each [num_blocks, block_size, kv_heads, head_dim]."""
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot each new token's K/V goes to
    backend: AttentionBackend
    """Attends this batch; only the fields below that it reads are filled."""
    groups: list[AttentionGroup] = field(default_factory=list)
    """reference: requests attended together in one padded SDPA call."""
    block_tables: torch.Tensor | None = None
    """triton: [num_seqs, max_blocks] int32 block ids, rows padded with 0."""
    query_start_loc: torch.Tensor | None = None
    """triton: [num_seqs + 1] int32; request i's tokens are [loc[i], loc[i + 1]) of the batch."""
    context_lens: torch.Tensor | None = None
    """triton: [num_seqs] int32, the keys request i attends to (its new tokens included)."""
    max_query_len: int = 0
    """triton: a bound on every request's query length (it sizes the kernel grid)."""
    kernel_seqs: KernelSeqs | None = None
    """cpu: the requests the C kernel attends (the others, long queries, are in `groups`)."""


@dataclass
class KernelSeqs:
    """Requests for the CPU attention kernel (engine/attention/cpu.py), as int64 tensors."""

    tables: torch.Tensor  # [seqs, width] block ids, rows padded with 0
    q_starts: torch.Tensor  # [seqs] first row of each request's queries in the packed batch
    q_lens: torch.Tensor  # [seqs]
    ctx_lens: torch.Tensor  # [seqs] keys each request attends, its new ones included


def build_metadata(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    device: torch.device,
    backend: AttentionBackend | None = None,
) -> AttentionMetadata:
    """Metadata for requests with query_lens[i] new tokens ending at context_lens[i].

    The new tokens of request i sit at positions [context_lens[i] - query_lens[i], context_lens[i]).
    backend: None = the reference backend.
    """
    slots = []
    for q_len, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
        for pos in range(ctx - q_len, ctx):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    metadata = AttentionMetadata(
        kv_caches=kv_caches,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        backend=backend or REFERENCE,
    )
    layout = BatchLayout(block_size, query_lens, context_lens, block_tables, starts)
    metadata.backend.prepare(metadata, layout, device)
    return metadata


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
    # Grouping by query count means no query is padded: a verification batch where K differs
    # per request costs what its tokens cost, not (1 + max K) per request.
    by_len: dict[int, list[int]] = {}
    for i in range(len(layout.query_lens)) if members is None else members:
        by_len.setdefault(layout.query_lens[i], []).append(i)
    return [
        _build_group(
            members,
            layout.query_starts,
            q_len,
            layout.context_lens,
            layout.block_tables,
            layout.block_size,
            device,
        )
        for q_len, members in by_len.items()
    ]


def _build_group(
    members: list[int],
    starts: list[int],
    q_len: int,
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionGroup:
    ctx_lens = torch.tensor([context_lens[i] for i in members])
    max_blocks = -(-int(ctx_lens.max()) // block_size)
    tables = torch.zeros(len(members), max_blocks, dtype=torch.long)
    for row, i in enumerate(members):
        table = block_tables[i][:max_blocks]
        tables[row, : len(table)] = torch.tensor(table, dtype=torch.long)
    # Keys are gathered whole blocks at a time (a row copy per block, far cheaper than a gather
    # per slot); the positions past a request's context are masked out.
    kv_pos = torch.arange(max_blocks * block_size)
    # Query j of request r sits at position ctx_r - q_len + j and sees keys up to that position.
    q_pos = ctx_lens[:, None] - q_len + torch.arange(q_len)[None, :]
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]
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
        # [seqs, max_blocks * block_size, kv_heads, head_dim]
        # On a 2-D view each block is one row: index_select copies it with one memcpy (on the
        # 4-D cache it walks every element, 5-8x slower on the CPU).
        rows = g.gather_blocks.view(-1)
        k = _rows(key_cache).index_select(0, rows).view(num_seqs, -1, kv_heads, head_dim)
        v = _rows(value_cache).index_select(0, rows).view(num_seqs, -1, kv_heads, head_dim)
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
    """[num_blocks, block_size, kv_heads, head_dim] -> [num_blocks, block_size * kv_heads *
    head_dim] (a view)."""
    return cache.view(cache.shape[0], -1)


def _covers(metadata: AttentionMetadata, query: torch.Tensor) -> bool:
    groups = metadata.groups
    return (
        len(groups) == 1
        and groups[0].token_slice is not None
        and groups[0].token_slice == slice(0, query.shape[0])
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, num_tokens, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tandem_metadata: AttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if tandem_metadata is None:
        raise RuntimeError("tandem_paged attention needs the `tandem_metadata` keyword argument")
    key_cache, value_cache = tandem_metadata.kv_caches[module.layer_idx]
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    slots = tandem_metadata.slot_mapping
    key_cache.view(-1, kv_heads, head_dim)[slots] = key[0].transpose(0, 1).to(key_cache.dtype)
    value_cache.view(-1, kv_heads, head_dim)[slots] = value[0].transpose(0, 1).to(key_cache.dtype)
    scale = scaling if scaling is not None else head_dim**-0.5
    out = tandem_metadata.backend.attend(
        query[0].transpose(0, 1), key_cache, value_cache, tandem_metadata, scale
    )
    return out.unsqueeze(0), None  # [1, num_tokens, heads, head_dim]


def _no_mask(*args: object, **kwargs: object) -> None:
    """The paged function builds its own masks from the metadata."""
    return None


def register() -> None:
    """Make `attn_implementation="tandem_paged"` loadable (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
