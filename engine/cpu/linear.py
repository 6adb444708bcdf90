"""Linear layers on packed weights for the CPU (`--cpu-packed-linear`).

Each float32 `nn.Linear` of both models is swapped for a `PackedLinear` whose weight is also
kept packed into the panels of Tandem's C GEMM (engine/cpu/csrc/gemm.c), which streams
the weight from memory once per call whatever the row count: in bfloat16 when every weight
is exactly a bfloat16 value (as in the default pair), else in float32. All of the target's
linears of the default pair, weights coming from memory as in a real pass, one AVX2 core
(AMD EPYC, `python -m bench.cpu_kernels linear`, 2026-11-23):

| rows | torch F.linear (MKL) | oneDNN, prepacked | C, float32 panels | C, bfloat16 panels |
|---:|---:|---:|---:|---:|
| 1 | 8.30 ms | 7.59 ms | 5.96 ms | 4.11 ms |
| 5 | 18.71 ms | 11.17 ms | 8.01 ms | 4.92 ms |
| 16 | 23.33 ms | 18.52 ms | 14.49 ms | 10.30 ms |
| 64 | 62.26 ms | 48.31 ms | 41.76 ms | 39.43 ms |
| 512 | 325.71 ms | 338.13 ms | 296.43 ms | 297.19 ms |

A row's result does not depend on the other rows of the call, so a verification pass and a
plain decode compute the same numbers for a token. The packed copy adds 50% (bfloat16) or
100% (float32) to the memory of the linear weights.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cpu import kernels as cpu_kernels
from engine.cpu import panels as cpu_panels


def available() -> bool:
    return cpu_kernels.available()


class PackedLinear(nn.Module):
    """An `nn.Linear` (same parameters) computed by the packed C kernel."""

    changes = 0
    """Counts packings and switches of panels, process-wide: a cache of panel addresses
    (engine/model/native/llama.py's layer stack) is stale once this moves."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        PackedLinear.changes += 1
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            panels = cpu_panels.pack_linear_weight(linear.weight.detach())
            self.register_buffer("panels", panels, persistent=False)
            bias = linear.bias.detach().contiguous() if linear.bias is not None else None
            self.register_buffer("packed_bias", bias, persistent=False)
        self.quant: str | None = None
        """The GGUF type of `panels` when they hold a GGUF file's own blocks
        (engine/cpu/gguf_blocks.py), else None."""

    def use_quantized(self, panels: torch.Tensor, quant: str) -> None:
        """Read `panels`, GGUF blocks of exactly this layer's weights
        (cpu_panels.pack_quant_weight), from now on."""
        self.panels, self.quant = panels, quant
        PackedLinear.changes += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.rows(x.reshape(-1, self.in_features))
        return out.view(*x.shape[:-1], self.out_features)

    def rows(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] -> x @ weight.T + bias [rows, out]; with `residual` [rows, out] the
        result is added to it in place and it is returned (a skip connection in the GEMM)."""
        return cpu_kernels.linear(
            x, self.panels, self.packed_bias, self.out_features, residual, self.quant
        )


def pack_linears(model: nn.Module) -> int:
    """Replace every float32 `nn.Linear` in `model` by a `PackedLinear`; return how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == torch.float32
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
