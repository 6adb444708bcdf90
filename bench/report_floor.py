"""The section of docs/BENCHMARKS.md on a batch-1 pass against the bandwidth floor, from
bench/results/floor-shapes-*.json (`python -m bench.gpu_floor`), one row per model shape and
results file, followed by bench/results/floor_shapes_h200.md (written by hand: which code each
file measured, and what the kernels say). Files measured on anything but a CUDA GPU do not
exist: the program runs only there."""

from __future__ import annotations

import json
from pathlib import Path

FLOOR_GOAL = 1.5  # issue 10: a target pass within 1.5x of the bandwidth floor


def floor_shapes_section(results: Path) -> list[str]:
    files = sorted(results.glob("floor-shapes-*.json"))
    if not files:
        return []
    runs = [
        (path.stem.removeprefix("floor-shapes-"), json.loads(path.read_text())) for path in files
    ]
    first = runs[0][1]
    m = first["machine"]
    lines = [
        "## On a GPU (H200): a batch-1 pass against the bandwidth floor, by model size (issue 10)",
        "",
        f"Measured on {m['gpu']} (torch {m['torch']}, transformers {m['transformers']}, Python "
        f"{m['python']}) by `python -m bench.gpu_floor --shapes {' '.join(first['shapes'])}` "
        "(bench/gpu_floor.py), once per file below. Random bfloat16 weights of the published "
        "Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B architectures (their vocabulary of "
        "128,256), built on the GPU and run as the engine runs a model there: the native "
        "forward, Triton paged attention, a CUDA graph for one request of one token. A pass is "
        "`ModelRunner.forward` of one decode token at context 128 (the LM head and the host "
        "side included), median of 50, synchronised before and after; the floor is the bytes "
        "of weights a pass reads (an untied input embedding left out: a pass reads one row "
        "of it) over a measured device-to-device copy (bytes read + written); the graph replay "
        "is the body alone on the GPU (CUDA events over 50 back-to-back replays, no LM head).",
        "",
        "| run (date-time, code, round) | shape | weights read | copy bandwidth | floor | pass "
        f"| pass / floor | graph replay | replay / floor | within {FLOOR_GOAL}x? |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, data in runs:
        for shape, f in data["shapes"].items():
            replay = f["graph_replay_us"]
            lines.append(
                f"| {name} | {shape} ({f['layers']} layers) | "
                f"{f['target_weight_bytes'] / 1e9:.2f} GB | {f['copy_bandwidth_gb_s']:,.0f} GB/s "
                f"| {f['floor_us']:,.0f} us | {f['pass_median_us']:,.0f} us | "
                f"{f['pass_over_floor']:.2f}x | {replay:,.0f} us | {replay / f['floor_us']:.2f}x "
                f"| {'yes' if f['pass_over_floor'] <= FLOOR_GOAL else 'no'} |"
            )
    note = results / "floor_shapes_h200.md"
    if note.exists():
        lines += ["", note.read_text().rstrip()]
    return lines
