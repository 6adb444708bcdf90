"""Paged attention behind transformers' AttentionInterface (`tandem_paged`): new K/V go to
their cache slots and the queries to the metadata's `AttentionBackend`, whose contract is here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTN_IMPLEMENTATION = "tandem_paged"
MAX_TREE_TOKENS = 63
"""Most cache slots a draft tree spans from its base: its bitmasks are int64 (bit 63 unused)."""


@dataclass
class AttentionGroup:
    """Requests with the same number of queries, attended together in one SDPA call."""

    token_index: torch.Tensor | None  # [group_tokens] in the packed batch; None: `token_slice`
    gather_blocks: torch.Tensor  # [group_seqs, max_blocks] block table rows (0 = pad)
    mask: torch.Tensor  # [group_seqs, 1, q_len, max_blocks * block_size] True = may attend
    q_len: int
    token_slice: slice | None = None  # contiguous tokens: the queries are a view, no gather


@dataclass(frozen=True)
class Tree:
    """A request's draft-tree visibility: new token j sees every slot before `base` and slot
    base + i exactly when bit i of bits[j] is set (its ancestors and itself)."""

    base: int
    bits: list[int]


@dataclass(frozen=True)
class BatchLayout:
    """The packed batch, per request, as host lists."""

    block_size: int
    query_lens: list[int]
    context_lens: list[int]  # request i's new tokens end at context_lens[i]
    block_tables: list[list[int]]
    query_starts: list[int]  # [num_seqs + 1]
    trees: list[Tree | None] | None = None  # per request (None = causal)


class AttentionBackend(Protocol):
    """One way to attend the packed batch to the paged cache. `prepare` runs once per forward
    and fills only the metadata fields it reads, from host lists (no device reads). `attend`
    runs per layer after the new K/V are cached, never writes the cache, and returns [num_tokens,
    heads, head_dim] in the query's dtype, each query causal within its request or its `Tree`."""

    graph_safe: bool  # metadata is fixed-shape tensors: decode_graphs can replay it

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
    # per layer (key_cache, value_cache), each [num_blocks, block_size, kv_heads, head_dim]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot each new token's K/V goes to
    backend: AttentionBackend
    groups: list[AttentionGroup] = field(default_factory=list)  # reference
    block_tables: torch.Tensor | None = None  # triton: [num_seqs, max_blocks] int32, 0-padded
    query_start_loc: torch.Tensor | None = None  # triton: [num_seqs + 1] int32
    context_lens: torch.Tensor | None = None  # triton: [num_seqs] int32, new tokens included
    max_query_len: int = 0  # triton: bounds every query length (sizes the grid)
    tree: torch.Tensor | None = None  # triton: [num_tokens] int64 `tree_bits`, or None
    tree_base: torch.Tensor | None = None  # triton: [num_seqs] int32 `Tree.base`, with `tree`
    kernel_seqs: KernelSeqs | None = None  # cpu: the C kernel's requests (others in `groups`)
    max_keys: int = 0  # the most keys one query attends (host): a wider sliding window is moot
    windows: dict[int, int | None] | None = None  # a probe's: layer -> sliding_window it passed


@dataclass
class KernelSeqs:
    """Requests for the CPU attention kernel (engine/attention/cpu.py), as int64 tensors."""

    tables: torch.Tensor  # [seqs, width] block ids, rows padded with 0
    q_starts: torch.Tensor  # [seqs] first row of each request's queries in the packed batch
    q_lens: torch.Tensor  # [seqs]
    ctx_lens: torch.Tensor  # [seqs] keys each request attends, its new ones included
    tree: torch.Tensor | None = None  # [num_tokens] int64 tree bits (0 = causal), or None
    tree_base: torch.Tensor | None = None  # [seqs] int64 `Tree.base`, with `tree`


