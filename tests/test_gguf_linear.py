"""engine/cpu/gguf_blocks.py: packed linears switched onto a GGUF file's own Q8_0 / Q4_1
blocks (Q4_0 as Q4_1 blocks of the same weights) only where every row is found there, with
the same outputs up to the summation order (the blocks' kernel sums each block's quants
before scaling them). (The real model runs this way in tests/test_default_model.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine.cpu import kernels as cpu_kernels
from engine.cpu.gguf_blocks import gguf_tensors, q4_0_as_q4_1, use_gguf_blocks
from engine.cpu.linear import PackedLinear
from engine.model import files as model_files

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"no CPU kernels: {cpu_kernels.unavailable_reason()}"
)


def _quantized(rows: int, cols: int, kind: str, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """(GGUF blocks, their dequantized float32 weights)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = gguf.quants.quantize(w, qtype)
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))


def _linear(weight: torch.Tensor) -> PackedLinear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return PackedLinear(layer)


def test_layers_whose_rows_are_all_in_the_file_switch_and_keep_their_outputs(tmp_path: Path):
    q_blocks, q = _quantized(48, 64, "Q4_1", 0)  # e.g. attn_q
    k_blocks, k = _quantized(16, 64, "Q4_1", 1)  # attn_k
    e_blocks, e = _quantized(40, 64, "Q8_0", 2)  # token_embd (a tied LM head)
    f_blocks, f = _quantized(32, 64, "Q8_0", 3)
    g_blocks, g = _quantized(32, 64, "Q4_0", 6)  # ffn_gate
    v_blocks, v = _quantized(16, 64, "Q4_0", 7)  # attn_v
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, blocks, kind in [
        ("blk.0.attn_q.weight", q_blocks, "Q4_1"),
        ("blk.0.attn_k.weight", k_blocks, "Q4_1"),
        ("token_embd.weight", e_blocks, "Q8_0"),
        ("blk.0.ffn_up.weight", f_blocks, "Q8_0"),
        ("blk.0.ffn_gate.weight", g_blocks, "Q4_0"),
        ("blk.0.attn_v.weight", v_blocks, "Q4_0"),
    ]:
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    perm = torch.randperm(48, generator=torch.Generator().manual_seed(0))
    stray = f.clone()
    stray[5, 7] += 1e-3  # one weight the file does not have
    module = nn.ModuleDict(
        {
            "qk": _linear(torch.cat([q[perm], k])),  # permuted rows, fused with another tensor
            "head": _linear(e),
            "stray": _linear(stray),
            "mixed": _linear(torch.cat([q, e[:16]])),  # Q4_1 rows next to Q8_0 rows
            "gate": _linear(g),  # Q4_0: runs as Q4_1 blocks
            "kv": _linear(torch.cat([k, v])),  # Q4_1 rows next to Q4_0 rows: one kernel type
        }
    )
    x = torch.randn(5, 64)
    before = {name: layer(x) for name, layer in module.items()}
    assert use_gguf_blocks(module, path) == {"Q4_1": 1, "Q8_0": 1, "Q4_0": 1, "Q4_0+Q4_1": 1}
    assert module["qk"].quant == "Q4_1" and module["head"].quant == "Q8_0"
    assert module["gate"].quant == "Q4_1" and module["kv"].quant == "Q4_1"
    assert module["stray"].quant is None and module["mixed"].quant is None
    for name, layer in module.items():
        if layer.quant is None:  # left as it was: the same bits
            assert torch.equal(layer(x), before[name]), name
        else:  # the same sums, rounded in another order
            torch.testing.assert_close(layer(x), before[name], rtol=1e-5, atol=1e-5)
            assert not torch.equal(layer(x), before[name]), name  # the blocks' kernel ran


