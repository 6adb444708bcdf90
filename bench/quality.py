"""What a change of the served model's numbers (`--cpu-activations`, `--cpu-attention`) costs
in quality: `python -m bench.quality --modes float32 int8 int8+bfloat16` serves each mode in
turn (`tandem serve`, speculation off, on 127.0.0.1; a mode is ACTIVATIONS[+ATTENTION], the
attention float32 unless named) and measures
- agreement: greedy answers (--max-tokens) to 48 held-out chat instructions (past the chat
  workload's): the share identical to the first mode's, and of tokens before a difference;
- cloze: bench/cloze_items.json (scripts/cloze_items.py: 600 docstring sentences, the last
  word hidden among four candidates), one /v1/completions request an item (4 prompts, echo,
  logprobs, max_tokens 0); the candidate whose own tokens are likeliest is the answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import httpx

from bench.prompts import chat_messages
from bench.serving import tandem_serve

ITEMS = Path(__file__).resolve().parent / "cloze_items.json"
HELD_OUT = range(52, 100)  # past the chat workload's first 48 requests and its warm-ups
MODEL = "m"


async def _answers(client: httpx.AsyncClient, max_tokens: int) -> list[list[str]]:
    """Greedy answers to the held-out instructions, as token strings (logprobs' tokens)."""

    async def one(messages: list[dict]) -> list[str]:
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "logprobs": True}  # fmt: skip
        r = (await client.post("/v1/chat/completions", json=body)).raise_for_status()
        return [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]

    held = chat_messages(HELD_OUT.stop)[HELD_OUT.start :]
    return list(await asyncio.gather(*(one(m) for m in held)))


async def _cloze(client: httpx.AsyncClient, items: list[dict]) -> list[int]:
    """Each item's chosen candidate: the highest sum of its own tokens' logprobs."""
    limit = asyncio.Semaphore(8)

    async def one(item: dict) -> int:
        body = {"model": MODEL, "prompt": [f"{item['context']} {c}" for c in item["choices"]],
                "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0}  # fmt: skip
        async with limit:
            r = (await client.post("/v1/completions", json=body)).raise_for_status()
        scores = [0.0] * len(item["choices"])
        for choice in r.json()["choices"]:
            lp = choice["logprobs"]
            own = zip(lp["text_offset"], lp["token_logprobs"], strict=True)
            scores[choice["index"]] = sum(v for at, v in own if at >= len(item["context"]))
        return max(range(len(scores)), key=scores.__getitem__)

    return list(await asyncio.gather(*(one(i) for i in items)))


def _prefix_share(a: list[str], b: list[str]) -> float:
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))  # noqa: B905
    return same / max(len(a), len(b), 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["float32", "int8"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--items", type=int, default=None, help="the first N cloze items")
    p.add_argument("--logs", type=Path, default=Path("bench/results/logs-quality"))
    args = p.parse_args(argv)
    items = json.loads(ITEMS.read_text())[: args.items]
    answers, picks = {}, {}
    for mode in args.modes:
        flags = ["--served-model-name", MODEL, "--speculative-method", "off"]
        activations, _, attention = mode.partition("+")
        numbers = ["--cpu-activations", activations, "--cpu-attention", attention or "float32"]
        server, _ = tandem_serve([*flags, *numbers], args.logs / f"{mode}.log")
        try:

            async def measure(url: str = server.url) -> tuple:
                async with httpx.AsyncClient(base_url=url, timeout=600) as client:
                    return await _answers(client, args.max_tokens), await _cloze(client, items)

            answers[mode], picks[mode] = asyncio.run(measure())
        finally:
            server.stop()
    first = args.modes[0]
    for mode in args.modes:
        same = sum(a == b for a, b in zip(answers[mode], answers[first], strict=True))
        prefix = [_prefix_share(a, b) for a, b in zip(answers[mode], answers[first], strict=True)]
        right = sum(pick == item["answer"] for pick, item in zip(picks[mode], items, strict=True))
        moved = sum(a != b for a, b in zip(picks[mode], picks[first], strict=True))
        print(f"{mode:>14}: greedy answers identical to {first}'s {same}/{len(prefix)}, "
              f"tokens before the first difference {100 * sum(prefix) / len(prefix):.1f}%; "
              f"cloze {100 * right / len(items):.1f}% of {len(items)} "
              f"({moved} items answered otherwise than {first})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
