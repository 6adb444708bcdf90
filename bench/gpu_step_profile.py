"""Where a decode step's time goes at concurrency 1, per Tandem setting (issue 10).

  python -m bench.gpu_step_profile --pair bench/gpu_models/random off "draft K=2" --out prof.txt

For each setting (bench.engine_bench.settings' names: off, draft K=2, draft K=4, adaptive) one
engine on the pair, a warm-up of 4 whole requests (so every CUDA graph the run needs is
captured), then 4 requests x 128 tokens timed plain, and the same again under cProfile. On
CUDA it then times 50 back-to-back replays of each captured one- and two-request graph with
CUDA events (the target body's GPU time, no host work) and runs torch.profiler over one
32-token request (the kernels and their times). A pair with random weights (`bench.gpu_pair
--random`) never accepts a draft, so a K=2 step there yields one token and its time is the
cost of a drafting step. Prints a summary; --out gets the full cProfile and kernel tables.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.driver import run_closed_loop
from bench.engine_bench import build_engine, settings
from bench.gpu_floor import replay_seconds, sync
from bench.prompts import make_prompts
from engine.model.runner import resolve_device


def _replays(engine, report: io.StringIO) -> None:
    graphs = engine.runner.decode_graphs
    if graphs is None or not graphs.capture:
        return
    for key, static in sorted(graphs.batches.items()):
        if static.graph is None or key[0] > 2 or key[2]:
            continue
        seconds = replay_seconds(static.graph, engine.runner.device, 50)
        line = f"   graph {key}: {seconds * 1e6:.1f} us per replay (GPU)"
        print(line, flush=True)
        report.write(line + "\n")


def _kernels(engine, prompts: list[list[int]], name: str, report: io.StringIO) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_closed_loop(engine, f"t-{name}", prompts[:1], 1, 32, 1)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    report.write(table + "\n")
    print("\n".join(table.splitlines()[:16]), flush=True)


def profile_setting(args: argparse.Namespace, name: str, prompts, report: io.StringIO) -> None:
    device = resolve_device("auto")
    cuda = device.type == "cuda"
    specs = settings(str(args.pair / "draft"), [2, 4], ["draft"])
    began = time.perf_counter()
    engine = build_engine(args, specs[name], 4, prefix_caching=False)
    print(f"{name}: built in {time.perf_counter() - began:.1f} s", flush=True)
    run_closed_loop(engine, f"w-{name}", prompts[-4:], 1, 128, 4)
    sync(device)
    plain = run_closed_loop(engine, f"p-{name}", prompts, 1, 128, 4).as_dict()
    sync(device)
    profiler = cProfile.Profile()
    profiler.enable()
    began = time.perf_counter()
    profiled = run_closed_loop(engine, f"c-{name}", prompts, 1, 128, 4).as_dict()
    sync(device)
    wall = time.perf_counter() - began
    profiler.disable()
    head = (
        f"== {name}: {plain['tokens_per_s']:.1f} tok/s plain, itl {plain['itl_mean_ms']:.3f} ms; "
        f"profiled {profiled['tokens_per_s']:.1f} tok/s, {wall:.2f} s; "
        f"acc {plain.get('acceptance')}"
    )
    print(head, flush=True)
    report.write(head + "\n")
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(45)
        report.write(text.getvalue())
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    print("\n".join(text.getvalue().splitlines()[6:24]), flush=True)
    if cuda:
        _replays(engine, report)
        _kernels(engine, prompts, name, report)
    del engine
    if cuda:
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pair", type=Path, required=True, help="bench.gpu_pair's --out directory")
    p.add_argument("settings", nargs="*", default=["off", "draft K=2"])
    p.add_argument("--out", type=Path, help="full cProfile and kernel tables")
    args = p.parse_args(argv)
    args.model, args.device = str(args.pair / "target"), "auto"
    args.kv_blocks, args.max_num_batched_tokens = 4 * 22 + 16, 2048
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = make_prompts(tokenizer, 16, 64, 192, seed=0)
    report = io.StringIO()
    for name in args.settings:
        profile_setting(args, name, prompts, report)
    if args.out:
        args.out.write_text(report.getvalue())


if __name__ == "__main__":
    main()
