"""Two speculation settings of the default pair in one process, alternated chunk by chunk.

  python -m bench.ab_engines --a draft_quantization=int4 --b draft_quantization=none
  python -m bench.ab_engines --a draft_quantization=int4 --b draft_quantization=int8 \\
      --temperature 0.7 --rounds 4
  python -m bench.ab_engines --a draft_quantization=int4 --b draft_quantization=none \\
      --concurrency 16 --requests 48 --rounds 2
  python -m bench.ab_engines --a method=off --b draft_length=fixed max_draft_tokens=1

Each side is the shipped speculation setting (the trained draft, adaptive K, one chain,
prompt-lookup assist) with the given SpecConfig fields replaced (an optional number takes
`auto` for None, a flag true or false, a float a number). Both engines are built in this
process; the held-out chat prompts run in chunks of --concurrency (one prompt at a time by
default), each chunk on A and on B back to back, the order swapped every chunk and every round.
On a shared machine whose speed drifts by 10-30% within minutes, the two sides then see the
same drift, so the ratio per round is steadier than two runs minutes apart (`bench.paired` does
the same over HTTP, one server at a time). Greedy output is the same on both sides (speculation
is lossless), so at T=0 both make the same tokens; at T>0 they differ, and the ratio is of
tokens/s.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import fields, replace

from bench.default_engine import CONFIGS, _prompts, engine
from engine.config import SpecConfig
from engine.core.engine import LLMEngine
from engine.types.request import SamplingParams


def spec_with(assignments: list[str]) -> SpecConfig:
    """The shipped setting (configs/default.yaml: the trained draft, adaptive K up to 4, one
    chain, prompt-lookup assist) with `field=value` assignments applied."""
    spec = replace(CONFIGS["adaptive+lookup"], draft_branches=1)
    types = {f.name: f.type for f in fields(SpecConfig)}
    changes: dict[str, object] = {}
    for item in assignments:
        name, _, value = item.partition("=")
        if name not in types:
            raise SystemExit(f"{name!r} is not a SpecConfig field ({', '.join(types)})")
        kind = str(types[name])
        if kind.startswith("int"):  # int, or int | None (auto)
            changes[name] = None if value == "auto" and "None" in kind else int(value)
        elif kind == "float":
            changes[name] = float(value)
        elif kind == "bool":
            changes[name] = value.lower() in ("1", "true", "on", "yes")
        else:
            changes[name] = value
    return replace(spec, **changes)


def run_chunk(
    eng: LLMEngine, tag: str, prompts: list[list[int]], temperature: float, max_tokens: int
) -> tuple[float, int]:
    """Run `prompts` all at once to the end; (seconds, output tokens)."""
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        eng.add_request(f"{tag}-{i}", prompt, params)
    tokens, start = 0, time.perf_counter()
    while eng.has_work():
        tokens += sum(len(out.new_token_ids) for out in eng.step())
    return time.perf_counter() - start, tokens


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--a", nargs="*", default=[], help="SpecConfig field=value for side A")
    p.add_argument("--b", nargs="*", default=[], help="SpecConfig field=value for side B")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    sides = {"A": spec_with(args.a), "B": spec_with(args.b)}
    engines = {name: engine(spec) for name, spec in sides.items()}
    c = args.concurrency
    prompts = _prompts(engines["A"].config.model.model, args.requests + c)
    for name, eng in engines.items():  # warm-up on other prompts
        run_chunk(eng, f"warm-{name}", prompts[args.requests :], args.temperature, args.max_tokens)
    print(f"A: {' '.join(args.a) or 'the shipped setting'}; B: {' '.join(args.b) or 'same'}")
    ratios = []
    for r in range(args.rounds):
        totals = {"A": [0.0, 0], "B": [0.0, 0]}
        for j in range(0, args.requests, c):
            order = ("A", "B") if (j // c + r) % 2 == 0 else ("B", "A")
            for name in order:
                chunk = prompts[j : min(j + c, args.requests)]
                secs, toks = run_chunk(
                    engines[name], f"{r}-{j}-{name}", chunk, args.temperature, args.max_tokens
                )
                totals[name][0] += secs
                totals[name][1] += toks
        rate = {name: toks / secs for name, (secs, toks) in totals.items()}
        ratios.append(rate["A"] / rate["B"])
        print(
            f"round {r + 1}: A {rate['A']:.1f} tok/s ({totals['A'][1]} tokens), "
            f"B {rate['B']:.1f} tok/s ({totals['B'][1]} tokens), A/B {ratios[-1]:.3f}",
            flush=True,
        )
    print(f"A/B by round: {', '.join(f'{x:.3f}' for x in ratios)}")


if __name__ == "__main__":
    main()
