"""A GGUF model's packed linears switched to the file's own Q8_0 / Q4_1 / Q4_0 blocks. Rows are
matched by content (the values of their first dequantized block, then the whole layer checked),
so permuted, fused and tied weights are covered; a layer not wholly found stays as it was."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.cpu import panels as cpu_panels
from engine.cpu.linear import PackedLinear

# GGUF metadata value types (the file format's numbering) -> fixed size in bytes; 8 is a
# string (u64 length + bytes), 9 an array (u32 element type, u64 count, elements).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
KEY_VALUES = cpu_panels.QBLOCK
"""Values of a row's key: its first block's (every type switched here has blocks of 32)."""


def gguf_tensors(path: Path) -> list[tuple[str, int, np.ndarray]]:
    """(name, GGML type, raw data [rows, bytes per row]) of every tensor, memory-mapped; the
    metadata is skipped (gguf's reader is slow on a large vocabulary)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    view = memoryview(buf)
    pos = 0

    def take(fmt: str) -> tuple:
        nonlocal pos
        values = struct.unpack_from("<" + fmt, view, pos)
        pos += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal pos
        (n,) = take("Q")
        pos += n
        return bytes(view[pos - n : pos]).decode("utf-8", "replace")

    def skip(kind: int) -> None:
        nonlocal pos
        if kind == _STRING:
            (n,) = take("Q")
            pos += n
        elif kind == _ARRAY:
            inner, count = take("IQ")
            if inner in _SCALAR_BYTES:
                pos += _SCALAR_BYTES[inner] * count
            else:
                for _ in range(count):
                    skip(inner)
        else:
            pos += _SCALAR_BYTES[kind]

    magic, version, num_tensors, num_kv = take("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path}: not a GGUF file of version 2 or later")
    alignment = 32
    for _ in range(num_kv):
        key = string()
        (kind,) = take("I")
        if key == "general.alignment" and kind in (4, 10):  # uint32 (as written) or uint64
            (alignment,) = struct.unpack_from("<I" if kind == 4 else "<Q", view, pos)
        skip(kind)
    infos = []
    for _ in range(num_tensors):
        name = string()
        (dims,) = take("I")
        shape = take("Q" * dims)
        kind, offset = take("IQ")
        infos.append((name, shape, kind, offset))
    start = -(-pos // alignment) * alignment
    tensors = []
    for name, shape, kind, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        row_bytes = shape[0] // block * block_bytes
        rows = int(np.prod(shape[1:], dtype=np.int64))
        data = buf[start + offset : start + offset + rows * row_bytes]
        tensors.append((name, kind, np.asarray(data).reshape(rows, row_bytes)))
    return tensors


def q4_0_as_q4_1(raw: np.ndarray) -> np.ndarray | None:
    """Q4_0 blocks [rows, blocks * 18 bytes] (w = d (q - 8)) as Q4_1 blocks [rows, blocks * 20
    bytes] (w = d q + m) with m = -8 d, or None when some -8 d overflows float16. Exact: -8 d
    only moves d's exponent, and d q - 8 d is exact in float32 (but -0.0 becomes 0.0)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 18)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)
    with np.errstate(over="ignore"):  # an overflow is refused below
        m = (d.astype(np.float32) * -8.0).astype(np.float16)
    if not np.isfinite(m[np.isfinite(d)]).all():
        return None
    return np.concatenate([blocks[..., :2], m.view(np.uint8), blocks[..., 2:]], axis=-1).reshape(
        rows, -1
    )


def _row_keys(values: np.ndarray) -> list[bytes]:
    """A key per row [rows, >= KEY_VALUES]: the bytes of its first KEY_VALUES float32 values."""
    head = np.ascontiguousarray(values[:, :KEY_VALUES], dtype=np.float32)
    return [row.tobytes() for row in head]


class _Rows:
    """Every row of the file's quantized tensors by the key of its first dequantized block."""

    def __init__(self, gguf_path: Path) -> None:
        from gguf import GGMLQuantizationType
        from gguf.constants import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        # (kernel type, the file's type, raw blocks [rows, bytes]) per tensor
        self.tensors: list[tuple[str, str, np.ndarray]] = []
        # row key -> (tensor, row) of each row with that first block
        self.index: dict[bytes, list[tuple[int, int]]] = {}
        for _, number, raw in gguf_tensors(gguf_path):
            qtype = GGMLQuantizationType(number)
            source = kind = qtype.name
            blocks: np.ndarray | None = raw
            if source == "Q4_0":
                kind, blocks = "Q4_1", q4_0_as_q4_1(raw)
            if kind not in cpu_panels.QUANT_TYPES or blocks is None:
                continue
            block_bytes = GGML_QUANT_SIZES[qtype][1]  # one block: KEY_VALUES values
            first = dequantize(np.ascontiguousarray(raw[:, :block_bytes]), qtype)
            t = len(self.tensors)
            self.tensors.append((kind, source, blocks))
            for r, key in enumerate(_row_keys(first)):
                self.index.setdefault(key, []).append((t, r))

    def _find(self, key: bytes, row: np.ndarray) -> tuple[int, int] | None:
        """The first file row equal to `row` among those whose first block is `key`'s."""
        candidates = self.index.get(key, ())
        if len(candidates) == 1:
            return candidates[0]  # use_gguf_blocks checks the whole layer
        for t, r in candidates:
            kind, _, blocks = self.tensors[t]
            values = dequantize_rows(blocks[r : r + 1], kind)[0]
            if np.array_equal(values, row):
                return t, r
        return None

    def blocks_for(self, weight: torch.Tensor) -> tuple[str, str, np.ndarray] | None:
        """(kernel type, the file's types e.g. "Q4_0+Q4_1", blocks [rows, bytes]) exactly
        `weight`'s rows, or None (a row missing, or mixed kernel types)."""
        values = weight.detach().float().contiguous().numpy()
        if values.shape[1] % cpu_panels.QBLOCK:
            return None
        found = [self._find(key, row) for key, row in zip(_row_keys(values), values, strict=True)]
        if any(f is None for f in found):
            return None
        kinds = {self.tensors[t][0] for t, _ in found}
        widths = {self.tensors[t][2].shape[1] for t, _ in found}
        if len(kinds) != 1 or len(widths) != 1:
            return None
        sources = "+".join(sorted({self.tensors[t][1] for t, _ in found}))
        blocks = np.stack([self.tensors[t][2][r] for t, r in found])
        return kinds.pop(), sources, blocks


def dequantize_rows(blocks: np.ndarray, kind: str) -> np.ndarray:
    """Rows of Q8_0 or Q4_1 blocks [rows, bytes] as float32 values [rows, values]: the gguf
    package's arithmetic, over all the blocks at once."""
    from gguf import GGMLQuantizationType, quants
    from gguf.constants import GGML_QUANT_SIZES

    qtype = GGMLQuantizationType[kind]
    codec = {"Q8_0": quants.Q8_0, "Q4_1": quants.Q4_1}[kind]
    flat = np.ascontiguousarray(blocks).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    return codec.dequantize_blocks(flat).reshape(blocks.shape[0], -1).astype(np.float32, copy=False)


def use_gguf_blocks(module: nn.Module, gguf_path: Path) -> dict[str, int]:
    """Switch every `PackedLinear` of `module` whose weights are rows of `gguf_path`'s Q8_0 /
    Q4_1 / Q4_0 tensors to those blocks; returns how many layers went to each file type."""
    rows = _Rows(gguf_path)
    switched: dict[str, int] = {}
    for layer in module.modules():
        if not isinstance(layer, PackedLinear) or layer.quant is not None:
            continue
        match = rows.blocks_for(layer.weight)
        if match is None:
            continue
        kind, source, blocks = match
        check = dequantize_rows(blocks, kind)
        if not np.array_equal(check, layer.weight.detach().numpy()):  # rows alike in a block
            continue
        layer.use_quantized(cpu_panels.pack_quant_weight(blocks, kind), kind)
        switched[source] = switched.get(source, 0) + 1
    return switched
