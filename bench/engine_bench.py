"""Engine benchmarks on the default pair (in-process, no HTTP).

  python -m bench.engine_bench k-sweep       # concurrency 1: off, fixed K=1,2,4,8 (draft and
                                              # n-gram), adaptive; acceptance and ideal speedup
  python -m bench.engine_bench concurrency   # concurrency 1..64 x {off, K=1,2,4,8, adaptive}

Results go to bench/results/*.json; `python -m bench.report` turns them into
docs/BENCHMARKS.md tables and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from datetime import date
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.driver import RunResult, run_closed_loop
from bench.prompts import make_prompts
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from engine.core.engine import LLMEngine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def settings(draft: str, ks: list[int], methods: list[str]) -> dict[str, SpecConfig]:
    out = {"off": SpecConfig(method="off")}
    for method in methods:
        for k in ks:
            out[f"{method} K={k}"] = SpecConfig(
                method=method, draft_model=draft, max_draft_tokens=k, draft_length="fixed"
            )
    out["adaptive"] = SpecConfig(
        method="draft", draft_model=draft, max_draft_tokens=max(ks), draft_length="adaptive"
    )
    return out


def build_engine(
    args: argparse.Namespace, spec: SpecConfig, max_num_seqs: int, prefix_caching: bool = True
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=args.model, device=args.device),
            cache=CacheConfig(
                block_size=16, num_blocks=args.kv_blocks, enable_prefix_caching=prefix_caching
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_waiting=100_000,
            ),
            spec=spec,
        )
    )


def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "cpu": cpu,
        "cores": str(torch.get_num_threads()),
        "device": device,
        "torch": torch.__version__,
        "date": date.today().isoformat(),
    }


def run_sweep(args: argparse.Namespace, levels: list[int], specs: dict[str, SpecConfig]) -> dict:
    """Every (setting, level) `args.repeats` times, interleaved round-robin so slow drift on
    a shared machine hits all settings alike; the median run is reported."""
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = make_prompts(tokenizer, 256, args.min_prompt, args.max_prompt, seed=args.seed)
    engines = {name: build_engine(args, spec, max(levels)) for name, spec in specs.items()}
    for name, engine in engines.items():
        run_closed_loop(engine, f"warmup-{name}", prompts, 1, 8, 2)
    runs: dict[tuple[str, int], list[RunResult]] = {}
    for rep in range(args.repeats):
        for level in levels:
            for name, engine in engines.items():
                num = max(args.min_requests, args.requests_per_slot * level)
                result = run_closed_loop(
                    engine, f"{name}#{rep}", prompts, level, args.max_tokens, num
                )
                result.setting = name
                runs.setdefault((name, level), []).append(result)
                print(
                    f"[{rep}] {name:>12} c={level:<3} {result.tokens_per_s:8.1f} tok/s  "
                    f"ttft {result.ttft_mean_ms:7.1f} ms  itl {result.itl_mean_ms:6.1f} ms  "
                    f"acc {result.acceptance:.3f}  K {result.mean_k:.2f}",
                    flush=True,
                )
    results = []
    for rs in runs.values():
        median = sorted(rs, key=lambda r: r.tokens_per_s)[len(rs) // 2]
        row = median.as_dict()
        row["tokens_per_s_runs"] = [r.tokens_per_s for r in rs]
        results.append(row)
    return {
        "machine": machine(),
        "command": args.command_line,
        "max_tokens": args.max_tokens,
        "prompt_tokens": [args.min_prompt, args.max_prompt],
        "repeats": args.repeats,
        "results": results,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["k-sweep", "concurrency"])
    p.add_argument("--model", default=str(ROOT / "bench" / "toy_pair" / "target"))
    p.add_argument("--draft-model", default=str(ROOT / "bench" / "toy_pair" / "draft"))
    p.add_argument("--device", default="auto")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=192)
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=0, help="0 = enough for the top level")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs; median reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.command_line = "python -m bench.engine_bench " + " ".join(
        argv or __import__("sys").argv[1:]
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.kv_blocks:  # every request of the top level resident, plus draft slack
        per_request = -(-(args.max_prompt + args.max_tokens + max(args.ks) + 1) // 16)
        top = max(args.levels) if args.mode == "concurrency" else 1
        args.kv_blocks = top * per_request + 16
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)

    if args.mode == "k-sweep":
        specs = settings(args.draft_model, args.ks, ["draft", "ngram"])
        data = run_sweep(args, [1], specs)
    else:
        specs = settings(args.draft_model, args.ks, ["draft"])
        data = run_sweep(args, args.levels, specs)
    data["mode"] = args.mode
    out = args.out or RESULTS / f"{args.mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    print(f"wrote {out} ({time.strftime('%H:%M:%S')})")


if __name__ == "__main__":
    main()
