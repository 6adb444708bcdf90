"""Weights packed into the layouts the C GEMMs read (csrc/gemm.c, gemm_quant.c): panels of
`PANEL` output columns side by side, in float32, bfloat16, or a GGUF file's Q8_0 / Q4_1 blocks
regrouped by panel."""

from __future__ import annotations

import numpy as np
import torch

PANEL = 16  # output columns per packed panel: PANEL in gemm.c
_Q4_ORDER = list(range(0, PANEL, 2)) + list(range(1, PANEL, 2))
_BF16_ORDER = [c for j in range(PANEL // 2) for c in (j, j + PANEL // 2)]  # 0, 8, 1, 9, ...
QUANT_TYPES = ("Q8_0", "Q4_1")  # GGUF block types gemm_quant.c reads
QBLOCK = 32  # weights per GGUF block of those types


def pack_linear_weight(weight: torch.Tensor, allow_bf16: bool = True) -> torch.Tensor:
    """[out, in] float32 -> panels [ceil(out / PANEL), in, PANEL] (zero-padded), in bfloat16
    when `allow_bf16` and every weight is exactly one (same results, half the traffic)."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL)
    padded = weight.new_zeros(num_panels * PANEL, in_features)
    padded[:out_features] = weight
    panels = padded.view(num_panels, PANEL, in_features).transpose(1, 2).contiguous()
    if allow_bf16:
        narrow = panels.to(torch.bfloat16)
        if torch.equal(narrow.to(torch.float32), panels):
            # Columns 0, 8, 1, 9, ..., 7, 15 within each panel row (see panel_row in the C).
            return narrow[..., _BF16_ORDER].contiguous()
    return panels


def pack_quant_weight(blocks: np.ndarray, quant: str) -> torch.Tensor:
    """GGUF blocks [out, in / 32 * block bytes] uint8 -> gemm_quant.c's uint8 panels: per panel
    and block, the scales, then the quants with the PANEL columns side by side."""
    if quant not in QUANT_TYPES:
        raise ValueError(f"no kernel for GGUF type {quant}")
    rows = blocks.shape[0]
    per_block = 20 if quant == "Q4_1" else 34
    nb = blocks.shape[1] // per_block
    pad = -rows % PANEL
    raw = np.concatenate([blocks, np.zeros((pad, blocks.shape[1]), np.uint8)]).reshape(
        -1, PANEL, nb, per_block
    )
    raw = raw.transpose(0, 2, 1, 3)  # [panels, blocks, PANEL columns, block bytes]

    def scale(start: int) -> np.ndarray:  # the float16 at `start`, per column: [p, b, 32]
        return raw[..., start : start + 2].reshape(*raw.shape[:2], -1)

    if quant == "Q8_0":
        q = raw[..., 2:].transpose(0, 1, 3, 2)  # [p, b, k, column] int8 bytes
        parts = [scale(0), q.reshape(*raw.shape[:2], -1)]
    else:
        qs = raw[..., 4:]  # byte j: weight j in the low nibble, weight j + 16 in the high
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).transpose(0, 1, 3, 2)  # [p, b, k, c]
        q = q[..., _Q4_ORDER]  # even columns, then odd: see q4_1_weights in the C
        words = q[..., 0::2] | (q[..., 1::2] << 4)
        parts = [scale(0), scale(2), words.reshape(*raw.shape[:2], -1)]
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(-1))


def panel_format(panels: torch.Tensor, quant: str | None) -> str:
    """What packed panels hold: a GGUF type (`quant`), else bfloat16 or float32 weights."""
    return quant or ("bfloat16" if panels.dtype == torch.bfloat16 else "float32")
