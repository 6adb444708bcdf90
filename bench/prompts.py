"""Benchmark prompts: windows of held-out text the default pair never trained on.

The held-out split is the training script's own (a hash of each stdlib file's path), loaded
from scripts/train_toy_pair.py so the two can never disagree.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

from transformers import PreTrainedTokenizerBase

_TRAIN_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_toy_pair.py"


def training_module():
    """scripts/train_toy_pair.py as a module (it is a script, not a package member)."""
    spec = importlib.util.spec_from_file_location("train_toy_pair", _TRAIN_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def heldout_texts() -> list[str]:
    # No cap: the training run's 64M-character cap is above the whole stdlib, so this is the
    # same held-out set it used.
    return training_module().collect_corpus(10**12).heldout_texts


def make_prompts(
    tokenizer: PreTrainedTokenizerBase,
    count: int,
    min_tokens: int = 32,
    max_tokens: int = 256,
    seed: int = 0,
) -> list[list[int]]:
    """`count` prompts of min..max tokens, each starting at a line start of a held-out file."""
    rng = random.Random(seed)
    texts = [t for t in heldout_texts() if len(t) > 4 * max_tokens]
    prompts = []
    while len(prompts) < count:
        text = rng.choice(texts)
        lines = text.splitlines(keepends=True)
        start = rng.randrange(max(len(lines) - 8, 1))
        # 16 characters per token is far more text than max_tokens needs.
        text = "".join(lines[start:])[: 16 * max_tokens]
        ids = tokenizer.encode(text, add_special_tokens=False)
        length = rng.randint(min_tokens, max_tokens)
        if len(ids) >= length:
            prompts.append(ids[:length])
    return prompts
