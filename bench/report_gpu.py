"""The GPU sections of docs/BENCHMARKS.md, from bench/results/gpu_*.json (bench.gpu_bench).

One section per results file measured on a CUDA device: provenance, the pair, the bandwidth
floor against a measured target pass, the greedy check, the batch-1 comparisons issue 10
asks for, and tables plus a plot (output tokens/s against concurrency, one line per system
and setting). A file measured on the CPU (the smoke test's scale) is left out, so nothing
here can print numbers no GPU produced.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

TANDEM, HF_PLAIN, HF_ASSISTED = "Tandem", "HF generate()", "HF assisted"
FLOOR_GOAL, PLAIN_GOAL, ASSISTED_GOAL = 1.5, 2.0, 1.3  # issue 10's bars


def gpu_sections(results: Path, docs: Path) -> list[str]:
    lines: list[str] = []
    for path in sorted(results.glob("gpu_*.json")):
        data = json.loads(path.read_text())
        device = data.get("machine", {}).get("device_type")
        if device != "cuda":
            print(f"{path.name}: measured on {device}, not a GPU: left out of the report")
            continue
        lines += ["", *gpu_section(data, docs / f"gpu_{data['label']}.png")]
    return lines


def gpu_section(data: dict, png: Path) -> list[str]:
    rows = [r for r in data["results"] if _ok(r)]
    names = list(dict.fromkeys(_name(r) for r in rows))
    levels = sorted({r["concurrency"] for r in data["results"]})
    _plot(rows, names, levels, png, data)
    m, cfg = data["machine"], data["config"]
    lines = [
        f"## On a GPU: the {data['label']} pair (issue 10)",
        "",
        f"Measured {data['date']} on {m['device']} (CUDA {m.get('cuda')}, {m['cpu']}); torch "
        f"{m['torch']}, transformers {m['transformers']}, Python {m['python']}; {cfg['dtype']} "
        f"weights and KV. Command: `{data['command']}`. Every run is greedy with exactly "
        f"{cfg['max_tokens']} output tokens per request, on held-out prompts of "
        f"{cfg['prompt_tokens'][0]}-{cfg['prompt_tokens'][1]} tokens, after a warm-up at "
        "the same concurrency; Tandem runs in-process (bench.driver's closed loop, prefix "
        "cache off), HF generate() in-process at batch 1 (concurrency 1) or in static "
        "left-padded batches of the concurrency (TTFT from the batch's start).",
        "",
        *_pair(data["pair"]),
    ]
    if data.get("floor"):
        lines += ["", *_floor(data["floor"], rows)]
    if data.get("greedy"):
        lines += ["", *_greedy(data["greedy"])]
    lines += ["", *_claims(rows), "", f"![output tokens/s against concurrency]({png.name})"]
    for key, title, digits in [
        ("tokens_per_s", "Output tokens/s", 1),
        ("ttft_mean_ms", "Mean time to first token (ms)", 1),
        ("itl_mean_ms", "Mean inter-token latency (ms)", 2),
        ("acceptance", "Per-token acceptance (Tandem)", 3),
        ("mean_k", "Mean K per decode step (Tandem)", 2),
    ]:
        shown = [n for n in names if any(key in r for r in rows if _name(r) == n)]
        lines += ["", f"{title}:", "", *_table(rows, shown, levels, key, digits)]
    lines += _captures(rows)
    lines += _gc_pauses(rows)
    lines += _gaps(data)
    return lines


def _captures(rows: list[dict]) -> list[str]:
    """CUDA graphs captured inside Tandem's timed runs (each costs tens of milliseconds)."""
    tandem = [r for r in rows if r["system"] == TANDEM]
    if tandem and all("graph_captures" not in r for r in tandem):
        return [
            "",
            "This run warmed Tandem up on a few tokens a request and did not count the CUDA "
            "graphs captured inside its timed runs (bench.gpu_bench now warms up on whole "
            "requests and counts them): rows whose batches needed new draft-length mixes may "
            "include captures.",
        ]
    hit = [
        f"{_name(r)} at {r['concurrency']}: {r['graph_captures']}"
        for r in tandem
        if r.get("graph_captures")
    ]
    if not hit:
        return ["", "No CUDA graph was captured inside a timed Tandem run."]
    return ["", "CUDA graphs captured inside timed Tandem runs: " + "; ".join(hit) + "."]


def _gc_pauses(rows: list[dict]) -> list[str]:
    """The garbage collector's time inside Tandem's timed runs (bench/driver.py freezes the
    heap before each one; results from before that carry no such field)."""
    tandem = [r for r in rows if r["system"] == TANDEM and "gc_seconds" in r]
    if not tandem:
        return []
    hit = [
        f"{_name(r)} at {r['concurrency']}: {1e3 * r['gc_seconds']:.0f} ms "
        f"({r['gc_full_collections']} full)"
        for r in tandem
        if r["gc_seconds"] >= 0.005
    ]
    if not hit:
        return ["", "The garbage collector ran under 5 ms in every timed Tandem run."]
    return ["", "Garbage collection inside timed Tandem runs: " + "; ".join(hit) + "."]


