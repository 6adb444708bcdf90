"""Tandem's own forward passes for registered architectures (`--model-impl`), sharing the loaded
Hugging Face weights: `forward(input_ids [tokens], positions [tokens], metadata)` -> hidden
[tokens, hidden], writing K/V at `metadata.slot_mapping` and attending through
`metadata.backend`; `logits(hidden [rows, hidden])` -> [rows, vocab]."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from engine.attention.paged import AttentionMetadata
from engine.model.native import llama

MODEL_IMPLS = ("auto", "native", "transformers")


class NativeForward(Protocol):
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def use_cpu_kernels(self) -> bool:
        """Switch to Tandem's C kernels (engine/cpu/kernels.py) where this forward can: True
        if it now runs on them, False (changing nothing) if it cannot."""
        ...

    def use_triton_ops(self) -> bool:
        """On CUDA, switch to fused Triton kernels where this forward can; as above."""
        ...


@dataclass(frozen=True)
class Implementation:
    supports: Callable[[nn.Module], str | None]
    """None when it can run this loaded model, else why not."""
    build: Callable[[nn.Module], NativeForward]


_LLAMA = Implementation(llama.supports, llama.LlamaForward)
REGISTRY: dict[str, Implementation] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
}


def build_native(hf_model: nn.Module) -> tuple[NativeForward | None, str]:
    """Tandem's forward for `hf_model`, or None and why there is none."""
    arch = type(hf_model).__name__
    impl = REGISTRY.get(arch)
    if impl is None:
        return None, f"no native forward for {arch} (registered: {', '.join(REGISTRY)})"
    reason = impl.supports(hf_model)
    if reason is not None:
        return None, f"{arch} with {reason} is not supported natively"
    return impl.build(hf_model), ""
