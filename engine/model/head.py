"""A restricted LM head (`head_tokens.json` in a model directory: {"token_ids": [...]}): logits
for those tokens only, every other token at `OUTSIDE_HEAD`, so callers still see the full
vocabulary and a sampled draft's q is exactly the distribution it drew from."""

from __future__ import annotations

import json
from pathlib import Path

import torch

HEAD_TOKENS_FILE = "head_tokens.json"
# Probability exactly 0 next to any real logit, yet finite so penalties and temperature give no NaN.
OUTSIDE_HEAD = -1e30


def restrict_head(model: torch.nn.Module, model_path: str) -> torch.Tensor | None:
    """Swap `model`'s LM head for one over `model_path`'s head_tokens.json ids; those, or None."""
    path = Path(model_path) / HEAD_TOKENS_FILE
    if not path.is_file():
        return None
    full = model.get_output_embeddings()
    vocab = full.weight.shape[0]
    ids = json.loads(path.read_text())["token_ids"]
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i < vocab for i in ids):
        raise ValueError(f"{path}: token_ids must be distinct token ids below {vocab}")
    # Increasing, so greedy ties pick the same token in the head's columns as in the vocabulary.
    index = torch.tensor(sorted(ids), dtype=torch.long, device=full.weight.device)
    head = torch.nn.Linear(full.in_features, len(ids), bias=full.bias is not None)
    with torch.no_grad():
        head.weight = torch.nn.Parameter(full.weight.detach().index_select(0, index).clone())
        if full.bias is not None:
            head.bias = torch.nn.Parameter(full.bias.detach().index_select(0, index).clone())
    model.set_output_embeddings(head)
    return index
