"""The engine's host time per step outside its model passes: the CPU proxy of a GPU step's cost.

  python -m bench.host_cost                       # batches 1, 16, 64
  python -m bench.host_cost --batches 16 --steps 200 --rounds 5

On a GPU a small model's pass at batch 16-64 takes about a millisecond, so the engine's host
work around it (scheduling, the policy, drafting, verification, the update) decides whether
speculation can pay. Here the passes run on tiny random models (bench/gpu_pair.py's TINY
shapes on SmolLM2's tokenizer, a 1,024-token vocabulary so that the work on each row's logits,
device work on a GPU, is small too); every runner `forward` call is timed and taken out of
the step's wall time. Engines: `off`; `adaptive` (the draft model, adaptive K); `K=2` (fixed:
every step drafts). Per engine and batch (32-token prompts, greedy, EOS ignored): the median
host time of its plain steps (no drafts) and of its drafting steps over --rounds rounds of
--steps steps, the engines in turn each round, and each over the off engine's plain steps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.gpu_pair import TINY_DRAFT, TINY_TARGET, TOKENIZER, build_model, save_member
from engine import (
    CacheConfig,
    EngineConfig,
    LLMEngine,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
    SpecConfig,
)

ENGINES = {
    "off": {"method": "off"},
    "adaptive": {"method": "draft", "max_draft_tokens": 4, "draft_length": "adaptive"},
    "K=2": {"method": "draft", "max_draft_tokens": 2, "draft_length": "fixed"},
}
VOCAB, PROMPT_TOKENS = 1024, 32


def tiny_pair(root: Path) -> tuple[str, str]:
    """A random tiny target and draft, saved under `root`."""
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    eot, end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    for name, shape, seed in (("target", TINY_TARGET, 0), ("draft", TINY_DRAFT, 1)):
        torch.manual_seed(seed)
        save_member(build_model(shape, VOCAB, eot, end), tok, root / name)
    return str(root / "target"), str(root / "draft")


def timed_engine(target: str, draft: str, name: str, batch: int) -> tuple[LLMEngine, list]:
    """An engine, and a one-item list summing the seconds of its runners' `forward` calls."""
    spec = ENGINES[name] | ({"draft_model": draft} if name != "off" else {})
    eng = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=target),
            cache=CacheConfig(block_size=16, memory_gb=0.5),
            scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=4096),
            spec=SpecConfig(**spec),
        )
    )
    passes = [0.0]
    for runner in eng.runners:

        def forward(*args, _forward=runner.forward, **kwargs):
            start = time.perf_counter()
            try:
                return _forward(*args, **kwargs)
            finally:
                passes[0] += time.perf_counter() - start

        runner.forward = forward
    return eng, passes


def host_times(eng: LLMEngine, passes: list, batch: int, steps: int, seed: int) -> tuple:
    """(plain, drafting): the host seconds of each of `steps` decode steps of `batch` requests."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)  # never reached
    ids = [f"{seed}-{i}" for i in range(batch)]
    for rid in ids:
        eng.add_request(
            rid, torch.randint(100, VOCAB, (PROMPT_TOKENS,), generator=gen).tolist(), params
        )
    while any(r.is_prefill for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # the prefills, untimed
    for _ in range(8):
        eng.step()  # warm-up decodes
    plain, drafting = [], []
    for _ in range(steps):
        stats = eng.stats()
        drafted, before = stats.spec_drafted_tokens + stats.spec_lookup_drafted, passes[0]
        start = time.perf_counter()
        eng.step()
        host = time.perf_counter() - start - (passes[0] - before)
        stats = eng.stats()
        now = stats.spec_drafted_tokens + stats.spec_lookup_drafted
        (drafting if now > drafted else plain).append(host)
    for rid in ids:
        eng.abort(rid)
    return plain, drafting


def measure(batches: list[int], steps: int, rounds: int) -> dict[tuple[int, str], tuple]:
    """(batch, engine) -> (plain, drafting) host seconds of every step measured."""
    out: dict[tuple[int, str], tuple] = {}
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = tiny_pair(Path(tmp))
        for batch in batches:
            engines = {name: timed_engine(target, draft, name, batch) for name in ENGINES}
            for r in range(rounds):
                for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
                    plain, drafting = host_times(*engines[name], batch, steps, seed=r)
                    old = out.setdefault((batch, name), ([], []))
                    old[0].extend(plain), old[1].extend(drafting)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=100, help="at most 170 (1,024 positions)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # tiny passes: more threads would only add their wake-ups
    times = measure(args.batches, args.steps, args.rounds)
    for (batch, name), kinds in times.items():
        base = statistics.median(times[batch, "off"][0])
        cells = [
            f"{kind} {1e3 * statistics.median(xs):.3f} ms ({len(xs)} steps, "
            f"{statistics.median(xs) / base:.2f}x)"
            for kind, xs in zip(("plain", "drafting"), kinds, strict=True)
            if xs
        ]
        print(f"batch {batch:3d}  {name:9s} " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
