"""What structured output costs, and how the draft fares under a grammar: the default pair
in-process (no HTTP), the same JSON-extraction prompts with and without a JSON schema.

  python -m bench.structured                                  # c=1 and c=16, off and adaptive
  python -m bench.structured --concurrency 16 --configs adaptive ngram --requests 48

For each config and concurrency, the prompts run unconstrained and then under SCHEMA (greedy,
natural stops, up to --max-tokens): output tok/s (prefills included), constrained over free,
the draft tokens accepted per drafted and tokens per verifying pass (under the grammar the
draft proposes from its masked distribution; the tokens the grammar forces are drafted by
the grammar itself, counted apart), and the grammar's share of engine step time (masks,
matcher moves, draft checks). The constrained outputs are checked to parse.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from transformers import AutoTokenizer

from bench.chat_prompts import COUNTRIES
from bench.default_engine import CONFIGS, engine
from engine.config import SpecConfig
from engine.types.request import GrammarSpec, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "maxLength": 40},
        "capital": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "number"},
        "continent": {
            "enum": ["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]
        },
        "fact": {"type": "string", "maxLength": 160},
    },
    "required": ["country", "capital", "population_millions", "continent", "fact"],
    "additionalProperties": False,
}
SPECS = {
    **CONFIGS,
    "ngram": SpecConfig(method="ngram", max_draft_tokens=4, draft_length="adaptive"),
}


def _prompts(model_dir: str, requests: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    countries = list(COUNTRIES)
    out = []
    for i in range(requests):
        ask = (
            f"Describe {countries[i % len(countries)]} as a JSON object: its capital, population "
            "in millions, continent and one short fact."
        )
        text = tok.apply_chat_template(
            [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
        )
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def run(config: str, concurrency: int, requests: int, max_tokens: int, constrained: bool) -> dict:
    eng = engine(replace(SPECS[config]))
    prompts = _prompts(eng.config.model.model, requests)
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA)) if constrained else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar)
    if grammar is not None:
        eng.grammars.check(grammar)  # compiled before the clock starts, as the server does
    queue = iter(enumerate(prompts))
    for i, prompt in zip(range(concurrency), queue, strict=False):
        eng.add_request(str(i), prompt[1], params)
    outputs: dict[str, list[int]] = {}
    cut = 0  # requests that reached max_tokens
    tokens, start = 0, time.perf_counter()
    while eng.has_work():
        for out in eng.step():
            tokens += len(out.new_token_ids)
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                cut += out.finish_reason == "length"
                nxt = next(queue, None)
                if nxt is not None:
                    eng.add_request(str(nxt[0]), nxt[1], params)
    seconds = time.perf_counter() - start
    s = eng.stats()
    valid = 0
    if constrained:
        tok = AutoTokenizer.from_pretrained(eng.config.model.model)
        for ids in outputs.values():
            try:
                json.loads(tok.decode(ids, skip_special_tokens=True))
                valid += 1
            except json.JSONDecodeError:
                pass
    return {
        "tok_s": tokens / seconds,
        "tokens": tokens,
        "acceptance": s.spec_accepted_tokens / max(s.spec_drafted_tokens, 1),
        "per_pass": (s.spec_accepted_tokens + s.spec_verify_passes) / max(s.spec_verify_passes, 1),
        "grammar_share": s.grammar_seconds / max(s.step_seconds, 1e-9),
        "forced": f"{s.grammar_forced_accepted} / {s.grammar_forced_drafted}",
        "valid": valid,
        "cut": cut,
        "requests": len(outputs),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["off", "adaptive"], choices=list(SPECS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    print(
        "| config | c | free tok/s | JSON tok/s | ratio | acceptance free / JSON "
        "| tokens per pass free / JSON | grammar share of step | valid JSON | cut at max_tokens "
        "| output tokens free / JSON | forced drafts kept / drafted |"
    )
    print("|---|---:|---:|---:|---:|---|---|---:|---:|---:|---|---|")
    for c in args.concurrency:
        for name in args.configs:
            free = run(name, c, args.requests, args.max_tokens, constrained=False)
            json_ = run(name, c, args.requests, args.max_tokens, constrained=True)
            spec = name != "off"
            acc = f"{free['acceptance']:.2f} / {json_['acceptance']:.2f}" if spec else "-"
            per = f"{free['per_pass']:.2f} / {json_['per_pass']:.2f}" if spec else "-"
            print(
                f"| {name} | {c} | {free['tok_s']:.1f} | {json_['tok_s']:.1f} "
                f"| {json_['tok_s'] / free['tok_s']:.2f} | {acc} | {per} "
                f"| {100 * json_['grammar_share']:.1f}% | {json_['valid']} of {json_['requests']} | {json_['cut']} "
                f"| {free['tokens']} / {json_['tokens']} | {json_['forced']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
