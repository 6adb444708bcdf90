"""Weight-only quantization of the linear layers (`--quantization`): each float32 weight is
replaced once at load by its rounded values (bf16, Q8_0 for int8, Q4_1 for int4 with an int8
head), so every path computes that one model and speculation stays lossless against it."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engine.cpu import panels as cpu_panels
from engine.cpu.linear import PackedLinear

METHODS = ("none", "bf16", "int8", "int4")
_BLOCKS = {"int8": "Q8_0", "int4": "Q4_1"}  # method -> GGUF block type of its weights
_HEAD_BLOCKS = {"int8": "Q8_0", "int4": "Q8_0"}


def _round_trip(weight: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(GGUF blocks [rows, bytes] of `kind`, the float32 weights they hold)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    blocks = quantize(weight, qtype)
    return blocks, dequantize(blocks, qtype).astype(np.float32, copy=False)


def _blocked(method: str, in_features: int) -> bool:
    return method in _BLOCKS and in_features % cpu_panels.QBLOCK == 0


def check_runs_here(flag: str, method: str, device: torch.device, dtype: torch.dtype) -> None:
    """Rounded weights run on the CPU kernels in float32 only."""
    if method != "none" and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(
            f"{flag} {method} runs on the CPU in float32 "
            f"(got device {device.type}, dtype {str(dtype).removeprefix('torch.')})"
        )


@torch.no_grad()
def round_weights(model: nn.Module, method: str) -> dict[str, int]:
    """Round, in place, every float32 `nn.Linear` weight of `model` as `method` serves it; how
    many layers went to each format (bfloat16 where the width is not a multiple of 32)."""
    if method not in METHODS:
        raise ValueError(f"--quantization must be one of {', '.join(METHODS)} (got {method!r})")
    if method == "none":
        return {}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    done: dict[str, int] = {}
    seen: set[int] = set()
    for layer in model.modules():
        if type(layer) is not nn.Linear or layer.weight.dtype != torch.float32:
            continue
        weight = layer.weight
        if id(weight) in seen:  # shared with another layer: rounded once
            continue
        seen.add(id(weight))
        if _blocked(method, layer.in_features):
            kind = (_HEAD_BLOCKS if layer is head else _BLOCKS)[method]
            _, values = _round_trip(weight.detach().cpu().numpy(), kind)
            weight.copy_(torch.from_numpy(values))
        else:
            kind = "bfloat16"
            weight.copy_(weight.to(torch.bfloat16).float())
        done[kind] = done.get(kind, 0) + 1
    return done


def use_blocks(module: nn.Module, method: str) -> dict[str, int]:
    """Switch every `PackedLinear` of `module` (rounded by `round_weights`) onto blocks holding
    exactly its weights (else its float panels stay); how many layers went to each type."""
    if method not in _BLOCKS:
        return {}
    switched: dict[str, int] = {}
    for layer in module.modules():
        if not isinstance(layer, PackedLinear) or layer.quant is not None:
            continue
        if not _blocked(method, layer.in_features):
            continue
        weight = layer.weight.detach().numpy()
        for kind in dict.fromkeys((_BLOCKS[method], _HEAD_BLOCKS[method])):
            blocks, values = _round_trip(weight, kind)
            if np.array_equal(values, weight):
                layer.use_quantized(cpu_panels.pack_quant_weight(blocks, kind), kind)
                switched[kind] = switched.get(kind, 0) + 1
                break
    return switched
