"""Summarise a cost-model trace (engine/spec/cost/trace.py): where the predictions the
draft-length policy decides on are off, and by how much.

  TANDEM_COST_TRACE=/tmp/trace.jsonl python -m bench.default_engine speed --configs adaptive
  python -m bench.cost_trace /tmp/trace.jsonl

One row per kind of observation and size: target passes by token count (1..8 each, then
powers of two), the draft's part of a step by its number of passes and the tokens it ran
(drafts, catch-ups and prompt chunks; sized alike), and the step's cost outside the passes
by batch size and whether it drafted. Each row: how many, the mean
measured and predicted milliseconds, and measured / predicted over the row (the sums' ratio,
so long observations weigh more). `--skip N` leaves out each kind's first N observations
(the start-up fit before its online scales have learned anything).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def _bucket(n: int) -> tuple[int, str]:
    """(sort key, label): 0..8 exactly, then powers of two."""
    if n <= 8:
        return n, str(n)
    top = 16
    while top < n:
        top *= 2
    return top, f"{top // 2 + 1}-{top}"


def _key(record: dict) -> tuple[int, int, int, str]:
    """(kind's order, size, branches or drafting, label) of a record's row."""
    kind = record["kind"]
    if kind == "step":
        size, label = _bucket(record["batch"])
        drafting = int(record["drafting"])
        return 2, size, drafting, f"batch {label}, {'drafting' if drafting else 'plain'}"
    branches = record["branches"]
    tree = f", {branches} branches" if branches > 1 else ""
    if kind == "target":
        size, label = _bucket(record["tokens"])
        return 0, size, branches, f"{label} tokens{tree}"
    # By the tokens the draft ran (drafts, catch-ups, prompt chunks): each kind has its own
    # price, and a misfit shows as a ratio that moves with the size.
    size, label = _bucket(record["drafts"] + record.get("fed", 0))
    passes = record["passes"]
    return 1, 1000 * passes + size, branches, f"{passes} passes, {label} tokens{tree}"


def summarise(lines: list[str], skip: int = 0) -> list[dict]:
    seen: dict[str, int] = defaultdict(int)
    rows: dict[tuple[int, int, int, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        seen[record["kind"]] += 1
        if seen[record["kind"]] <= skip:
            continue
        row = rows[_key(record)]
        row[0] += 1
        row[1] += record["measured"]
        row[2] += record["predicted"]
    kinds = ("target", "draft", "step")
    out = []
    for (kind, _, _, what), (count, measured, predicted) in sorted(rows.items()):
        out.append(
            {
                "kind": kinds[kind],
                "what": what,
                "count": count,
                "measured_ms": 1e3 * measured / count,
                "predicted_ms": 1e3 * predicted / count,
                "ratio": measured / predicted if predicted > 0 else float("nan"),
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--skip", type=int, default=0, help="each kind's first N observations")
    args = p.parse_args(argv)
    rows = summarise(args.trace.read_text().splitlines(), args.skip)
    print(
        f"{'kind':<7} {'what':<28} {'count':>6} {'measured ms':>12} {'predicted ms':>13} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['kind']:<7} {r['what']:<28} {r['count']:>6} {r['measured_ms']:>12.3f} "
            f"{r['predicted_ms']:>13.3f} {r['ratio']:>6.2f}"
        )


if __name__ == "__main__":
    main()
