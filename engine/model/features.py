"""What a model asks of its attention beyond Tandem's causal softmax over the paged cache,
refused at start: features its config names (Gemma-2's softcapping, Llama-4's chunks, ALiBi),
then a probe pass every layer must make through engine/attention/paged.py's checks."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from engine.attention import paged as attention
from engine.attention.backends import BACKENDS

REFUSED_CONFIG = (
    "attn_logit_softcapping",
    "attention_chunk_size",
    "alibi",
    "use_bidirectional_attention",
)


def check_config(text_config: PretrainedConfig) -> None:
    for name in REFUSED_CONFIG:
        value = getattr(text_config, name, None)
        if value:
            raise ValueError(
                f"{text_config.model_type}: {name}={value!r} is not implemented by Tandem's "
                "attention"
            )


def config_window(text_config: PretrainedConfig) -> int | None:
    if not getattr(text_config, "use_sliding_window", True):
        return None
    return getattr(text_config, "sliding_window", None) or None


@torch.inference_mode()
def probe_windows(
    model: torch.nn.Module,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[int]:
    """Two tokens through `model` on a throwaway cache: the sliding windows its layers pass.
    ValueError when a layer asks for more than the paged attention does, or never reaches it
    (an attention of its own, e.g. Bloom's, or a recurrent layer)."""
    block = 16
    caches = [
        tuple(torch.zeros(1, block, kv_heads, head_dim, dtype=dtype, device=device) for _ in "kv")
        for _ in range(num_layers)
    ]
    backend = BACKENDS["reference"]
    metadata = attention.build_metadata(caches, block, [2], [2], [[0]], device, backend)
    metadata.windows = {}
    try:
        model(
            input_ids=torch.tensor([[0, 1]], device=device),
            position_ids=torch.tensor([[0, 1]], device=device),
            use_cache=False,
            tandem_metadata=metadata,
            logits_to_keep=1,
        )
    except ValueError:
        raise
    except Exception as exc:  # MPT's ALiBi wants a mask; StableLM keeps the metadata back
        raise ValueError(
            f"{model.config.model_type}: its forward fails on Tandem's paged attention: {exc}"
        ) from exc
    if sorted(metadata.windows) != list(range(num_layers)):
        raise ValueError(
            f"{model.config.model_type}: {num_layers - len(metadata.windows)} of its "
            f"{num_layers} layers do not attend through Tandem's paged attention"
        )
    return [w for w in metadata.windows.values() if w]
