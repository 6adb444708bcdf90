"""What adaptive K chooses at concurrency 16 on the peers workload, start by start.

  python -m bench.peers.adaptive_choice [STARTS]

Each start builds the engine afresh (so the cost model is calibrated again), prints the
calibrated target table (ms per pass by token count) and draft coefficients, the cost
model's predicted tokens/s for 16 requests at context 250 and acceptance 0.8 with each
uniform K, then runs the peers prompts (48 requests, 16 at a time, 128 tokens, 1 thread)
and prints the tokens/s, the mean K, the online scales and how often each mean K was chosen
for steps with at least 12 decoding requests.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from bench.driver import run_closed_loop
from bench.engine_bench import build_engine
from bench.prompts import make_prompts
from engine.config import SpecConfig

ROOT = Path(__file__).resolve().parent.parent.parent


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("starts", type=int, nargs="?", default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target, draft = (
        str(ROOT / "bench" / "toy_pair" / "target"),
        str(ROOT / "bench" / "toy_pair" / "draft"),
    )
    tokenizer = AutoTokenizer.from_pretrained(target)
    windows = make_prompts(tokenizer, 256, 64, 192, seed=0)
    prompts = [tokenizer.encode(tokenizer.decode(w), add_special_tokens=False) for w in windows]
    engine_args = argparse.Namespace(
        model=target, device="cpu", kv_blocks=1200, max_num_batched_tokens=512
    )
    spec = SpecConfig(
        method="draft", draft_model=draft, max_draft_tokens=4, draft_length="adaptive"
    )
    for start in range(args.starts):
        engine = build_engine(engine_args, spec, 64)
        cost = engine.cost_model
        ms = (1e3 * cost.target_seconds).round(2).tolist()
        table = dict(zip(cost.sizes.astype(int).tolist(), ms, strict=True))
        print(f"start {start + 1}: target table (ms) {table}")
        print(
            f"  draft {cost.draft.fixed * 1e3:.3f} ms/pass + {cost.draft.per_token * 1e3:.3f} "
            f"ms/draft + {cost.draft.per_pair * 1e6:.3f} us/score + "
            f"{cost.draft.per_fed * 1e3:.3f} ms/token fed"
        )
        for k in range(spec.max_draft_tokens + 1):
            tokens = 16 * (1 + sum(0.8**d for d in range(1, k + 1)))
            seconds = cost.target_time(16 + 16 * k, 16 * 250, 16 * (1 + k) * 250)
            seconds = seconds + cost.draft_time(k, 16 * k, 16 * k * 250)
            print(f"  K={k}: predicted {float(tokens / seconds):.0f} tok/s")
        chosen: collections.Counter[float] = collections.Counter()
        choose = engine.policy.choose

        def recording(requests, num_other_tokens=0, choose=choose, chosen=chosen):
            out = choose(requests, num_other_tokens)
            if len(requests) >= 12:
                chosen[round(float(np.mean(out.ks)), 1)] += 1
            return out

        engine.policy.choose = recording
        run_closed_loop(engine, "warmup", prompts[-16:], 16, 16, 16)
        chosen.clear()
        result = run_closed_loop(engine, "c16", prompts, 16, 128, 48)
        print(
            f"  run: {result.tokens_per_s:.0f} tok/s, mean K {result.mean_k:.2f}, online scale "
            f"target {cost.target_scale.value:.2f} draft "
            f"{', '.join(f'{x:.2f}' for x in cost.draft.scales)}"
        )
        print(f"  mean K at >= 12 decodes (steps): {sorted(chosen.items())}")
        del engine


if __name__ == "__main__":
    main()
