"""The soak: --minutes of mixed load on one server, a fifth of the requests walking away, then
the checks of docs/RELIABILITY.md; exits 1 when one fails.

  python -m bench.soak --minutes 10          # `tandem serve` (configs/default.yaml), a child
  python -m bench.soak --url http://127.0.0.1:8000 --pid 1234        # a server already up

--clients clients send requests back to back, drawn from a seeded generator: /v1/completions
or /v1/chat/completions, streamed or not, held-out chat and task-family prompts (bench/
prompts.py) up to --max-prompt-chars, max_tokens 8 up to --max-tokens, greedy or sampled,
some with n 2-3 or a JSON object response_format. A --walk-away share of them leave: after
1-4 events, or at a client-side timeout of 0.2-2 s. The server's VmRSS and open fds are read
from /proc when it is ready, after --warmup-minutes, every --every seconds, and at the end once
its /metrics show nothing running or waiting. Fails on: a 5xx, an error event or a broken
response to a client that stayed; the KV pool not empty at the end; RSS at the end over 5%
above the post-warm-up sample; more open fds at the end than at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import sys
import time
from collections import Counter
from contextlib import aclosing
from pathlib import Path

import httpx

from bench.prompts import chat_messages, family_messages
from bench.serving import StreamError, check_loopback, post_events, tandem_serve

RESULTS = Path(__file__).resolve().parent / "results"


def proc_sample(pid: int) -> dict:
    """The process's resident memory (MiB) and open file descriptors."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024
    return {"rss_mib": round(rss, 1), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def engine_gauges(url: str) -> dict[str, float]:
    """The unlabelled tandem_* samples of /metrics (requests running/waiting, KV pool)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(tandem_\w+) (\S+)$", text, re.M)}


def draw(rng: random.Random, prompts: list[list[dict]], model: str, max_tokens: int):
    """One request of the mix: (path, body)."""
    messages, chat, stream = rng.choice(prompts), rng.random() < 0.5, rng.random() < 0.6
    body: dict = {"model": model, "max_tokens": rng.randint(8, max_tokens), "stream": stream,
                  "temperature": rng.choice([0.0, 0.0, 0.7, 1.0])}  # fmt: skip
    if chat:
        body["messages"] = messages
    else:
        body["prompt"] = "\n".join(m["content"] for m in messages)
    if body["temperature"] and rng.random() < 0.5:
        body |= {"top_p": 0.9, "seed": rng.randrange(1000)}
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.15:
        body["response_format"] = {"type": "json_object"}
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def one(url: str, path: str, body: dict, leave_after: int | None, timeout: float | None,
              tally: Counter, errors: list[str]) -> None:  # fmt: skip
    """Send one request; leave after `leave_after` events or `timeout` seconds. Counts its
    status ("status 200"), "left", and "error" (an error event, a broken response)."""
    seen = 0

    async def read() -> None:
        nonlocal seen
        async with aclosing(post_events(url, path, body)) as events:
            async for status, data in events:
                tally[f"status {status}"] += seen == 0
                seen += 1
                if status != 200 or data == "[DONE]":
                    return
                if "error" in json.loads(data):
                    raise StreamError(f"error event: {data[:200]}")
                if leave_after is not None and seen >= leave_after:
                    raise asyncio.TimeoutError  # walks away, as at the timeout

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        tally["left"] += 1
    except (OSError, StreamError, ValueError) as exc:
        tally["error"] += 1
        errors.append(f"{path} {type(exc).__name__}: {exc}"[:300])


async def load(args, url: str, model: str, pid: int, samples: dict) -> tuple[Counter, list]:
    """The clients until --minutes are up, and the samples meanwhile; (tally, errors)."""
    pool = chat_messages(100) + [m for ms in family_messages().values() for m in ms]
    pool = [m for m in pool if sum(len(x["content"]) for x in m) <= args.max_prompt_chars]
    tally, errors = Counter(), []
    start = time.monotonic()
    end = start + 60 * args.minutes

    async def client(i: int) -> None:
        rng = random.Random(f"{args.seed}-{i}")
        while time.monotonic() < end:
            path, body = draw(rng, pool, model, args.max_tokens)
            leave = rng.random() < args.walk_away
            after = rng.randint(1, 4) if leave and body["stream"] and rng.random() < 0.5 else None
            timeout = rng.uniform(0.2, 2.0) if leave and after is None else None
            tally["walk-aways drawn"] += leave
            tally["requests"] += 1
            await one(url, path, body, after, timeout, tally, errors)

    async def sampler() -> None:
        warm_at, every = start + 60 * args.warmup_minutes, args.every
        for at in sorted(
            {warm_at, *(start + every * k for k in range(1, int(60 * args.minutes / every) + 1))}
        ):
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            if at >= end:
                return
            sample = proc_sample(pid)
            if at >= warm_at:
                samples.setdefault("warm", sample)
            usage = (await asyncio.to_thread(engine_gauges, url))["tandem_kv_cache_usage_ratio"]
            print(f"{at - start:5.0f} s  {dict(tally)}  {sample}  KV {usage:.0%}", flush=True)

    await asyncio.gather(sampler(), *(client(i) for i in range(args.clients)))
    return tally, errors


def soak(args, url: str, pid: int) -> dict:
    """Run the load and the end checks' measurements: the summary `verdict` judges."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    samples = {"start": proc_sample(pid)}
    tally, errors = asyncio.run(load(args, url, model, pid, samples))
    deadline, gauges = time.monotonic() + args.idle_timeout, {}
    while time.monotonic() < deadline:
        gauges = engine_gauges(url)
        if gauges["tandem_requests_running"] == gauges["tandem_requests_waiting"] == 0:
            break
        time.sleep(0.5)
    total = int(gauges["tandem_kv_cache_blocks_total"])
    return {
        "requests": tally.pop("requests", 0), "walk_aways_drawn": tally.pop("walk-aways drawn", 0),
        "outcomes": dict(sorted(tally.items())), "errors": errors[:5],
        "running": gauges["tandem_requests_running"], "waiting": gauges["tandem_requests_waiting"],
        "blocks_total": total,
        "blocks_in_use": round(gauges["tandem_kv_cache_usage_ratio"] * total),
        "samples": samples | {"end": proc_sample(pid)}, "load_average": os.getloadavg(),
    }  # fmt: skip


def verdict(summary: dict) -> list[str]:
    """The failed checks, each a sentence; none when the soak passed."""
    bad = [(k, n) for k, n in summary["outcomes"].items() if k[:8] == "status 5" or k == "error"]
    out = [f"{n} x {k}" for k, n in bad]
    if not summary["outcomes"].get("status 200"):
        out.append("no request was answered")
    if summary["running"] or summary["waiting"]:
        out.append(f"not idle: {summary['running']:.0f} running, {summary['waiting']:.0f} waiting")
    if summary["blocks_in_use"]:
        out.append(f"{summary['blocks_in_use']} KV blocks still in use at the end")
    start, warm, end = (summary["samples"][k] for k in ("start", "warm", "end"))
    if end["rss_mib"] > 1.05 * warm["rss_mib"]:
        out.append(f"RSS {end['rss_mib']} MiB at the end, over 5% above {warm['rss_mib']}")
    if end["fds"] > start["fds"]:
        out.append(f"{end['fds']} open fds at the end, {start['fds']} at the start")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup-minutes", type=float, default=1.0)
    p.add_argument("--every", type=float, default=60.0, help="seconds between samples")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--walk-away", type=float, default=0.2, help="share of requests that leave")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-prompt-chars", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-timeout", type=float, default=120.0, help="seconds, after the load")
    p.add_argument("--url", help="a running server on this machine (else one is started)")
    p.add_argument("--pid", type=int, help="with --url, its process (for RSS and fds)")
    p.add_argument("--extra", default="", help="more `tandem serve` flags")
    args = p.parse_args(argv)
    if args.warmup_minutes >= args.minutes or bool(args.url) != bool(args.pid):
        p.error("--warmup-minutes must be under --minutes, and --url comes with --pid")
    if args.url:
        check_loopback(args.url)
        summary = soak(args, args.url.rstrip("/"), args.pid)
    else:
        server, _ = tandem_serve(shlex.split(args.extra), RESULTS / "logs-soak" / "server.log")
        try:
            summary = soak(args, server.url, server.proc.pid)
        finally:
            server.stop()
    failed = verdict(summary)
    print(json.dumps(summary))
    print("\n".join(f"FAIL: {f}" for f in failed) or "PASS", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
