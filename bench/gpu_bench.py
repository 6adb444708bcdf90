"""The GPU benchmark: Tandem against HF generate() on one GPU, on the pair bench.gpu_pair made.

  python -m bench.gpu_bench --pair bench/gpu_models/trained --levels 1 16  # results/gpu_trained.json
  bench/gpu_session.sh                 # everything a GPU session runs, training included

First the bandwidth floor (bench/gpu_floor.py) beside a measured Tandem target pass at batch 1,
and a greedy check: every Tandem setting's output for --check-prompts prompts against HF plain
generate() (token-identical, else the reference's logit gap at the first difference). Then per
--levels concurrency: Tandem in-process through bench.default_engine's closed loop (off, the
draft at each fixed --ks K, adaptive up to the largest) and HF generate() (batch 1, else static
left-padded batches), greedy, exactly --max-tokens tokens, the same prompts, after a warm-up at
the same concurrency (whole requests for Tandem, so CUDA graphs are captured before the clock;
captures in the timed run are counted). Tandem's prefix cache is off: HF has none.

The JSON is rewritten after every row. --time-limit-s stops starting rows that would not
finish in time (`not_run`); --resume FILE keeps FILE's rows of the same pair (`pair_id`) and
settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench import machine
from bench.default_engine import run_closed_loop
from bench.gpu_floor import measure_floor
from bench.hf_generate import run_level, sync
from bench.prompts import text_prompts
from engine import (
    CacheConfig,
    EngineConfig,
    LLMEngine,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
    SpecConfig,
)
from engine.model.runner import resolve_device, resolve_dtype

ROOT = Path(__file__).resolve().parent.parent
TANDEM, HF_PLAIN, SYSTEMS = "Tandem", "HF generate()", ["tandem", "hf-plain"]
# Settings that must agree with the earlier run for --resume to keep its rows.
SAME_FOR_RESUME = ("max_tokens", "prompt_tokens", "ks", "requests_per_slot", "min_requests")


def settings(draft: str, ks: list[int]) -> dict[str, SpecConfig]:
    out = {"off": SpecConfig(method="off")}
    for k in ks:
        out[f"draft K={k}"] = SpecConfig(
            method="draft", draft_model=draft, max_draft_tokens=k, draft_length="fixed"
        )
    out["adaptive"] = SpecConfig(
        method="draft", draft_model=draft, max_draft_tokens=max(ks), draft_length="adaptive"
    )
    return out


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids, max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def tandem_greedy(
    engine: LLMEngine, tag: str, prompts: list[list[int]], tokens: int
) -> list[list[int]]:
    """All prompts at once (the batched paths are the ones worth checking)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out.get(rid, []) for rid in ids]


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where the two differ (a shorter one ends there), or None."""
    n = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if n is None and len(got) != len(want):
        return min(len(got), len(want))
    return n


@torch.inference_mode()
def logit_gap(model, prompt: list[int], want: list[int], got: list[int], n: int) -> float:
    """The reference's logit of its token at position n minus its logit of Tandem's token
    there, in float32 from the model's own logits (0 would be an exact tie)."""
    ids = torch.tensor([prompt + want[:n]], device=model.device)
    logits = model(ids).logits[0, -1].float()
    return float(logits[want[n]] - logits[got[n]])


def compare(got: list[list[int]], want: list[list[int]], prompts=None, model=None) -> dict:
    """Token-identical or not, and how far each output agrees before its first difference;
    with the reference `model` and the `prompts`, the logit gap at each first difference
    (`differences`: prompt index, position, gap)."""
    agree, differences = [], []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        n = first_difference(g, w)
        agree.append(min(len(g), len(w)) if n is None else n)
        if n is not None and model is not None and n < min(len(g), len(w)):
            gap = logit_gap(model, prompts[i], w, g, n)
            differences.append({"prompt": i, "position": n, "logit_gap": gap})
    out = {
        "greedy_match": got == want,
        "prompts": len(want),
        "tokens_each": len(want[0]) if want else 0,
        "agreeing_prefix_mean": sum(agree) / max(len(agree), 1),
    }
    if model is not None:
        out["differences"] = differences
    return out


