"""The engine's host time per step, outside its model passes: the CPU proxy of a GPU step's cost.

  python -m bench.host_cost                       # batches 1, 16, 64
  python -m bench.host_cost --batches 16 --steps 200 --rounds 5

On a GPU a pass of a small model at batch 16-64 takes about a millisecond, so what the engine
does around it on the host (scheduling, the policy, drafting bookkeeping, verification, the
scheduler's update) decides whether speculation can pay. Here the passes run on tiny random
models (bench/gpu_pair.py's TINY shapes, SmolLM2's tokenizer), and every call of a runner's
`forward` is timed and taken out of the step's wall time; what is left is the host time.

Engines: `off` (no speculation), `adaptive` (the draft model, adaptive K: with a random draft
it settles on K = 0, so its steps are mostly plain, as under load) and `K=2` (the draft model,
fixed K: every step drafts). Per engine and batch (requests of 32 prompt tokens, greedy, EOS
ignored), the median host milliseconds of its plain steps (no drafts verified) and of its
drafting steps, over `--rounds` rounds of `--steps` steps each, the engines taken in turn each
round. The ratios printed are each kind's over the off engine's plain steps.
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
    "off": lambda draft: SpecConfig(method="off"),
    "adaptive": lambda draft: SpecConfig(
        method="draft", draft_model=draft, max_draft_tokens=4, draft_length="adaptive"
    ),
    "K=2": lambda draft: SpecConfig(
        method="draft", draft_model=draft, max_draft_tokens=2, draft_length="fixed"
    ),
}
PROMPT_TOKENS = 32
VOCAB = 1024
"""The tiny models' vocabulary (their tokenizer's first tokens): small, so that what a GPU does
on the device, the vocabulary-wide work on each row's logits, costs little here as well."""


def tiny_pair(root: Path) -> tuple[str, str]:
    """A random tiny target and draft on SmolLM2's tokenizer, saved under `root`."""
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    eot, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    for name, shape, seed in (("target", TINY_TARGET, 0), ("draft", TINY_DRAFT, 1)):
        torch.manual_seed(seed)
        save_member(build_model(shape, VOCAB, eot, im_end), tok, root / name)
    return str(root / "target"), str(root / "draft")


def make_engine(target: str, spec: SpecConfig, batch: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=target),
            cache=CacheConfig(block_size=16, memory_gb=0.5),
            scheduler=SchedulerConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=4096),
            spec=spec,
        )
    )


class PassClock:
    """Sums the wall time of every runner's `forward` (the target's and the draft's passes)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = 0.0
        for runner in engine.runners:
            runner.forward = self._timed(runner.forward)

    def _timed(self, forward):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def host_times(engine: LLMEngine, clock: PassClock, batch: int, steps: int, seed: int):
    """(plain, drafting): host seconds of each decode step of `batch` requests."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    ids = []
    for i in range(batch):
        prompt = torch.randint(100, VOCAB, (PROMPT_TOKENS,), generator=gen).tolist()
        ids.append(f"{seed}-{i}")
        engine.add_request(ids[-1], prompt, params)
    while engine.stats().num_running < batch or any(
        r.is_prefill for r in engine.scheduler.running
    ):
        engine.step()  # the prefills, outside the clock
    for _ in range(8):  # warm-up decode steps
        engine.step()
    plain, drafting = [], []
    for _ in range(steps):
        before_passes, before_drafted = clock.seconds, engine.stats().spec_drafted_tokens
        before_lookups = engine.stats().spec_lookup_drafted
        start = time.perf_counter()
        engine.step()
        host = time.perf_counter() - start - (clock.seconds - before_passes)
        stats = engine.stats()
        drafted = stats.spec_drafted_tokens + stats.spec_lookup_drafted
        (drafting if drafted > before_drafted + before_lookups else plain).append(host)
    for rid in ids:
        engine.abort(rid)
    engine.step()
    return plain, drafting


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=100, help="at most 850")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # tiny passes: threads would only add their wake-up time
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = tiny_pair(Path(tmp))
        for batch in args.batches:
            engines = {}
            for name, spec in ENGINES.items():
                eng = make_engine(target, spec(draft), batch)
                engines[name] = (eng, PassClock(eng))
            times = {name: ([], []) for name in engines}
            for r in range(args.rounds):
                order = list(engines) if r % 2 == 0 else list(engines)[::-1]
                for name in order:
                    eng, clock = engines[name]
                    plain, drafting = host_times(eng, clock, batch, args.steps, seed=r)
                    times[name][0].extend(plain)
                    times[name][1].extend(drafting)
            base = statistics.median(times["off"][0])
            for name, (plain, drafting) in times.items():
                cells = []
                for kind, xs in (("plain", plain), ("drafting", drafting)):
                    if xs:
                        med = statistics.median(xs)
                        cells.append(f"{kind} {1e3 * med:.3f} ms ({len(xs)} steps, {med / base:.2f}x)")
                print(f"batch {batch:3d}  {name:9s} " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
