"""Hugging Face transformers `generate()` in-process, timed like a streaming client.

  python -m bench.peers.hf_generate --prompts P.json --out R.json --max-tokens 128

Rows: plain greedy generate() at batch 1; assisted generation with the draft model
(`assistant_model=`, transformers' own draft-length heuristics, batch 1 only); plain
generate() over left-padded batches of `--batch` prompts, a static-batching stand-in for
concurrency 16 (the batch's requests all arrive when it starts; batches run one after
another). EOS is masked until max_tokens (`min_new_tokens`) so every system generates the
same number of tokens. A streamer records when each step's tokens exist, so TTFT and
inter-token latency mean the same as over HTTP, minus the HTTP and detokenization cost.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from bench.latency import Trace, summarize


class TimingStreamer(BaseStreamer):
    """Records (time, new tokens per sequence) for every put after the prompt."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.seen_prompt = False
        self.chunks: list[tuple[float, int]] = []

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.chunks.append((now, value.numel() // self.batch))

    def end(self) -> None:
        pass


def greedy_kwargs(tokenizer, max_tokens: int) -> dict:
    return {
        "do_sample": False,
        "max_new_tokens": max_tokens,
        "min_new_tokens": max_tokens,
        "pad_token_id": tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id,
    }


def generated_length(row: torch.Tensor, eos: int | None) -> int:
    """Tokens up to and including the first EOS (a finished row is padded after it)."""
    hits = (row == eos).nonzero() if eos is not None else []
    return int(hits[0]) + 1 if len(hits) else len(row)


@torch.inference_mode()
def run_batch1(model, tokenizer, prompts: list[str], max_tokens: int, **extra) -> dict:
    traces = []
    start = time.perf_counter()
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        streamer = TimingStreamer(1)
        trace = Trace(start=time.perf_counter())
        out = model.generate(
            **inputs, streamer=streamer, **greedy_kwargs(tokenizer, max_tokens), **extra
        )
        trace.chunks = streamer.chunks
        trace.output_tokens = out.shape[1] - inputs["input_ids"].shape[1]
        traces.append(trace)
    return summarize(traces, time.perf_counter() - start)


@torch.inference_mode()
def run_padded(model, tokenizer, prompts: list[str], max_tokens: int, batch: int) -> dict:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    traces = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        inputs = tokenizer(group, return_tensors="pt", padding=True)
        streamer = TimingStreamer(len(group))
        began = time.perf_counter()
        out = model.generate(**inputs, streamer=streamer, **greedy_kwargs(tokenizer, max_tokens))
        new = out[:, inputs["input_ids"].shape[1] :]
        for row in new:
            n = generated_length(row, tokenizer.eos_token_id)
            traces.append(Trace(start=began, chunks=list(streamer.chunks), output_tokens=n))
    return summarize(traces, time.perf_counter() - start)


def assistant_settings(draft) -> str:
    """The draft-length settings assisted generation will use (defaults filled in)."""
    config = draft.generation_config
    defaults = config._get_default_generation_params()
    keys = (
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
    )
    return ", ".join(
        f"{k}={getattr(config, k) if getattr(config, k) is not None else defaults.get(k)}"
        for k in keys
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--prompts", type=Path, required=True, help="JSON list of prompt strings")
    p.add_argument("--requests-batch1", type=int, default=6)
    p.add_argument("--requests-batched", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--only", nargs="*", default=["plain", "assisted", "padded"])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = json.loads(args.prompts.read_text())
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    target = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft_model, dtype=torch.float32).eval()
    warm = prompts[-args.batch :]
    rows = []

    def record(config: str, concurrency: int, fn, notes: str = "") -> None:
        began = time.perf_counter()
        try:
            row = fn()
            row["errors"] = []
        except Exception as exc:  # a peer's failure is a result, not a crash
            row = {"errors": [f"{type(exc).__name__}: {exc}"[:400]]}
        row.update(config=config, concurrency=concurrency, notes=notes)
        row["wall_s"] = time.perf_counter() - began
        rows.append(row)
        print(json.dumps(row), flush=True)

    n1 = prompts[: args.requests_batch1]
    if "plain" in args.only:
        run_batch1(target, tokenizer, warm[:1], args.warmup_tokens)
        record("generate() plain", 1, lambda: run_batch1(target, tokenizer, n1, args.max_tokens))
    if "assisted" in args.only:
        assisted = {"assistant_model": draft}
        run_batch1(target, tokenizer, warm[:1], args.warmup_tokens, **assisted)
        record(
            "generate() assisted",
            1,
            lambda: run_batch1(target, tokenizer, n1, args.max_tokens, **assisted),
            "assistant_model=draft, library defaults: " + assistant_settings(draft),
        )
        # The schedule SPECULATIVE.md describes (and the library default before the
        # confidence threshold): K starts at 5, +2 after a fully accepted draft, else -1.
        heuristic = {
            "num_assistant_tokens": 5,
            "num_assistant_tokens_schedule": "heuristic",
            "assistant_confidence_threshold": 0.0,
        }
        draft.generation_config.update(**heuristic)
        run_batch1(target, tokenizer, warm[:1], args.warmup_tokens, **assisted)
        draft.generation_config.update(**heuristic)  # K persists across calls: start again
        record(
            "generate() assisted, heuristic K",
            1,
            lambda: run_batch1(target, tokenizer, n1, args.max_tokens, **assisted),
            "assistant_model=draft, " + assistant_settings(draft),
        )
    if "padded" in args.only:
        nb = prompts[: args.requests_batched]
        run_padded(target, tokenizer, warm, args.warmup_tokens, args.batch)
        record(
            f"generate() padded batch {args.batch}",
            args.batch,
            lambda: run_padded(target, tokenizer, nb, args.max_tokens, args.batch),
            f"static batches of {args.batch}, left padding; TTFT from each batch's start",
        )
    args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
