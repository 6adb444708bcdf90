"""The `cpu` attention backend (float32): every query goes to the C kernel (K/V read in place),
so a row's numbers do not depend on how its prompt was split into passes (prefix-cache hits,
chunked prefills), which --cpu-activations int8 would turn into different greedy choices."""

from __future__ import annotations

import torch

from engine.attention.paged import AttentionMetadata, BatchLayout, KernelSeqs, tree_bits
from engine.cpu import kernels as cpu_kernels

STACK_MAX_QUERY = 32
"""Longest query (one request's tokens in a pass) the C layer stack takes whole
(engine/model/native/lists.py); longer passes run layer by layer, on the same kernels."""


def supports(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> str | None:
    """None when a model with these shapes can use the kernel, else why not."""
    if dtype != torch.float32:
        return f"dtype {dtype} (the kernel is float32 only)"
    if not cpu_kernels.available():
        return f"the kernels did not build: {cpu_kernels.unavailable_reason()}"
    if not cpu_kernels.attention_supports(heads, kv_heads, head_dim, 1):
        return f"head_dim {head_dim} with {heads} heads / {kv_heads} kv heads"
    return None


def kernel_tables(
    block_tables: list[list[int]], context_lens: list[int], block_size: int
) -> list[list[int]]:
    """The kernel's block tables: each request's context blocks, 0-padded to the longest."""
    used = [t[: -(-ctx // block_size)] for t, ctx in zip(block_tables, context_lens, strict=True)]
    width = max(len(blocks) for blocks in used)
    return [blocks + [0] * (width - len(blocks)) for blocks in used]


class CpuBackend:
    """Every query through the C kernel."""

    graph_safe = False

    def unsupported(
        self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> str | None:
        return supports(heads, kv_heads, head_dim, dtype)

    def prepare(
        self, metadata: AttentionMetadata, layout: BatchLayout, device: torch.device
    ) -> None:
        if not layout.query_lens:
            return
        trees = tree_bits(layout)
        tables = kernel_tables(layout.block_tables, layout.context_lens, layout.block_size)
        metadata.kernel_seqs = KernelSeqs(
            tables=torch.tensor(tables, dtype=torch.int64),
            q_starts=torch.tensor(layout.query_starts[: len(layout.query_lens)], dtype=torch.int64),
            q_lens=torch.tensor(layout.query_lens, dtype=torch.int64),
            ctx_lens=torch.tensor(layout.context_lens, dtype=torch.int64),
            tree=None if trees is None else trees[0],
            tree_base=None if trees is None else trees[1],
        )

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        seqs = metadata.kernel_seqs
        query = query.contiguous()
        out = torch.empty_like(query)
        cpu_kernels.paged_attention(
            query,
            key_cache,
            value_cache,
            seqs.tables,
            seqs.q_starts,
            seqs.q_lens,
            seqs.ctx_lens,
            scale,
            out,
            seqs.tree,
            seqs.tree_base,
        )
        return out


CPU = CpuBackend()
