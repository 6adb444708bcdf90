"""The benchmarks' workloads: held-out chat prompts for the default model (bench/
chat_prompts.json, frozen from scripts/chat_prompts.py's `split`, whose hash keeps them out of
the draft's training), six task families of 8 prompts for it (bench/family_prompts.json, frozen
by scripts/family_prompts.py: two-turn chat, translation, summarization of 500-1,500 token
articles, qa, math, rag), and this Python's standard library as text for the GPU pair.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from pathlib import Path

CHAT_PROMPTS = Path(__file__).resolve().parent / "chat_prompts.json"
FAMILY_PROMPTS = CHAT_PROMPTS.with_name("family_prompts.json")
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
HELDOUT_PERCENT = 5


def chat_messages(count: int) -> list[list[dict]]:
    """The first `count` held-out chat instructions, each a list of messages."""
    held = json.loads(CHAT_PROMPTS.read_text())
    if count > len(held):
        raise ValueError(f"only {len(held)} held-out instructions")
    return held[:count]


def family_messages() -> dict[str, list[list[dict]]]:
    """Family (chat, translation, summarization, qa, math, rag) -> its 8 message lists."""
    families = json.loads(FAMILY_PROMPTS.read_text())["families"]
    return {name: [item["messages"] for item in items] for name, items in families.items()}


def family_cycle(count: int) -> list[tuple[str, list[dict]]]:
    """`count` (family, messages) requests, the families in turn: request i is family i % 6's
    prompt i // 6 (prompts repeat past 48 requests)."""
    families = family_messages()
    names = list(families)
    picks = [(i, names[i % len(names)]) for i in range(count)]
    return [(name, families[name][i // len(names) % len(families[name])]) for i, name in picks]


def family_rates(requests: list[tuple[str, float, float, float, int, int]]) -> dict[str, dict]:
    """Per family and "all", from each request's (family, sent, first token, last token, output
    tokens, tokens that came with the first): requests, output tokens, and total tokens over
    total time of decode (after the first token, to the last) and end to end (from sending)."""
    out = {}
    for name in [*dict.fromkeys(r[0] for r in requests), "all"]:
        rs = [r for r in requests if name in (r[0], "all")]
        decode_s, e2e_s = sum(r[3] - r[2] for r in rs), sum(r[3] - r[1] for r in rs)
        tokens = sum(r[4] for r in rs)
        out[name] = {"requests": len(rs), "output_tokens": tokens,
                     "decode_tokens_per_s": (tokens - sum(r[5] for r in rs)) / (decode_s or 1),
                     "e2e_tokens_per_s": tokens / (e2e_s or 1)}  # fmt: skip
    return out


def rates_lines(rates: dict[str, dict]) -> list[str]:
    """`family_rates`' result as the benchmarks print it, a line per family."""
    return [
        f"{name:>13}: {r['requests']:3} requests {r['output_tokens']:6} tokens  decode "
        f"{r['decode_tokens_per_s']:7.1f} tok/s  end-to-end {r['e2e_tokens_per_s']:7.1f} tok/s"
        for name, r in rates.items()
    ]


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
