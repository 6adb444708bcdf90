"""Linear layers on packed weights for the CPU (`--cpu-packed-linear`): each weight read once
per call, bfloat16 where exact, a row's result independent of the others (docs/CPU.md)."""

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
    """Counts packings and switches of panels: a cache of panel addresses is stale once it moves."""

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
        self.quant: str | None = None  # the GGUF type of `panels` holding a file's own blocks

    def use_quantized(self, panels: torch.Tensor, quant: str) -> None:
        """Read `panels` (pack_quant_weight of exactly this layer's weights) from now on."""
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
