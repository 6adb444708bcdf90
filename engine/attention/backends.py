"""Attention backends by name (`reference` anywhere, `cpu` the C kernel, `triton` one launch
per layer on CUDA), and the choice of one for a device."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from types import MappingProxyType

import torch

from engine.attention.cpu import CPU
from engine.attention.paged import AttentionBackend, AttentionMetadata, BatchLayout, tree_bits
from engine.attention.reference import REFERENCE
from engine.cpu import kernels as cpu_kernels


class TritonBackend:
    """Varlen metadata (block tables, query starts, context lengths) for the Triton kernel."""

    graph_safe = True

    def unsupported(
        self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> str | None:
        return None

    def prepare(
        self, metadata: AttentionMetadata, layout: BatchLayout, device: torch.device
    ) -> None:
        block_size = layout.block_size
        used = [
            table[: -(-ctx // block_size)]
            for ctx, table in zip(layout.context_lens, layout.block_tables, strict=True)
        ]
        width = max(1, max((len(blocks) for blocks in used), default=0))
        tables = [blocks + [0] * (width - len(blocks)) for blocks in used]
        metadata.block_tables = torch.tensor(tables, dtype=torch.int32, device=device).view(
            -1, width
        )
        metadata.query_start_loc = torch.tensor(
            layout.query_starts, dtype=torch.int32, device=device
        )
        metadata.context_lens = torch.tensor(layout.context_lens, dtype=torch.int32, device=device)
        metadata.max_query_len = max(layout.query_lens, default=0)
        trees = tree_bits(layout)
        if trees is not None:
            metadata.tree = trees[0].to(device)
            metadata.tree_base = trees[1].to(device=device, dtype=torch.int32)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        from engine.attention.triton_kernel import paged_attention  # imports triton only when used

        if metadata.block_tables is None or metadata.query_start_loc is None:
            raise RuntimeError("triton attention needs metadata prepared by TritonBackend")
        assert metadata.context_lens is not None  # prepared together with the two above
        return paged_attention(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.context_lens,
            metadata.max_query_len,
            scale,
            metadata.tree,
            metadata.tree_base,
        )


BACKENDS: Mapping[str, AttentionBackend] = MappingProxyType(
    {"reference": REFERENCE, "cpu": CPU, "triton": TritonBackend()}
)
BACKEND_CHOICES = ("auto", *BACKENDS)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The backend a runner on `device` in `dtype` uses for --attention-backend `name` (auto:
    triton on CUDA, cpu in float32 on the CPU, else reference); raises ValueError, saying what
    to change, when the named backend cannot run here."""
    if name == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "reference"
        return "cpu" if dtype == torch.float32 and cpu_kernels.available() else "reference"
    if name not in BACKENDS:
        raise ValueError(
            f"--attention-backend must be one of {', '.join(BACKEND_CHOICES)} (got {name!r})"
        )
    if name == "cpu":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(
                f"--attention-backend cpu runs float32 on the CPU (here: {dtype} on {device}); "
                "use auto or reference"
            )
        if not cpu_kernels.available():
            raise ValueError(
                f"--attention-backend cpu: {cpu_kernels.unavailable_reason()}; install a C "
                "compiler (gcc) or use --attention-backend reference"
            )
    if name == "triton" and not triton_available():
        raise ValueError("--attention-backend triton needs the triton package (pip install triton)")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "--attention-backend triton runs on the CPU only under Triton's interpreter: set "
            "TRITON_INTERPRET=1 before starting, or use --attention-backend reference"
        )
    return name
