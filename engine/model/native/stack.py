"""The arguments of `cpu_kernels.layers` for a native Llama forward, built once and kept until
the caches are reallocated or a linear's panels repacked."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.cpu import kernels as cpu_kernels
from engine.cpu.linear import PackedLinear

if TYPE_CHECKING:
    from engine.model.native.llama import LlamaForward


@dataclass
class LayerStack:
    # PackedLinear.changes and the caches' list by identity, length and first/last addresses
    key: tuple
    layers: ctypes.Array  # one `cpu_kernels.Layer` per decoder layer
    head: cpu_kernels.Weight
    shape: tuple[int, int, int, int]  # heads, kv_heads, head_dim, intermediate size
    eps: float
    scale: float
    final_norm: torch.Tensor
    final_eps: float
    width: int
    """The LM head's output columns."""
    cos: int
    sin: int
    block_size: int
    kv_type: int
    embed_rows: np.ndarray | None
    """The embedding's weight as an array, for a plain `nn.Embedding` (rows copied by numpy
    indexing); None for an input layer of its own (a feature draft's)."""
    scratch: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def scratch_for(self, floats: int) -> torch.Tensor:
        """A buffer of at least `floats` float32s, kept from pass to pass (grown as needed)."""
        if self.scratch.numel() < floats:
            self.scratch = torch.empty(floats)
        return self.scratch


def stack_key(kv_caches: list) -> tuple:
    ends = (kv_caches[0][0].data_ptr(), kv_caches[-1][-1].data_ptr())
    return (PackedLinear.changes, id(kv_caches), len(kv_caches), ends)


def build_stack(native: LlamaForward, kv_caches: list, key: tuple) -> LayerStack:
    layers = (cpu_kernels.Layer * len(native.layers))()
    for entry, layer in zip(layers, native.layers, strict=True):
        key_cache, value_cache = kv_caches[layer.layer_idx]
        for name, linear in (
            ("qkv", layer.qkv),
            ("o", layer.o_proj),
            ("gate_up", layer.gate_up),
            ("down", layer.down_proj),
        ):
            packed: PackedLinear = linear
            weight = cpu_kernels.weight(packed.panels, packed.packed_bias, packed.quant)
            setattr(entry, name, weight)
        entry.input_norm = layer.input_norm.weight.data_ptr()
        entry.post_norm = layer.post_norm.weight.data_ptr()
        entry.key_cache, entry.value_cache = key_cache.data_ptr(), value_cache.data_ptr()
    lm: PackedLinear = native.lm_head
    first, key_cache, embed = native.layers[0], kv_caches[0][0], native.embed_tokens
    return LayerStack(
        key,
        layers,
        cpu_kernels.weight(lm.panels, lm.packed_bias, lm.quant),
        (first.num_heads, first.num_kv_heads, first.head_dim, first.intermediate),
        first.input_norm.variance_epsilon,
        first.scaling,
        native.norm.weight,
        native.norm.variance_epsilon,
        lm.out_features,
        native.cos.data_ptr(),
        native.sin.data_ptr(),
        key_cache.shape[1],
        cpu_kernels.kv_type(key_cache.dtype),
        embed.weight.detach().numpy() if type(embed) is torch.nn.Embedding else None,
    )
