"""Linear layers on packed weights for the CPU (`--cpu-packed-linear`).

Each float32 `nn.Linear` of both models is swapped for a `PackedLinear` whose weight is also
kept packed into the panels of Tandem's C GEMM (engine/csrc/gemm.c), which streams
the weight from memory once per call whatever the row count. On the default pair, one
AVX2 core, all of the target's linears with weights coming from memory (as in a real pass):

| rows | torch F.linear (MKL) | oneDNN, prepacked | packed C kernel |
|---:|---:|---:|---:|
| 1 | 9.1 ms | 8.8 ms | 5.8 ms |
| 5 | 20.9 ms | 13.6 ms | 8.7 ms |
| 16 | 25.2 ms | 19.3 ms | 15.3 ms |
| 64 | 55.0 ms | 48.7 ms | 43.4 ms |
| 512 | 323 ms | 335 ms | 305 ms |

(`python -m bench.cpu_kernels linear`.) A row's result does not depend on the other rows of
the call, so a verification pass and a plain decode compute the same numbers for a token.
The packed copy doubles the memory of the linear weights.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import cpu_kernels


def available() -> bool:
    return cpu_kernels.available()


class PackedLinear(nn.Module):
    """An `nn.Linear` (same parameters) computed by the packed C kernel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            panels = cpu_kernels.pack_linear_weight(linear.weight.detach())
            self.register_buffer("panels", panels, persistent=False)
            bias = linear.bias.detach().contiguous() if linear.bias is not None else None
            self.register_buffer("packed_bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features).contiguous()
        out = cpu_kernels.linear(x2, self.panels, self.packed_bias, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)


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
