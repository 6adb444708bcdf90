"""A restricted LM head: logits for the tokens a model may ever propose, not its whole vocabulary.

A model directory may hold `head_tokens.json` ({"token_ids": [...]}): the runner then computes
logits for those tokens only (a draft whose LM head covers the tokens it may ever propose, as
in frequency-ranked drafting) and gives every other token a logit of -1e30, so callers still
see the full vocabulary and a sampled draft's q is exactly the distribution it drew from.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HEAD_TOKENS_FILE = "head_tokens.json"
# The logit of a token outside a restricted head: probability exactly 0 next to any real
# logit, finite so that penalties and temperature keep it finite (no NaN even if a mask
# removed every head token).
OUTSIDE_HEAD = -1e30


def restrict_head(model: torch.nn.Module, model_path: str) -> torch.Tensor | None:
    """Swap the LM head of `model` for one over the token ids in `model_path`'s
    head_tokens.json, if there is one; return those ids (None: the full vocabulary)."""
    path = Path(model_path) / HEAD_TOKENS_FILE
    if not path.is_file():
        return None
    full = model.get_output_embeddings()
    vocab = full.weight.shape[0]
    ids = json.loads(path.read_text())["token_ids"]
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i < vocab for i in ids):
        raise ValueError(f"{path}: token_ids must be distinct token ids below {vocab}")
    # In increasing order, so the first of equal largest logits is the same token in the
    # head's columns as in the vocabulary's (the draft's greedy pick reads the columns).
    index = torch.tensor(sorted(ids), dtype=torch.long, device=full.weight.device)
    head = torch.nn.Linear(full.in_features, len(ids), bias=full.bias is not None)
    with torch.no_grad():
        head.weight = torch.nn.Parameter(full.weight.detach().index_select(0, index).clone())
        if full.bias is not None:
            head.bias = torch.nn.Parameter(full.bias.detach().index_select(0, index).clone())
    model.set_output_embeddings(head)
    return index
