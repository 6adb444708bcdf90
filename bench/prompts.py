"""The benchmarks' workloads: held-out chat prompts for the default model, and this Python's
standard library as text for the GPU pair.

`chat_messages(n)`: the first n held-out chat instructions (bench/chat_prompts.json, frozen
from scripts/chat_prompts.py's `split`, whose hash keeps them out of the draft's training).
`stdlib_corpus()`: the standard library's .py files, split train / held-out by a hash of each
file's path; `text_prompts` cuts token prompts from the held-out files.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from pathlib import Path

CHAT_PROMPTS = Path(__file__).resolve().parent / "chat_prompts.json"
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
HELDOUT_PERCENT = 5


def chat_messages(count: int) -> list[list[dict]]:
    """The first `count` held-out chat instructions, each a list of messages."""
    held = json.loads(CHAT_PROMPTS.read_text())
    if count > len(held):
        raise ValueError(f"only {len(held)} held-out instructions")
    return held[:count]


def stdlib_corpus(max_chars: int) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): the standard library's files in sorted order up to
    `max_chars` characters, each held out when a hash of its path says so (not a random draw:
    the split must not depend on a seed or on the cap)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[str] = []
    held: list[str] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib files are deliberately not UTF-8
        if not text.strip():
            continue
        if total + len(text) > max_chars:
            break
        total += len(text)
        digest = hashlib.sha256(rel.as_posix().encode()).hexdigest()
        (held if int(digest[:8], 16) % 100 < HELDOUT_PERCENT else train).append(text)
    return train, held


def text_prompts(
    tokenizer, count: int, min_tokens: int = 32, max_tokens: int = 256, seed: int = 0
) -> list[list[int]]:
    """`count` token prompts of min..max tokens, each from a line start of a held-out file."""
    rng = random.Random(seed)
    texts = [t for t in stdlib_corpus(10**12)[1] if len(t) > 4 * max_tokens]
    prompts: list[list[int]] = []
    while len(prompts) < count:
        lines = rng.choice(texts).splitlines(keepends=True)
        start = rng.randrange(max(len(lines) - 8, 1))
        text = "".join(lines[start:])[: 16 * max_tokens]  # far more text than max_tokens needs
        ids = tokenizer.encode(text, add_special_tokens=False)
        length = rng.randint(min_tokens, max_tokens)
        if len(ids) >= length:
            prompts.append(ids[:length])
    return prompts
