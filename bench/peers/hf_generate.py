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
import copy
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


def encode(tokenizer, prompts: list[str] | list[list[int]], device: torch.device) -> dict:
    """A padded batch on `device`, from prompt strings or from prompt token ids."""
    pad = len(prompts) > 1
    if isinstance(prompts[0], str):
        batch = tokenizer(prompts, return_tensors="pt", padding=pad)
    else:
        batch = tokenizer.pad({"input_ids": prompts}, padding=pad, return_tensors="pt")
    return batch.to(device)


def sync(device: torch.device) -> None:
    """Wait for the GPU, so that a timer read next covers the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generated_length(row: torch.Tensor, eos: int | None) -> int:
    """Tokens up to and including the first EOS (a finished row is padded after it)."""
    hits = (row == eos).nonzero() if eos is not None else []
    return int(hits[0]) + 1 if len(hits) else len(row)


@torch.inference_mode()
def run_batch1(
    model, tokenizer, prompts: list, max_tokens: int, settings: dict | None = None, **extra
) -> dict:
    """Prompts one after another, each alone; prompts are strings or token id lists.
    `settings`: generate()'s decoding arguments, greedy_kwargs' when None."""
    settings = greedy_kwargs(tokenizer, max_tokens) if settings is None else settings
    traces = []
    sync(model.device)
    start = time.perf_counter()
    for prompt in prompts:
        inputs = encode(tokenizer, [prompt], model.device)
        streamer = TimingStreamer(1)
        trace = Trace(start=time.perf_counter())
        out = model.generate(**inputs, streamer=streamer, **settings, **extra)
        sync(model.device)
        trace.chunks = streamer.chunks
        trace.output_tokens = out.shape[1] - inputs["input_ids"].shape[1]
        traces.append(trace)
    return summarize(traces, time.perf_counter() - start)


@torch.inference_mode()
def run_padded(
    model, tokenizer, prompts: list, max_tokens: int, batch: int, settings: dict | None = None
) -> dict:
    """Static batches of `batch` prompts (strings or token id lists), left-padded.
    `settings`: generate()'s decoding arguments, greedy_kwargs' when None."""
    settings = greedy_kwargs(tokenizer, max_tokens) if settings is None else settings
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    traces = []
    sync(model.device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        inputs = encode(tokenizer, group, model.device)
        streamer = TimingStreamer(len(group))
        began = time.perf_counter()
        out = model.generate(**inputs, streamer=streamer, **settings)
        sync(model.device)
        new = out[:, inputs["input_ids"].shape[1] :]
        for row in new:
            n = generated_length(row, tokenizer.eos_token_id)
            traces.append(Trace(start=began, chunks=list(streamer.chunks), output_tokens=n))
    return summarize(traces, time.perf_counter() - start)


# The heuristic schedule (and the library default before the confidence
# threshold): K starts at 5, +2 after a fully accepted draft, else -1.
HEURISTIC_K = {
    "num_assistant_tokens": 5,
    "num_assistant_tokens_schedule": "heuristic",
    "assistant_confidence_threshold": 0.0,
}


def assistant_settings(draft) -> str:
    """The draft-length settings assisted generation will use (defaults filled in)."""
    config = draft.generation_config
    # A private helper of recent transformers releases; older ones leave unset values None.
    defaults_of = getattr(config, "_get_default_generation_params", dict)
    defaults = defaults_of()
    keys = (
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
    )
    return ", ".join(
        f"{k}={getattr(config, k) if getattr(config, k) is not None else defaults.get(k)}"
        for k in keys
    )


def run_level(
    model,
    tokenizer,
    prompts: list,
    warm: list,
    level: int,
    max_tokens: int,
    warmup_tokens: int,
    settings: dict | None = None,
) -> dict:
    """Plain generate() at one concurrency level, after a (greedy) warm-up on `warm`: batch 1
    at level 1, else static left-padded batches of `level` prompts. `settings`: the measured
    run's decoding arguments, greedy_kwargs' when None."""
    if level == 1:
        run_batch1(model, tokenizer, warm[:1], warmup_tokens)
        return run_batch1(model, tokenizer, prompts, max_tokens, settings)
    run_padded(model, tokenizer, warm[:level], warmup_tokens, level)
    row = run_padded(model, tokenizer, prompts, max_tokens, level, settings)
    return row | {"notes": f"static batches of {level}, left padding; TTFT from each batch's start"}


def run_assisted(
    model,
    draft,
    tokenizer,
    prompts: list,
    warm: list,
    max_tokens: int,
    warmup_tokens: int,
    heuristic: bool,
) -> dict:
    """Assisted generation at batch 1 (all it takes), after a warm-up on `warm`, with the
    library's draft-length defaults or with HEURISTIC_K; the draft's settings are restored."""
    defaults = copy.deepcopy(draft.generation_config)
    assisted = {"assistant_model": draft}
    try:
        if heuristic:
            draft.generation_config.update(**HEURISTIC_K)
        run_batch1(model, tokenizer, warm[:1], warmup_tokens, **assisted)
        if heuristic:  # the schedule carries K across calls: start the measured run afresh
            draft.generation_config.update(**HEURISTIC_K)
        which = "" if heuristic else "library defaults: "
        notes = f"assistant_model=draft, {which}{assistant_settings(draft)}"  # K as it starts
        return run_batch1(model, tokenizer, prompts, max_tokens, **assisted) | {"notes": notes}
    finally:
        draft.generation_config = defaults


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

    def record(config: str, concurrency: int, fn) -> None:
        began = time.perf_counter()
        try:
            row = fn()
            row["errors"] = []
        except Exception as exc:  # a peer's failure is a result, not a crash
            row = {"errors": [f"{type(exc).__name__}: {exc}"[:400]]}
        row.update(config=config, concurrency=concurrency)
        row.setdefault("notes", "")
        row["wall_s"] = time.perf_counter() - began
        rows.append(row)
        print(json.dumps(row), flush=True)

    n1 = prompts[: args.requests_batch1]
    if "plain" in args.only:
        record(
            "generate() plain",
            1,
            lambda: run_level(target, tokenizer, n1, warm, 1, args.max_tokens, args.warmup_tokens),
        )
    if "assisted" in args.only:
        for config, heuristic in [
            ("generate() assisted", False),
            ("generate() assisted, heuristic K", True),
        ]:
            record(
                config,
                1,
                lambda h=heuristic: run_assisted(
                    target, draft, tokenizer, n1, warm, args.max_tokens, args.warmup_tokens, h
                ),
            )
    if "padded" in args.only:
        nb = prompts[: args.requests_batched]
        record(
            f"generate() padded batch {args.batch}",
            args.batch,
            lambda: run_level(
                target, tokenizer, nb, warm, args.batch, args.max_tokens, args.warmup_tokens
            ),
        )
    args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
