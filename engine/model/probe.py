"""The start-up check of a native forward against transformers' on the same weights: the
largest logit difference relative to the largest logit, within `NATIVE_TOLERANCE`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention import paged as attention
from engine.attention.paged import AttentionBackend
from engine.model.native import NativeForward

# bfloat16: the fused Triton kernels round once where torch rounds after every operator; a bug
# (a wrong rotation, a missed cache write) is off by the logits' own size.
NATIVE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


@torch.inference_mode()
def native_error(
    native: NativeForward,
    hf_logits: Callable[..., torch.Tensor],  # ModelRunner.hf_logits: transformers' forward
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
) -> float:
    """Largest relative logit difference between the native and the transformers forward on
    a two-request prefill and a step of one and two tokens on top of it."""
    block_size, vocab = 4, vocab_size
    shape = (4, block_size, num_kv_heads, head_dim)
    tables = [[0, 1], [2, 3]]
    steps = [([6, 3], [6, 3]), ([1, 2], [7, 5])]  # (query lens, context lens)
    gen = torch.Generator().manual_seed(0)
    logits = []
    for use_native in (False, True):
        caches = [
            tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
            for _ in range(num_layers)
        ]
        out = []
        for q_lens, ctx_lens in steps:
            gen.manual_seed(sum(ctx_lens))
            ids = torch.randint(vocab, (sum(q_lens),), generator=gen).to(device)
            pos = [p for q, c in zip(q_lens, ctx_lens, strict=True) for p in range(c - q, c)]
            positions = torch.tensor(pos, device=device)
            md = attention.build_metadata(
                caches,
                block_size,
                q_lens,
                ctx_lens,
                tables,
                device,
                backend,
            )
            if use_native:
                out.append(native.logits(native(ids, positions, md)))
            else:
                out.append(hf_logits(ids, positions, md, None))
        logits.append(torch.cat(out).float())
    ref, got = logits
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