def build_metadata(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    device: torch.device,
    backend: AttentionBackend,
    trees: list[Tree | None] | None = None,
) -> AttentionMetadata:
    """Metadata for requests with query_lens[i] new tokens ending at context_lens[i]."""
    slots = cache_slots(query_lens, context_lens, block_tables, block_size)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    metadata = AttentionMetadata(
        kv_caches=kv_caches,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        backend=backend,
    )
    metadata.max_keys = most_keys(query_lens, context_lens, trees)
    trees = trees if trees is not None and any(t is not None for t in trees) else None
    for q_len, ctx, tree in zip(query_lens, context_lens, trees, strict=True) if trees else ():
        if tree is not None and not (
            len(tree.bits) == q_len
            and 0 <= tree.base <= ctx - q_len
            and ctx - tree.base <= MAX_TREE_TOKENS
        ):
            raise ValueError(
                f"a draft tree needs one bitmask per new token and spans at most "
                f"{MAX_TREE_TOKENS} slots from its base (got {len(tree.bits)} masks for "
                f"{q_len} tokens, base {tree.base}, context {ctx})"
            )
    layout = BatchLayout(block_size, query_lens, context_lens, block_tables, starts, trees)
    metadata.backend.prepare(metadata, layout, device)
    return metadata


def cache_slots(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int
) -> list[int]:
    """The flat cache slot of every new token, request by request."""
    return [
        table[pos // block_size] * block_size + pos % block_size
        for q_len, ctx, table in zip(query_lens, context_lens, block_tables, strict=True)
        for pos in range(ctx - q_len, ctx)
    ]


def most_keys(
    query_lens: list[int], context_lens: list[int], trees: list[Tree | None] | None
) -> int:
    """The most keys one new token attends: its request's context, or in a draft tree the
    slots before the base and its ancestors."""
    trees = trees or [None] * len(query_lens)
    return max(
        (
            ctx if tree is None else tree.base + max(bits.bit_count() for bits in tree.bits)
            for ctx, tree in zip(context_lens, trees, strict=True)
        ),
        default=0,
    )


def tree_bits(layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """([num_tokens] int64 draft-tree bits of every token of the batch, 0 = causal;
    [num_seqs] int64 tree bases), or None when no request has a tree."""
    if not layout.trees:
        return None
    bits, bases = tree_lists(layout.query_lens, layout.trees)
    return torch.tensor(bits, dtype=torch.int64), torch.tensor(bases, dtype=torch.int64)


def tree_lists(query_lens: list[int], trees: list[Tree | None]) -> tuple[list[int], list[int]]:
    """Every new token's tree bits (0 = causal) and every request's tree base (0 without)."""
    pairs = list(zip(query_lens, trees, strict=True))
    bits = [b for q, t in pairs for b in (t.bits if t else [0] * q)]
    return bits, [t.base if t else 0 for _, t in pairs]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, num_tokens, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tandem_metadata: AttentionMetadata | None = None,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if tandem_metadata is None:
        raise RuntimeError("tandem_paged attention needs the `tandem_metadata` keyword argument")
    refuse_unsupported(module, attention_mask, sliding_window, tandem_metadata, kwargs)
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


# Keyword arguments a model's attention passes that change its result; none is implemented.
UNSUPPORTED_KWARGS = {
    "softcap": "attention logit softcapping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "a relative position bias",
    "indices": "sparse attention",
    "block_indices": "block-sparse attention",
}


def refuse_unsupported(
    module: torch.nn.Module,
    attention_mask: torch.Tensor | None,
    sliding_window: int | None,
    metadata: AttentionMetadata,
    kwargs: dict[str, object],
) -> None:
    """Raise ValueError where the model asks its attention for more than causal (or draft-tree)
    softmax attention at `scale`; a sliding window only as wide as every query's keys is moot."""
    model = getattr(getattr(module, "config", None), "model_type", None) or type(module).__name__
    for name, feature in UNSUPPORTED_KWARGS.items():
        value = kwargs.get(name)
        if value is not None:
            shown = f"a {tuple(value.shape)} tensor" if isinstance(value, torch.Tensor) else value
            raise ValueError(
                f"{model}: {name}={shown} ({feature}) is not implemented by Tandem's attention"
            )
    if attention_mask is not None:  # `_no_mask` makes none: the model built its own (ALiBi...)
        raise ValueError(
            f"{model}: an attention mask or bias of the model's own is not implemented by "
            "Tandem's attention"
        )
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ValueError(f"{model}: bidirectional attention is not implemented by Tandem's")
    if metadata.windows is not None:
        metadata.windows[module.layer_idx] = sliding_window
    if sliding_window is not None and metadata.max_keys > sliding_window:
        raise ValueError(
            f"{model}: sliding_window={sliding_window} is implemented only as a cap on the "
            f"context, and a query here attends {metadata.max_keys} keys"
        )


def _no_mask(*args: object, **kwargs: object) -> None:
    return None


def register() -> None:
    """Make `attn_implementation="tandem_paged"` loadable (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
