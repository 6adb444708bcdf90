"""The adaptive draft-length policy's own host time per engine step, by batch size.

  python -m bench.policy_cost                 # batches 1, 16, 64; K_max 4
  python -m bench.policy_cost --batches 8 32 --max-draft 8

Per step: `choose` every decoding request's K, `observe` the drafts kept (up to a random
depth), in Python on the engine thread (on a GPU a 64-request step takes 1-2 ms, so it counts).
Requests of 150 tokens with 79% acceptance, a synthetic GPU-like cost model (1 ms passes flat
to 256 tokens; 0.1 ms drafts). Prints the mean microseconds per step, best of --repeats.
"""

from __future__ import annotations

import argparse
import random
import time

from engine.spec.cost.model import CostModel
from engine.spec.policy import AdaptiveDraftLength
from engine.types.request import Request, SamplingParams

SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def cost_model() -> CostModel:
    seconds = [0.001 + 0.000002 * max(0, n - 256) for n in SIZES]
    return CostModel(SIZES, seconds, draft_fixed=0.0001, draft_per_token=0.000002)


def requests(batch: int) -> list[Request]:
    reqs = []
    for i in range(batch):
        req = Request(f"r{i}", [1] * 150, SamplingParams(max_tokens=512, temperature=0.0))
        req.spec.accepted, req.spec.trials = 790, 1000
        reqs.append(req)
    return reqs


def per_step_us(batch: int, max_draft: int, steps: int, repeats: int) -> tuple[float, float]:
    """(best mean microseconds a step, mean K chosen)."""
    rng = random.Random(batch)
    policy, reqs = AdaptiveDraftLength(max_draft, cost_model()), requests(batch)
    best, drafted, chosen = float("inf"), 0, 0
    for _ in range(repeats):
        kept = [[rng.random() for _ in reqs] for _ in range(steps)]  # drawn outside the clock
        start = time.perf_counter()
        for draws in kept:
            ks = policy.choose(reqs).ks
            for req, k, u in zip(reqs, ks, draws, strict=True):
                if k:
                    policy.observe(req, k, int(u * (k + 1)))
            drafted, chosen = drafted + sum(ks), chosen + len(ks)
        best = min(best, (time.perf_counter() - start) / steps)
    return 1e6 * best, drafted / chosen


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-draft", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print("| batch | policy us a step | mean K |")
    print("|---:|---:|---:|")
    for batch in args.batches:
        us, k = per_step_us(batch, args.max_draft, args.steps, args.repeats)
        print(f"| {batch} | {us:.0f} | {k:.2f} |")


if __name__ == "__main__":
    main()
