"""Grammar engines for structured output, side by side on the default model's tokenizer.

  python -m pip install --target /tmp/grammar-engines llguidance xgrammar outlines-core
  python -m bench.grammar_engines --site /tmp/grammar-engines

For each of llguidance, xgrammar and outlines-core: the one-off cost of preparing the
49,152-token vocabulary, compiling a JSON schema, the time to compute the allowed-token mask
at each of a valid document's tokens (what a constrained step pays per verified position),
whether the document is accepted, and whether the matcher can roll back (what speculation
needs after a rejection). The packages are not Tandem's dependencies: `--site` puts a
scratch install on the path after the project's own (so the project's torch stays in use).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench.default_engine import TARGET

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]},
    },
    "required": ["name", "age", "tags", "city"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"], "city": "Paris"}


def _allowed(bitmask, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def llguidance_case(tok, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    t1 = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    t2 = time.perf_counter()
    bitmask, ok, mask_s = lgt.allocate_token_bitmask(1, lltok.vocab_size), True, 0.0
    for t in ids:
        start = time.perf_counter()
        lgt.fill_next_token_bitmask(matcher, bitmask, 0)
        mask_s += time.perf_counter() - start
        ok &= _allowed(bitmask, t)
        matcher.consume_token(t)
    rollback = bool(matcher.rollback(3)) and not matcher.get_error()
    return {
        "vocab_s": t1 - t0,
        "compile_s": t2 - t1,
        "mask_s": mask_s,
        "ok": ok,
        "rollback": rollback,
    }


def xgrammar_case(tok, ids: list[int], vocab: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
    bitmask, ok, mask_s = xgr.allocate_token_bitmask(1, vocab), True, 0.0
    for t in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        mask_s += time.perf_counter() - start
        ok &= _allowed(bitmask, t) and matcher.accept_token(t)
    matcher.rollback(3)
    return {"vocab_s": t1 - t0, "compile_s": t2 - t1, "mask_s": mask_s, "ok": ok, "rollback": True}


def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte-level BPE: the printable stand-in character of each byte."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    stand_in = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            stand_in[chr(256 + extra)] = b
            extra += 1
    return stand_in


def _byte_level(token: str, stand_in: dict[str, int]) -> bytes:
    """A byte-level BPE token string back to its bytes (special tokens as their text)."""
    try:
        return bytes(stand_in[c] for c in token)
    except KeyError:
        return token.encode()


def outlines_case(tok, ids: list[int]) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    vocab: dict[bytes, list[int]] = {}
    stand_in = _byte_level_map()
    for t in range(len(tok)):
        token = tok.convert_ids_to_tokens(t)
        if t != tok.eos_token_id and token is not None:
            vocab.setdefault(_byte_level(token, stand_in), []).append(t)
    vocabulary = outlines_core.Vocabulary(tok.eos_token_id, vocab)
    t1 = time.perf_counter()
    index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
    t2 = time.perf_counter()
    guide, ok, mask_s = outlines_core.Guide(index), True, 0.0
    for t in ids:
        start = time.perf_counter()
        allowed = guide.get_tokens()  # a list of ids, not a bitmask
        mask_s += time.perf_counter() - start
        ok &= t in allowed
        guide.advance(t)
    rollback = hasattr(guide, "rollback_state")
    return {
        "vocab_s": t1 - t0,
        "compile_s": t2 - t1,
        "mask_s": mask_s,
        "ok": ok,
        "rollback": rollback,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--site", help="a pip --target directory holding the three packages")
    args = ap.parse_args(argv)
    if args.site:
        sys.path.append(args.site)
    from transformers import AutoTokenizer

    from engine.model.files import prepare

    tok = AutoTokenizer.from_pretrained(prepare(TARGET))
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False)
    vocab = len(tok)
    print(f"vocabulary {vocab}, document {len(ids)} tokens")
    print(
        "| engine | vocabulary prep | schema compile | mask per token | doc accepted | rollback |"
    )
    print("|---|---:|---:|---:|---|---|")
    cases = {
        "llguidance": lambda: llguidance_case(tok, ids),
        "xgrammar": lambda: xgrammar_case(tok, ids, vocab),
        "outlines-core": lambda: outlines_case(tok, ids),
    }
    for name, run in cases.items():
        try:
            r = run()
        except ImportError as exc:
            print(f"| {name} | not installed ({exc}) | | | | |")
            continue
        print(
            f"| {name} | {r['vocab_s'] * 1e3:.0f} ms | {r['compile_s'] * 1e3:.1f} ms | "
            f"{r['mask_s'] / len(ids) * 1e6:.0f} us | {r['ok']} | {r['rollback']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
