"""Prepacked oneDNN matmuls for the target's linear layers on the CPU (`--cpu-packed-linear`).

A verification pass multiplies every weight by a handful of rows (1 + K per request).
torch's default CPU GEMM is far from memory speed there on some CPUs: on the default pair,
one thread of this project's CI-class Xeon, the target's linears take 12.5 ms for 5 rows
against 6.3 ms for 1. oneDNN with the weights reordered once into its blocked layout (as
vLLM's CPU backend does) takes 9.6 ms for 5 rows and 11.3 ms for 9 (17.3 with torch), but
8.5 ms for 1 row. So each call picks by its row count: fewer than `min_rows` rows (a plain
decode at batch 1) go through `F.linear` exactly as before.

The packed copy doubles the memory the target's linear weights take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows the reorder is tuned for; the packed weight serves any row count.
_PACK_ROWS = 8
DEFAULT_MIN_ROWS = 4


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """An `nn.Linear` (same parameters) that runs calls of `min_rows`+ rows on a prepacked
    oneDNN copy of its weight."""

    def __init__(self, linear: nn.Linear, min_rows: int = DEFAULT_MIN_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.min_rows = min_rows
        with torch.no_grad():
            self.register_buffer(
                "packed",
                torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _PACK_ROWS),
                persistent=False,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(
            x.reshape(rows, self.in_features).contiguous(), self.packed, self.bias, "none", [], ""
        )
        return out.view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module, min_rows: int = DEFAULT_MIN_ROWS) -> int:
    """Replace every float `nn.Linear` in `model` by a `PackedLinear`; return how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == torch.float32
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, min_rows))
    return len(targets)
