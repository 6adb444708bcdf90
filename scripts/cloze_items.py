"""The cloze set that measures a change of the served model's numbers (`--cpu-activations`,
bench/quality.py): `python scripts/cloze_items.py > bench/cloze_items.json` freezes it.

Each item is a sentence from a standard-library docstring whose last word is hidden, after
the sentence before it for context, with four candidates: that word and three other items'
last words (a seeded draw). A model picks the candidate it gives the highest log-likelihood.
Nothing is downloaded: the text is what every machine with Python has, frozen into the file
so that it no longer depends on the Python version that built it. Deterministic.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import sys

SKIP = {
    "antigravity",
    "this",
    "idlelib",
    "turtledemo",
    "ensurepip",
    "venv",
    "lib2to3",
    "pydoc_data",
}
"""Modules that act when imported (a browser, a print) or hold no library docstrings."""
ITEMS = 600
WORD = re.compile(r"[a-z]{4,14}")
CODE = re.compile(r"[`\[\]{}<>=*_#|\\/@$%^~\"]")  # sentences of code, not prose


def _docstrings() -> list[str]:
    """The docstrings of the standard library's public modules, their public names and
    those classes' public methods."""
    found: list[str] = []
    for name in sorted(sys.stdlib_module_names - SKIP):
        if name.startswith("_"):
            continue
        try:
            mod = importlib.import_module(name)
        except Exception:  # e.g. tkinter without Tk: the frozen file keeps what was there
            continue
        objects = [mod]
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or getattr(obj, "__module__", name) != mod.__name__:
                continue
            objects.append(obj)
            if inspect.isclass(obj):
                objects += [m for a, m in sorted(vars(obj).items()) if not a.startswith("_")]
        found += [d for d in (inspect.getdoc(o) for o in objects) if isinstance(d, str)]
    return found


def _pairs(doc: str) -> list[tuple[str, str]]:
    """(the sentence before or "", sentence) of a docstring's paragraphs."""
    out = []
    for paragraph in doc.split("\n\n"):
        sentences = re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split()))
        out += list(zip(["", *sentences], sentences, strict=False))
    return out


def items() -> list[dict]:
    seen, candidates = set(), []
    for doc in _docstrings():
        for before, sentence in _pairs(doc):
            words = sentence.split()
            if not 8 <= len(words) <= 40 or not sentence.endswith(".") or sentence in seen:
                continue
            if CODE.search(before + sentence) or not sentence[0].isupper():
                continue
            last = words[-1][:-1]
            if WORD.fullmatch(last):
                seen.add(sentence)
                candidates.append((" ".join([before, *words[:-1]]).strip(), last))
    rng = random.Random(0)
    chosen = rng.sample(sorted(candidates), ITEMS)
    words = sorted({last for _, last in chosen})
    out = []
    for context, answer in chosen:
        others = rng.sample([w for w in words if w != answer], 3)
        choices = sorted([answer, *others])
        out.append({"context": context, "choices": choices, "answer": choices.index(answer)})
    return out


def main() -> None:
    made = items()
    json.dump(made, sys.stdout, indent=0)
    sys.stdout.write("\n")
    print(f"{len(made)} items", file=sys.stderr)


if __name__ == "__main__":
    main()
