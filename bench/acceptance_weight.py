"""How much a request's own verified drafts say about its next ones: the weight, in trials, of
the engine-wide rate in each request's acceptance estimate (`REQUEST_WEIGHT` in
engine/spec/policy/), fitted on the default pair.

  python -m bench.acceptance_weight --requests 48
  python -m bench.acceptance_weight --requests 48 --temperature 0.7

Runs held-out chat prompts (bench/chat_prompts.py) in-process, one at a time, with a fixed
K = 1, so that every step of every request drafts and is judged: each verified chain is one
trial, its draft kept or not. Then, for each cut c (a request's first c chains seen) and
weight w, the estimate (kept in the first c + w * m) / (c + w), m the mean over all chains, is
scored against the request's next 20 chains: the mean squared error per weight, and its ratio
to the best weight's at that cut. w = 0 is the request's own rate alone; "inf" is m alone.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from bench.default_engine import CONFIGS, TARGET, _closed_loop, _prompts, engine
from engine.spec.policy import FixedDraftLength
from engine.types.request import Request, SamplingParams

WEIGHTS = [0.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, float("inf")]
CUTS = [5, 10, 20, 40]
AHEAD = 20


class _Recording(FixedDraftLength):
    """A fixed K that keeps every verified chain's outcome, per request."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.chains: dict[str, list[int]] = {}

    def observe(
        self, request: Request, num_drafted: int, num_accepted: int, branches: int = 1
    ) -> None:
        if num_drafted:
            self.chains.setdefault(request.request_id, []).append(int(num_accepted > 0))


def fit(chains: list[list[int]]) -> list[tuple[int, int, list[float]]]:
    """Per cut: (cut, requests scored, mean squared error per weight in WEIGHTS)."""
    m = float(np.mean([x for c in chains for x in c]))
    rows = []
    for cut in CUTS:
        scored = [c for c in chains if len(c) >= cut + 10]
        own = np.array([sum(c[:cut]) for c in scored], dtype=np.float64)
        ahead = np.array([np.mean(c[cut : cut + AHEAD]) for c in scored])
        errors = []
        for w in WEIGHTS:
            est = np.full(len(scored), m) if np.isinf(w) else (own + w * m) / (cut + w)
            errors.append(float(np.mean((est - ahead) ** 2)))
        rows.append((cut, len(scored), errors))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    eng = engine(replace(CONFIGS["K=1"], ngram_assist=0), TARGET)
    policy = _Recording(1)
    eng.policy = eng.scheduler.policy = policy
    prompts = _prompts(eng.config.model.model, args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    _closed_loop(eng, list(enumerate(prompts)), 1, lambda i: params)
    chains = list(policy.chains.values())
    kept = [x for c in chains for x in c]
    print(f"T={args.temperature}: {len(chains)} requests, {len(kept)} chains, "
          f"first draft kept {np.mean(kept):.3f}")  # fmt: skip
    labels = ["inf" if np.isinf(w) else f"{w:g}" for w in WEIGHTS]
    print("| chains seen | requests | " + " | ".join(f"w={x}" for x in labels) + " |")
    print("|---:|---:|" + "---:|" * len(WEIGHTS))
    for cut, n, errors in fit(chains):
        best = min(errors)
        cells = " | ".join(f"{e:.4f} ({e / best:.2f}x)" for e in errors)
        print(f"| {cut} | {n} | {cells} |")


if __name__ == "__main__":
    main()
