"""A closed-loop load generator for any OpenAI-compatible server (streaming /v1/completions).

  python -m bench.loadgen --url http://127.0.0.1:8000 --model target --kind tandem \\
      --concurrency 1 16 --requests 8 48 --max-tokens 128

`concurrency` workers each keep one request in flight; together they send `requests`
requests, drawn in order from held-out text prompts (bench.prompts, decoded to text with
the default tokenizer, so every system gets the same strings). Output lengths are fixed by
default: `max_tokens` plus the server's own way of not stopping at EOS (`--kind`); with
`--open-ended` requests stop where the model does. Tokens are counted from each response's
usage, not assumed. Time to first token runs from sending the request to the first chunk
that carries text; inter-token latency is per token (see bench.latency).

Loopback only: the URL must point at this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx

from bench.latency import Trace, summarize

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
KINDS = ("tandem", "vllm", "transformers", "openai")


@dataclass(frozen=True)
class Target:
    """Where to send requests and how that server is told to produce a fixed length."""

    url: str
    model: str
    kind: str = "openai"
    max_tokens: int = 128
    fixed_length: bool = True
    timeout_s: float = 600.0

    def body(self, prompt: str, max_tokens: int | None = None) -> dict:
        n = max_tokens or self.max_tokens
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.fixed_length:
            body.update(length_fields(self.kind, n))
        return body


def length_fields(kind: str, max_tokens: int) -> dict:
    """Extra body fields that make `kind` generate exactly max_tokens tokens."""
    if kind in ("tandem", "vllm"):
        return {"ignore_eos": True}
    if kind == "transformers":
        # `transformers serve` rejects unknown fields (422) but takes a GenerationConfig as
        # JSON; min_new_tokens masks EOS until the length is reached.
        config = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False}
        return {"generation_config": json.dumps(config)}
    return {"min_tokens": max_tokens}  # honoured by some servers; usage shows what happened


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"--url must point at this machine (127.0.0.1), got host {host!r}")


async def stream_one(
    client: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int | None = None
) -> tuple[Trace, list[str]]:
    """Send one streaming completion; the trace's chunks count 1 token each until re-counted."""
    trace = Trace(start=time.perf_counter())
    texts: list[str] = []
    try:
        async with client.stream(
            "POST", target.url.rstrip("/") + "/v1/completions", json=target.body(prompt, max_tokens)
        ) as resp:
            if resp.status_code != 200:
                trace.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return trace, texts
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    trace.error = str(event["error"])[:300]
                    return trace, texts
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        trace.chunks.append((now, 1))
                        texts.append(choice["text"])
                if event.get("usage"):
                    trace.output_tokens = int(event["usage"]["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as exc:
        trace.error = f"{type(exc).__name__}: {exc}"[:300]
    return trace, texts


def recount(trace: Trace, texts: list[str], tokenizer) -> None:
    """Replace the 1-per-chunk counts with token counts of each chunk's text.

    Done after the run so tokenizing never competes with the server for the CPU. A chunk's
    text re-tokenised alone can differ from the server's tokens by a merge at its edges; the
    total is taken from usage whenever the server reports it.
    """
    if tokenizer is not None:
        counts = [max(1, len(tokenizer.encode(t, add_special_tokens=False))) for t in texts]
        trace.chunks = [(when, n) for (when, _), n in zip(trace.chunks, counts, strict=True)]
    if not trace.output_tokens:
        trace.output_tokens = sum(n for _, n in trace.chunks)


async def run_level(
    target: Target, prompts: list[str], concurrency: int, num_requests: int, tokenizer=None
) -> dict:
    """Send num_requests requests, `concurrency` at a time; summary of the measured run."""
    check_loopback(target.url)
    queue = iter(range(num_requests))
    results: list[tuple[Trace, list[str]]] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(target.timeout_s, connect=30.0)

    async def worker(client: httpx.AsyncClient) -> None:
        for i in queue:
            results.append(await stream_one(client, target, prompts[i % len(prompts)]))

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    for trace, texts in results:
        if trace.error is None:
            recount(trace, texts, tokenizer)
    summary = summarize([t for t, _ in results], seconds)
    errors = sorted({t.error for t, _ in results if t.error})
    short = [t.output_tokens for t, _ in results if not t.error]
    summary.update(
        concurrency=concurrency,
        errors=errors[:3],
        min_output_tokens=min(short) if short else 0,
        max_output_tokens=max(short) if short else 0,
    )
    return summary


async def warm_up(target: Target, prompts: list[str], concurrency: int, max_tokens: int) -> None:
    """`concurrency` short requests at once, so first-use costs stay out of the measurement."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(target.timeout_s)) as client:
        traces = await asyncio.gather(
            *(stream_one(client, target, p, max_tokens) for p in prompts[:concurrency])
        )
    errors = [t.error for t, _ in traces if t.error]
    if errors:
        raise RuntimeError(f"warm-up failed: {errors[0]}")


def text_prompts(tokenizer, count: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """Held-out prompts as text: the same strings for every system under test."""
    from bench.prompts import make_prompts

    ids = make_prompts(tokenizer, count, min_tokens, max_tokens, seed=seed)
    return [tokenizer.decode(p) for p in ids]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the `model` field to send")
    p.add_argument("--kind", choices=KINDS, default="openai", help="how to force fixed lengths")
    p.add_argument("--tokenizer", default=str(ROOT / "bench" / "toy_pair" / "target"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, nargs="+", default=[8, 48], help="one per level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--open-ended", action="store_true", help="let requests stop at EOS")
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=192)
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if len(args.requests) != len(args.concurrency):
        p.error("--requests needs one count per --concurrency level")
    check_loopback(args.url)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    prompts = text_prompts(tokenizer, 256, args.min_prompt, args.max_prompt, args.seed)
    target = Target(args.url, args.model, args.kind, args.max_tokens, not args.open_ended)
    rows = []
    for level, count in zip(args.concurrency, args.requests, strict=True):
        asyncio.run(warm_up(target, prompts[-level:], level, args.warmup_tokens))
        row = asyncio.run(run_level(target, prompts, level, count, tokenizer))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "errors"}), flush=True)
        for error in row["errors"]:
            print("  error:", error, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"target": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