def test_q4_0_blocks_become_q4_1_blocks_of_the_same_weights():
    """m = -8 d: every weight the same float32 value (the same bits, but for a zero weight
    under a negative scale, -0.0 in Q4_0 and 0.0 here), scales from the smallest subnormal
    to the largest that fits; a scale whose -8 d overflows float16 is refused."""
    blocks, w = _quantized(24, 96, "Q4_0", 8)
    d = blocks.reshape(24, 3, 18)[..., :2].copy().view(np.float16)
    d[0, 0], d[1, 1], d[2, 2], d[3, 0] = 2.0**-24, 6e-5, 8188.0, -8188.0  # subnormal .. limit
    blocks.reshape(24, 3, 18)[..., :2] = d.view(np.uint8)
    w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0)
    as_q4_1 = q4_0_as_q4_1(blocks)
    assert as_q4_1.shape == (24, 3 * 20)
    same = gguf.quants.dequantize(as_q4_1, gguf.GGMLQuantizationType.Q4_1).astype(np.float32)
    w = w.astype(np.float32)
    assert np.array_equal(same, w)
    nonzero = w != 0
    assert np.array_equal(same[nonzero].view(np.uint32), w[nonzero].view(np.uint32))
    d[4, 1] = 8192.0  # -8 d = -65536: past float16's largest
    blocks.reshape(24, 3, 18)[..., :2] = d.view(np.uint8)
    assert q4_0_as_q4_1(blocks) is None


def test_the_tensor_table_reader_agrees_with_ggufs_own(tmp_path: Path):
    """gguf_tensors skips the metadata (strings, arrays of strings and numbers, a custom
    alignment) and finds every tensor's bytes where gguf's reader does."""
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "é", ""] * 50)
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0] * 20)
    writer.add_uint32("llama.block_count", 1)
    q_blocks, _ = _quantized(16, 64, "Q4_1", 4)
    e_blocks, _ = _quantized(8, 96, "Q8_0", 5)
    writer.add_tensor("blk.0.attn_q.weight", q_blocks, raw_shape=q_blocks.shape,
                      raw_dtype=gguf.GGMLQuantizationType.Q4_1)  # fmt: skip
    writer.add_tensor("output_norm.weight", np.arange(7, dtype=np.float32))
    writer.add_tensor("token_embd.weight", e_blocks, raw_shape=e_blocks.shape,
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = gguf_tensors(path)
    theirs = gguf.GGUFReader(path).tensors
    assert [(name, kind) for name, kind, _ in ours] == [
        (t.name, int(t.tensor_type)) for t in theirs
    ]
    for (_, _, data), tensor in zip(ours, theirs, strict=True):
        assert data.tobytes() == np.asarray(tensor.data).tobytes()
    assert np.array_equal(ours[0][2], q_blocks) and np.array_equal(ours[2][2], e_blocks)


def test_gguf_source_names_the_converted_file_while_it_exists(tmp_path: Path):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    converted = tmp_path / "converted"
    converted.mkdir()
    assert model_files.gguf_source(str(converted)) is None  # a plain HF directory
    (converted / "tandem-gguf.json").write_text(json.dumps({"source": str(source)}))
    assert model_files.gguf_source(str(converted)) == source
    source.unlink()
    assert model_files.gguf_source(str(converted)) is None


def test_rows_alike_in_their_first_block_are_told_apart(tmp_path: Path):
    """Rows are found by their first block's values; rows sharing it (e.g. padding rows of an
    embedding) are compared whole, so a layer made of the second of two such rows still
    switches, onto the right blocks."""
    blocks, _ = _quantized(4, 64, "Q4_1", 9)
    blocks = blocks.copy()
    blocks[1, :20] = blocks[0, :20]  # rows 0 and 1: the same first block, different second
    qtype = gguf.GGMLQuantizationType.Q4_1
    w = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    assert torch.equal(w[0, :32], w[1, :32]) and not torch.equal(w[0], w[1])
    path = tmp_path / "twins.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    module = nn.ModuleDict({"twins": _linear(w[[1, 3, 0]])})
    x = torch.randn(3, 64)
    before = module["twins"](x)
    assert use_gguf_blocks(module, path) == {"Q4_1": 1}
    torch.testing.assert_close(module["twins"](x), before, rtol=1e-5, atol=1e-5)