class GpuBench:
    def __init__(self, args: argparse.Namespace, data: dict, earlier: dict | None) -> None:
        self.args, self.data = args, data
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype("auto", self.device)
        self.deadline = time.monotonic() + args.time_limit_s if args.time_limit_s else None
        self.last_wall: dict[tuple[str, str], float] = {}
        self.done = {_key(r) for r in (earlier or {}).get("results", []) if not r.get("errors")}
        if earlier:
            data["results"] = [r for r in earlier["results"] if _key(r) in self.done]
            data["floor"], data["greedy"] = earlier.get("floor"), earlier.get("greedy", {})
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        count = max(256, 2 * args.requests(max(args.levels)))
        self.prompts = text_prompts(
            self.tokenizer, count, args.min_prompt, args.max_prompt, seed=args.seed
        )
        self.specs = settings(args.draft_model, args.ks)
        if args.only:
            self.specs = {k: v for k, v in self.specs.items() if k in args.only}
        self.engines: dict = {}
        self.hf: dict = {}

    def engine(self, name: str) -> LLMEngine:
        if name not in self.engines:
            a = self.args
            cache = CacheConfig(block_size=16, num_blocks=a.kv_blocks, enable_prefix_caching=False)
            sched = SchedulerConfig(max_num_seqs=max(a.levels), max_waiting=100_000,
                                    max_num_batched_tokens=a.max_num_batched_tokens)  # fmt: skip
            model = ModelConfig(model=a.model, device=a.device)
            spec = self.specs[name]
            config = EngineConfig(model=model, cache=cache, scheduler=sched, spec=spec)
            self.engines[name] = LLMEngine(config)
        return self.engines[name]

    def hf_model(self, which: str):
        if which not in self.hf:
            path = self.args.model if which == "target" else self.args.draft_model
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
            self.hf[which] = model.to(self.device).eval()
        return self.hf[which]

    def save(self) -> None:
        self.data["wall_s"] = time.monotonic() - self.args.started
        tmp = self.args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.args.out)

    def out_of_time(self, seconds: float = 0.0) -> bool:
        return self.deadline is not None and time.monotonic() + seconds > self.deadline

    def record(self, system: str, setting: str, level: int, fn, instant: bool = False) -> None:
        """Run one row unless it is done already or would overrun the time limit."""
        if (system, setting, level) in self.done:
            return
        expected = 2 * self.last_wall.get((system, setting), 0.0)  # levels double the work
        if self.out_of_time(expected) and not instant:
            self.data["not_run"].append({"system": system, "setting": setting, "level": level})
            print(f"not run (time limit): {system} {setting} c={level}", flush=True)
            return
        began = time.monotonic()
        try:
            row = fn()
            row["errors"] = []
        except Exception as exc:  # one failing configuration is a result, not a crash
            logging.exception("%s %s c=%d failed", system, setting, level)
            if system == TANDEM:  # requests may be left in it: start the next row afresh
                self.engines.pop(setting, None)
            row = {"errors": [f"{type(exc).__name__}: {exc}"[:400]]}
        row |= {"system": system, "setting": setting, "concurrency": level}
        row["wall_s"] = self.last_wall[(system, setting)] = time.monotonic() - began
        self.data["results"].append(row)
        self.save()
        print(_brief(row), flush=True)

    def floor(self) -> None:
        if self.data.get("floor"):
            return
        runner = self.engine("off").runner
        copy_bytes = self.args.copy_mb * 2**20
        self.data["floor"] = measure_floor(
            runner, self.args.floor_context, self.args.floor_iters, copy_bytes
        )
        self.save()
        f = self.data["floor"]
        print(
            f"floor {f['floor_us']:.1f} us ({f['target_weight_bytes'] / 1e6:.0f} MB at "
            f"{f['copy_bandwidth_gb_s']:.0f} GB/s); Tandem pass {f['pass_median_us']:.1f} us "
            f"= {f['pass_over_floor']:.2f}x the floor",
            flush=True,
        )

    def greedy_checks(self) -> None:
        prompts = self.prompts[: self.args.check_prompts]
        tokens = self.args.max_tokens
        reference, off = None, None
        names = sorted(self.specs, key=lambda n: n != "off")  # off first: the others' yardstick
        for name in names:
            if name in self.data["greedy"] and name != "off":
                continue
            if reference is None:
                target = self.hf_model("target")
                reference = [hf_greedy(target, p, tokens) for p in prompts]
            got = tandem_greedy(self.engine(name), f"check-{name}", prompts, tokens)
            if name == "off":
                off = got
            result = compare(got, reference, prompts, target)
            if off is not None and name != "off":
                result["same_as_off"] = got == off
            self.data["greedy"][name] = result
            self.save()
            print(f"greedy check {name}: {self.data['greedy'][name]}", flush=True)

    def tandem_row(self, name: str, level: int) -> dict:
        engine, args = self.engine(name), self.args
        # Whole requests: the CUDA graphs a setting needs depend on the mix of draft lengths
        # in a batch, which a few tokens do not reach; a capture in the timed run costs tens
        # of milliseconds. Those that still happen are counted in the row.
        warm = self.prompts[-level:]
        run_closed_loop(engine, f"warm-{name}@{level}", warm, level, args.max_tokens, level)
        sync(self.device)
        captured = engine.graph_captures()
        result = run_closed_loop(
            engine, f"{name}@{level}", self.prompts, level, args.max_tokens, args.requests(level)
        )
        sync(self.device)
        row = dataclasses.asdict(result)
        row["graph_captures"] = engine.graph_captures() - captured
        row["greedy_match"] = self.data["greedy"].get(name, {}).get("greedy_match")
        return row

    def hf_row(self, level: int) -> dict:
        model, tok, args = self.hf_model("target"), self.tokenizer, self.args
        prompts, warm = self.prompts[: args.requests(level)], self.prompts[-level:]
        return run_level(model, tok, prompts, warm, level, args.max_tokens, args.warmup_tokens)

    def run(self) -> None:
        systems = self.args.systems
        if "tandem" in systems and "off" in self.specs and not self.out_of_time():
            self.floor()
        if "tandem" in systems and self.args.check_prompts and not self.out_of_time():
            self.greedy_checks()
        for level in self.args.levels:
            if "tandem" in systems:
                for name in self.specs:
                    self.record(TANDEM, name, level, lambda n=name, c=level: self.tandem_row(n, c))
            if "hf-plain" in systems:
                self.record(HF_PLAIN, "plain", level, lambda c=level: self.hf_row(c))