def _pair(pair: dict) -> list[str]:
    size = (
        f"a {pair['target_params'] / 1e6:.0f}M-parameter Llama target "
        f"({_shape(pair['target_shape'])}) and a {pair['draft_params'] / 1e6:.1f}M draft "
        f"({_shape(pair['draft_shape'])}), sha256 {pair['pair_id']}"
    )
    if pair["mode"] == "random":
        return [
            f"The pair: {size}, random weights (`{pair['command']}`). Random weights give "
            "step times only: their acceptance and any speculative speedup mean nothing."
        ]
    t, d, e = pair["target_training"], pair["draft_training"], pair["eval"]
    corpus = pair["corpus"]
    return [
        f"The pair: {size}, trained on the GPU by `{pair['command']}` ({pair['date']}) on the "
        f"default pair's corpus and tokenizer (Python {corpus['python']} standard library, "
        f"{corpus['train_tokens']:,} train tokens; batches of {pair['batch'][0]} x "
        f"{pair['batch'][1]}): target {t['steps']} steps, {t['tokens']:,} tokens in "
        f"{t['seconds']:.0f} s (CE); draft {d['steps']} steps, {d['tokens']:,} tokens in "
        f"{d['seconds']:.0f} s ({d['objective']}). Held-out cross-entropy: target "
        f"{e['target_ce']:.3f}, draft {e['draft_ce']:.3f} nats/token; the draft's greedy "
        f"token agrees with the target's {e['match_rate']:.1%} of the time "
        f"({e['tokens_per_step']:.2f} tokens per target pass simulated at K={e['agreement_k']})."
    ]


def _floor(f: dict, rows: list[dict]) -> list[str]:
    off = next((r for r in rows if r["setting"] == "off" and r["concurrency"] == 1), None)
    lines = [
        "The bandwidth floor of one target pass at batch 1 (bench/gpu_floor.py): target weight "
        "bytes over the measured device-to-device copy bandwidth (bytes read + written), "
        "against a Tandem target pass (`ModelRunner.forward`, one decode token at context "
        f"{f['pass_context']}, median of {f['pass_iters']}, synchronised before and after):",
        "",
        "| target weights | copy bandwidth | floor | Tandem pass | pass / floor | within "
        f"{FLOOR_GOAL}x? |",
        "|---:|---:|---:|---:|---:|---|",
        f"| {f['target_weight_bytes'] / 1e6:.0f} MB | {f['copy_bandwidth_gb_s']:,.0f} GB/s | "
        f"{f['floor_us']:.1f} us | {f['pass_median_us']:.1f} us | {f['pass_over_floor']:.2f}x | "
        f"{_verdict(f['pass_over_floor'] <= FLOOR_GOAL)} |",
    ]
    if f.get("graph_replay_us"):
        replay = f["graph_replay_us"]
        lines += [
            "",
            f"The pass's GPU time alone, a replay of its CUDA graph timed with CUDA events "
            f"(the model body, no LM head, no host work): {replay:.1f} us, "
            f"{replay / f['floor_us']:.2f}x the floor.",
        ]
    if off and off.get("verify_steps"):
        per_step = 1e6 * off["target_seconds"] / off["verify_steps"]
        lines += [
            "",
            f"In the concurrency-1 run with speculation off, the engine timed {per_step:.1f} us "
            f"per target step on average ({per_step / f['floor_us']:.2f}x the floor; prefill "
            "steps included, sampling and the host copy of the result too).",
        ]
    return lines


def _greedy(greedy: dict) -> list[str]:
    g0 = next(iter(greedy.values()))
    lines = [
        f"Greedy check: {g0['prompts']} prompts, {g0['tokens_each']} tokens each, every "
        "Tandem setting against HF plain generate() one prompt at a time, same weights and "
        "dtype. On a GPU, different kernels may round differently and flip a near-tied "
        "argmax, so the length of the agreeing prefix is shown beside the verdict.",
    ]
    if not any("differences" in g for g in greedy.values()):  # results from before the gaps
        lines += ["", "| Tandem setting | token-identical | mean agreeing prefix (tokens) |"]
        lines.append("|---|---|---:|")
        for name, g in greedy.items():
            same = "yes" if g["greedy_match"] else "**no**"
            lines.append(f"| {name} | {same} | {g['agreeing_prefix_mean']:.1f} |")
        return lines
    lines += [
        "Where they differ, the gap is HF's logit of its own token minus its logit of "
        "Tandem's token at the first difference (a near-tie when small beside the logits' "
        "spread); the last column says whether a speculative setting gave exactly the tokens "
        "of Tandem with speculation off, which speculation must never change.",
        "",
        "| Tandem setting | token-identical to HF | mean agreeing prefix (tokens) "
        "| first differences: position (logit gap) | identical to Tandem off |",
        "|---|---|---:|---|---|",
    ]
    for name, g in greedy.items():
        same = "yes" if g["greedy_match"] else "**no**"
        diffs = ", ".join(
            f"prompt {d['prompt']} at {d['position']} ({d['logit_gap']:.3f})"
            for d in g.get("differences", [])
        )
        own = {True: "yes", False: "**no**", None: "-"}[g.get("same_as_off")]
        lines.append(
            f"| {name} | {same} | {g['agreeing_prefix_mean']:.1f} | {diffs or '-'} | {own} |"
        )
    return lines


