"""A loaded model switched onto Tandem's C kernels (float32 on the CPU): the native forward
(probed again) or else the linears, then quantized blocks where exact (`--gguf-blocks`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.cpu import kernels as cpu_kernels
from engine.cpu import linear as cpu_linear
from engine.cpu.gguf_blocks import use_gguf_blocks
from engine.cpu.linear import PackedLinear
from engine.model.files import gguf_source
from engine.model.probe import NATIVE_TOLERANCE
from engine.model.quantization import use_blocks

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model.runner import ModelRunner

logger = logging.getLogger(__name__)


def draft_beside_gguf_blocks(
    config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> bool:
    """Whether --draft-quantization auto rounds the draft to int4: the target will run on its
    GGUF file's blocks and the draft is a Hugging Face checkpoint."""
    model, draft = config.model, config.spec.draft_model
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and model.cpu_packed_linear
        and model.gguf_blocks
        and gguf_source(model.model) is not None
        and not (draft and gguf_source(draft) is not None)
        and cpu_kernels.available()
    )


def quantized_linears(runner: ModelRunner) -> int:
    """How many of `runner`'s linears run on quantized blocks (a GGUF file's or
    --quantization's): what --cpu-activations applies to."""
    module = runner.native if runner.native is not None else runner.model
    return sum(isinstance(m, PackedLinear) and m.quant is not None for m in module.modules())


def use_cpu_kernels(runner: ModelRunner, gguf_blocks: bool = True) -> str:
    """Switch `runner` onto the kernels; returns (and keeps in `runner.kernels`) what runs on
    them. A native forward that drifts falls back to transformers' (`native`: stops the start)."""
    runner.kernels = _switch(runner, gguf_blocks)
    return runner.kernels


def _switch(runner: ModelRunner, gguf_blocks: bool) -> str:
    native = runner.native
    if native is not None:
        if native.use_cpu_kernels():
            done = "native forward on the C kernels"
        else:  # e.g. q/k norms: those steps stay on torch, the linears go packed
            done = f"native forward, {cpu_linear.pack_linears(native)} linears packed"
        done += _use_gguf_blocks(runner, native) if gguf_blocks else ""
        done += _use_quant_blocks(runner, native)
        error = runner.native_error(native)
        if error <= NATIVE_TOLERANCE[runner.dtype]:
            return done
        if runner.model_impl_setting == "native":
            raise ValueError(
                f"--model-impl native: {runner.name}: on the CPU kernels its "
                f"logits differ from transformers' by {error:.2e}"
            )
        logger.warning(
            "%s: on the CPU kernels the native forward's logits differ from "
            "transformers' by %.2e: running transformers'",
            runner.name,
            error,
        )
        runner.native, runner.model_impl = None, "transformers"
    packed = cpu_linear.pack_linears(runner.model)
    done = f"{packed} linear layers on packed weights"
    done += _use_gguf_blocks(runner, runner.model) if gguf_blocks else ""
    return done + _use_quant_blocks(runner, runner.model)


def _use_quant_blocks(runner: ModelRunner, module: torch.nn.Module) -> str:
    """Packed linears of a `--quantization int8/int4` model onto kernel blocks holding
    exactly their rounded weights; what was switched, for the log."""
    switched = use_blocks(module, runner.quantization)
    kinds = ", ".join(f"{n} on {kind}" for kind, n in sorted(switched.items()))
    return f"; {kinds} blocks (--quantization {runner.quantization})" if kinds else ""


def _use_gguf_blocks(runner: ModelRunner, module: torch.nn.Module) -> str:
    """Packed linears of a converted GGUF model onto the file's own quantized blocks
    (same outputs, fewer bytes per pass); what was switched, for the log."""
    source = gguf_source(runner.name)
    if source is None:
        return ""
    switched = use_gguf_blocks(module, source)
    if not switched:
        return f"; no layer matches a Q8_0/Q4_1/Q4_0 tensor of {source.name}"
    kinds = ", ".join(
        f"{n} on {kind}" + (" (run as Q4_1)" if "Q4_0" in kind else "")
        for kind, n in sorted(switched.items())
    )
    return f"; {kinds} blocks of {source.name}"