def _key(row: dict) -> tuple[str, str, int]:
    return row["system"], row["setting"], row["concurrency"]


def _brief(row: dict) -> str:
    if row["errors"]:
        return f"{row['system']} {row['setting']} c={row['concurrency']}: {row['errors'][0]}"
    if "tokens_per_s" not in row:
        return f"{row['system']} {row['setting']} c={row['concurrency']}: {row.get('notes')}"
    extra = f"  acc {row['acceptance']:.3f}  K {row['mean_k']:.2f}" if "mean_k" in row else ""
    return (
        f"{row['system']:>13} {row['setting']:>16} c={row['concurrency']:<3} "
        f"{row['tokens_per_s']:9.1f} tok/s  ttft {row['ttft_mean_ms']:8.1f} ms  "
        f"itl {row['itl_mean_ms']:7.2f} ms{extra}"
    )


def provenance(args: argparse.Namespace, device: torch.device) -> dict:
    info = machine() | {"device": str(device), "device_type": device.type}
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    info |= {"transformers": transformers.__version__, "python": sys.version.split()[0]}
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pair", type=Path, required=True, help="bench.gpu_pair's --out directory")
    p.add_argument("--label", help="names the results file (default: the pair directory's name)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--only", nargs="+", help="Tandem settings to run, e.g. off 'draft K=2'")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=192)
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument(
        "--warmup-tokens", type=int, default=4, help="HF's warm-up (Tandem's: whole requests)"
    )
    p.add_argument("--check-prompts", type=int, default=4, help="greedy check (0 = skip)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--floor-context", type=int, default=128)
    p.add_argument("--floor-iters", type=int, default=50)
    p.add_argument("--copy-mb", type=int, help="copy size for the bandwidth (default 2048 / 64)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument("--time-limit-s", type=float, default=0.0, help="0 = none")
    p.add_argument("--resume", type=Path, help="an earlier results file to keep rows from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.started = time.monotonic()
    args.model, args.draft_model = str(args.pair / "target"), str(args.pair / "draft")
    args.label = args.label or args.pair.resolve().name
    args.out = args.out or ROOT / "bench" / "results" / f"gpu_{args.label}.json"
    if args.copy_mb is None:
        args.copy_mb = 2048 if resolve_device(args.device).type == "cuda" else 64
    per_request = -(-(args.max_prompt + args.max_tokens + max(args.ks) + 1) // 16)
    args.kv_blocks = max(args.levels) * per_request + 16  # every request resident, + slack

    def requests(level: int) -> int:
        return max(args.min_requests, args.requests_per_slot * level)

    args.requests = requests
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
    device = resolve_device(args.device)
    pair = json.loads((args.pair / "pair.json").read_text())
    config = {
        "max_tokens": args.max_tokens, "prompt_tokens": [args.min_prompt, args.max_prompt],
        "levels": args.levels, "ks": args.ks, "requests_per_slot": args.requests_per_slot,
        "min_requests": args.min_requests,
        "requests": {str(c): args.requests(c) for c in args.levels},
        "dtype": str(resolve_dtype("auto", device)).removeprefix("torch."),
        "prefix_caching": False, "max_num_batched_tokens": args.max_num_batched_tokens,
        "check_prompts": args.check_prompts,
    }  # fmt: skip
    argv_used = sys.argv[1:] if argv is None else argv
    data = {
        "kind": "gpu-bench", "label": args.label,
        "command": "python -m bench.gpu_bench " + " ".join(argv_used),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": provenance(args, device), "pair": pair, "config": config, "floor": None,
        "greedy": {}, "results": [], "not_run": [],
    }  # fmt: skip
    earlier = None
    if args.resume and args.resume.exists():
        earlier = json.loads(args.resume.read_text())
        same = all(earlier["config"].get(k) == config[k] for k in SAME_FOR_RESUME)
        if earlier["pair"].get("pair_id") != pair.get("pair_id") or not same:
            print(f"--resume: {args.resume} measured another pair or settings; not kept")
            earlier = None
        else:
            data["command"] = f"{earlier['command']} && {data['command']}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    bench = GpuBench(args, data, earlier)
    bench.save()
    bench.run()
    bench.save()
    print(f"wrote {args.out} ({data['wall_s']:.0f} s)", flush=True)
    return data


if __name__ == "__main__":
    main()
