"""Hugging Face transformers `generate()` in-process, timed like a streaming client: the
reference bench/gpu_bench.py measures Tandem against (not run on its own). `run_level`: plain
generate() one request at a time at concurrency 1, above it left-padded batches of
`concurrency` prompts, one after another (static batching: a batch's requests all arrive when
it starts). EOS is masked until max_tokens (`min_new_tokens`), so every system generates as
many tokens. A streamer records when each step's tokens exist: TTFT and inter-token latency
mean what they mean over HTTP, less the HTTP and detokenization.
"""

from __future__ import annotations

import time

import torch
from transformers.generation.streamers import BaseStreamer

from bench.serving import Trace, summarize


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


def sync(device: torch.device) -> None:
    """Wait for the GPU, so that a timer read next covers the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def run_padded(model, tokenizer, prompts: list[list[int]], max_tokens: int, batch: int) -> dict:
    """Static batches of `batch` prompts (token ids), left-padded, greedy (batch 1: each
    prompt alone, unpadded)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    settings = {"do_sample": False, "max_new_tokens": max_tokens, "min_new_tokens": max_tokens,
                "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    traces = []
    sync(model.device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        inputs = tokenizer.pad({"input_ids": group}, padding=len(group) > 1, return_tensors="pt")
        inputs = inputs.to(model.device)
        streamer = TimingStreamer(len(group))
        began = time.perf_counter()
        out = model.generate(**inputs, streamer=streamer, **settings)
        sync(model.device)
        for row in out[:, inputs["input_ids"].shape[1] :]:
            # tokens up to and including the first EOS (a finished row is padded after it)
            hits = (row == tokenizer.eos_token_id).nonzero()
            n = int(hits[0]) + 1 if len(hits) else len(row)
            traces.append(Trace(start=began, chunks=list(streamer.chunks), output_tokens=n))
    return summarize(traces, time.perf_counter() - start)


def run_level(
    model, tokenizer, prompts: list, warm: list, level: int, max_tokens: int, warmup_tokens: int
) -> dict:
    """Plain greedy generate() at one concurrency level, after a warm-up on `warm`: batch 1
    at level 1, else static left-padded batches of `level` prompts."""
    run_padded(model, tokenizer, warm[:level], warmup_tokens, level)
    row = run_padded(model, tokenizer, prompts, max_tokens, level)
    if level == 1:
        return row
    return row | {"notes": f"static batches of {level}, left padding; TTFT from each batch's start"}