def _claims(rows: list[dict]) -> list[str]:
    """Issue 10's batch-1 bars: best speculative Tandem setting against HF plain and assisted."""
    at1 = [r for r in rows if r["concurrency"] == 1 and "tokens_per_s" in r]
    spec = [r for r in at1 if r["system"] == TANDEM and r["setting"] != "off"]
    lines = [
        "At concurrency 1 (output tokens/s):",
        "",
        "| comparison | Tandem | peer | ratio | goal | met? |",
        "|---|---:|---:|---:|---:|---|",
    ]
    if not spec:
        return lines[:1] + ["", "No speculative Tandem run at concurrency 1."]
    ours = max(spec, key=lambda r: r["tokens_per_s"])
    for system, goal in [(HF_PLAIN, PLAIN_GOAL), (HF_ASSISTED, ASSISTED_GOAL)]:
        peers = [r for r in at1 if r["system"] == system]
        if not peers:
            lines.append(f"| Tandem vs {system}: not measured | - | - | - | {goal}x | - |")
            continue
        peer = max(peers, key=lambda r: r["tokens_per_s"])
        ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
        lines.append(
            f"| Tandem {ours['setting']} vs {_name(peer)} | {ours['tokens_per_s']:.1f} | "
            f"{peer['tokens_per_s']:.1f} | {ratio:.2f}x | {goal}x | {_verdict(ratio >= goal)} |"
        )
    return lines


def _table(rows: list[dict], names: list[str], levels: list[int], key: str, digits: int):
    cell = {(_name(r), r["concurrency"]): r.get(key) for r in rows}
    out = ["| concurrency | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for c in levels:
        values = [_fmt(cell.get((n, c)), digits) for n in names]
        out.append(f"| {c} | " + " | ".join(values) + " |")
    return out


def _gaps(data: dict) -> list[str]:
    lines = []
    for r in data["results"]:
        if r.get("errors"):
            lines.append(f"- {_name(r)} at concurrency {r['concurrency']}: {r['errors'][0]}")
        elif "tokens_per_s" not in r and r["concurrency"] > 1 and r["system"] == HF_ASSISTED:
            continue  # the batch-1-only note, said once below
        elif "tokens_per_s" not in r:
            lines.append(f"- {_name(r)} at concurrency {r['concurrency']}: {r.get('notes')}")
    if any(r["system"] == HF_ASSISTED and r["concurrency"] > 1 for r in data["results"]):
        lines.append("- HF assisted generation takes batch size 1 only: not run above 1.")
    for n in data.get("not_run", []):
        lines.append(f"- {n['system']} {n['setting']} at {n['level']}: not run (time limit)")
    return ["", "Not measured:", "", *lines] if lines else []


def _plot(rows: list[dict], names: list[str], levels: list[int], png: Path, data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name in names:
        points = sorted(
            (r["concurrency"], r["tokens_per_s"])
            for r in rows
            if _name(r) == name and "tokens_per_s" in r
        )
        if points:
            xs, ys = zip(*points, strict=True)
            bold = name.startswith(TANDEM) and name != f"{TANDEM} off"
            ax.plot(xs, ys, marker="o", linewidth=2.2 if bold else 1.2, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests (HF generate(): batch size)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{data['machine']['device']}, {data['label']} pair", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def _name(r: dict) -> str:
    """How a row's system and setting are named in tables and plots."""
    if r["system"] == HF_PLAIN:
        return "HF plain"
    if r["system"] == TANDEM:
        return f"{TANDEM} {r['setting']}"
    return f"{r['system']} ({r['setting']})"


def _shape(s: dict) -> str:
    return f"hidden {s['hidden']}, {s['layers']} layers, {s['heads']}/{s['kv_heads']} heads"


def _ok(r: dict) -> bool:
    return not r.get("errors")


def _verdict(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _fmt(value, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"
