"""The engine's host time per step outside its model passes: the CPU proxy of a GPU step's cost.

  python -m bench.host_cost                       # batches 1, 16, 64
  python -m bench.host_cost --batches 16 --steps 150 --rounds 5

Engines `off`, `adaptive` (the draft model, adaptive K) and `K=2` (always drafting) on tiny
random models (bench/gpu_pair.py's TINY shapes, 1,024 tokens: passes and logits cost little),
every runner pass on packed inputs (`forward_packed`) timed and taken out of its step's time
(packing the requests' inputs is host work). Per engine and batch (32-token prompts, greedy):
the median host time of plain (no drafts) and drafting steps over --rounds rounds of --steps
steps, the engines in turn each round, and each over off's plain steps.
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
from engine import (  # noqa: I001
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
VOCAB, PROMPT = 1024, 32


def timed_engine(root: Path, name: str, batch: int) -> tuple[LLMEngine, list[float]]:
    """An engine on the tiny pair under `root`, and a list whose item sums its passes' time."""
    spec = ENGINES[name] | ({"draft_model": str(root / "draft")} if name != "off" else {})
    eng = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(root / "target")),
            cache=CacheConfig(block_size=16, memory_gb=0.5),
            scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=4096),
            spec=SpecConfig(**spec),
        )
    )
    passes = [0.0]
    for runner in eng.runners:

        def forward_packed(*args, _forward=runner.forward_packed, **kwargs):
            start = time.perf_counter()
            try:
                return _forward(*args, **kwargs)
            finally:
                passes[0] += time.perf_counter() - start

        runner.forward_packed = forward_packed
    return eng, passes


def host_times(eng: LLMEngine, passes: list[float], batch: int, steps: int, seed: int):
    """(plain, drafting): the host seconds of each of `steps` decode steps of `batch` requests."""
    params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)  # never reached
    gen, ids = torch.Generator().manual_seed(seed), [f"{seed}-{i}" for i in range(batch)]
    for rid in ids:
        eng.add_request(rid, torch.randint(100, VOCAB, (PROMPT,), generator=gen).tolist(), params)
    for _ in range(9):  # the prefills (one step: they fit its token budget), 8 decodes: untimed
        eng.step()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(steps):
        before, passed, start = _drafted(eng), passes[0], time.perf_counter()
        eng.step()
        host = time.perf_counter() - start - (passes[0] - passed)
        times[_drafted(eng) > before].append(host)
    for rid in ids:
        eng.abort(rid)
    return times


def _drafted(eng: LLMEngine) -> int:
    stats = eng.stats()
    return stats.spec_drafted_tokens + stats.spec_lookup_drafted


def measure(batches: list[int], steps: int, rounds: int) -> dict[tuple[int, str], tuple]:
    """(batch, engine) -> (plain, drafting) host seconds of every step measured."""
    out: dict[tuple[int, str], tuple] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tok = AutoTokenizer.from_pretrained(TOKENIZER)
        stops = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
        for name, shape, seed in (("target", TINY_TARGET, 0), ("draft", TINY_DRAFT, 1)):
            torch.manual_seed(seed)
            save_member(build_model(shape, VOCAB, *stops), tok, Path(tmp) / name)
        for batch in batches:
            engines = {name: timed_engine(Path(tmp), name, batch) for name in ENGINES}
            for r in range(rounds):
                for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
                    times = host_times(*engines[name], batch, steps, seed=r)
                    plain, drafting = out.setdefault((batch, name), ([], []))
                    plain.extend(times[0])
                    drafting.extend(times[1])
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
