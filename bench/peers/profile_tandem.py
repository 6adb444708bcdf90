"""Where Tandem's time goes, for the peers comparison: the same prompts, lengths and
configurations as bench.peers, run in-process (no HTTP) with the engine's own timers.

  python -m bench.peers.profile_tandem --out bench/results/peers-profile.json [--torch-ops]

Per configuration and concurrency: output tokens/s in-process (against the HTTP figure,
the difference is the server's cost), and milliseconds per output token split into target
passes, draft passes and everything else (scheduling, sampling, rejection, Python). With
--torch-ops, the torch operators that take the most self CPU time in one run of each
configuration at concurrency 1.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.driver import run_closed_loop
from bench.engine_bench import build_engine
from bench.prompts import make_prompts
from engine.config import SpecConfig

ROOT = Path(__file__).resolve().parent.parent.parent


def configs(draft: str, ks: list[int]) -> dict[str, SpecConfig]:
    out = {"speculation off": SpecConfig(method="off")}
    for k in ks:
        out[f"draft K={k} fixed"] = SpecConfig(
            method="draft", draft_model=draft, max_draft_tokens=k, draft_length="fixed"
        )
    out[f"draft adaptive K<={max(ks)}"] = SpecConfig(
        method="draft", draft_model=draft, max_draft_tokens=max(ks), draft_length="adaptive"
    )
    return out


def breakdown(result) -> dict:
    tokens = max(result.output_tokens, 1)
    other = result.seconds - result.target_seconds - result.draft_seconds
    return {
        "tokens_per_s": result.tokens_per_s,
        "ms_per_token": 1e3 * result.seconds / tokens,
        "target_ms_per_token": 1e3 * result.target_seconds / tokens,
        "draft_ms_per_token": 1e3 * result.draft_seconds / tokens,
        "other_ms_per_token": 1e3 * other / tokens,
        "target_ms_per_pass": 1e3 * result.target_seconds / max(result.verify_steps, 1),
        "acceptance": result.acceptance,
        "mean_k": result.mean_k,
        "tokens_per_pass": result.tokens_per_pass,
    }


def top_ops(engine, name: str, prompts, max_tokens: int, count: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_closed_loop(engine, f"profile-{name}", prompts, 1, max_tokens, count)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return table.splitlines()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "bench" / "toy_pair" / "target"))
    p.add_argument("--draft-model", default=str(ROOT / "bench" / "toy_pair" / "draft"))
    p.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, nargs="+", default=[8, 48])
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", nargs="*", help="configurations whose name contains one of these")
    p.add_argument("--torch-ops", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peers-profile.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # The same text the HTTP systems get, tokenized as a server would.
    windows = make_prompts(tokenizer, 256, args.min_prompt, args.max_prompt, seed=0)
    prompts = [tokenizer.encode(tokenizer.decode(w), add_special_tokens=False) for w in windows]
    # The server's defaults (configs/default.yaml) for the batch limits.
    engine_args = argparse.Namespace(
        model=args.model, device="cpu", kv_blocks=1200, max_num_batched_tokens=512
    )
    rows = []
    for name, spec in configs(args.draft_model, args.ks).items():
        if args.only and not any(o in name for o in args.only):
            continue
        engine = build_engine(engine_args, spec, 64)
        run_closed_loop(engine, f"warmup-{name}", prompts[-16:], 16, 16, 16)
        for level, count in zip(args.levels, args.requests, strict=True):
            result = run_closed_loop(engine, name, prompts, level, args.max_tokens, count)
            row = {"config": name, "concurrency": level} | breakdown(result)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.torch_ops:
            ops = top_ops(engine, name, prompts, args.max_tokens, 2)
            rows.append({"config": name, "concurrency": 1, "torch_ops": ops})
            print("\n".join(ops), flush=True)
        del engine
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
