"""Two commits through the chat benchmark, alternated, for changes smaller than the machine's
drift.

  python -m bench.paired BASE                    # HEAD against BASE, 3 pairs, off at c=1 T=0
  python -m bench.paired BASE --head REV --pairs 4 -- --configs draft-adaptive --levels 16 \\
      --requests 48 --temperatures 0.7

On a small shared machine the speed of the same code moves by 10-30% between runs minutes
apart (docs/BENCHMARKS.md), more than most single changes. This runs `bench.chat_bench` from
a checkout of each commit (git worktrees in a temporary folder, removed afterwards), one
after the other, --pairs times, with the arguments after `--` (by default speculation off,
16 requests at c=1, greedy), and prints each run's output tokens/s and the share of its wall
time outside engine steps, then each pair's ratio. The order within a pair alternates, so a
trend over the session does not favour one side. Your checkout is not touched: each side's
servers write their logs into their own worktree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARGS = ["--configs", "off", "--levels", "1", "--requests", "16", "--temperatures", "0"]


def summarize(runs: dict[str, list[list[dict]]], labels: tuple[str, str]) -> list[str]:
    """Lines for each pair: per side the rows' tok/s and outside-steps share, then the ratio
    of the first label's tok/s to the second's (per row key), and the median ratio."""
    first, second = labels
    lines, ratios = [], []
    for i, (a_rows, b_rows) in enumerate(zip(runs[first], runs[second], strict=True)):
        b_by_key = {_key(r): r for r in b_rows}
        for a in a_rows:
            b = b_by_key[_key(a)]
            ratio = a["tokens_per_s"] / b["tokens_per_s"]
            ratios.append(ratio)
            lines.append(
                f"pair {i + 1} {_key(a)}: {first} {_brief(a)} | {second} {_brief(b)} | "
                f"{first}/{second} {ratio:.3f}"
            )
    if ratios:
        lines.append(
            f"median {first}/{second}: {statistics.median(ratios):.3f} over {len(ratios)} "
            f"pairs (range {min(ratios):.3f}-{max(ratios):.3f})"
        )
    return lines


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this command's arguments, bench.chat_bench's: those after `--`)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def _key(row: dict) -> str:
    return f"{row['config']} c={row['concurrency']} T={row['temperature']:g}"


def _brief(row: dict) -> str:
    outside = row.get("time_split", {}).get("outside_steps")
    share = "" if outside is None else f", {outside:.0%} outside steps"
    return f"{row['tokens_per_s']:.1f} tok/s{share}"


def _rev(rev: str) -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = split_argv(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("base", help="the commit to compare against")
    p.add_argument("--head", default="HEAD", help="the commit under test (default HEAD)")
    p.add_argument("--pairs", type=int, default=3)
    args = p.parse_args(ours)
    labels = (_rev(args.head), _rev(args.base))
    bench_args = bench_args or DEFAULT_ARGS
    runs: dict[str, list[list[dict]]] = {label: [] for label in labels}
    with tempfile.TemporaryDirectory(prefix="tandem-paired-") as tmp:
        trees = {label: Path(tmp) / label for label in labels}
        for label, tree in trees.items():
            subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), label],
                           cwd=ROOT, check=True)  # fmt: skip
        try:
            for i in range(args.pairs):
                order = labels if i % 2 == 0 else labels[::-1]
                for label in order:
                    out = Path(tmp) / f"{label}-{i}.json"
                    command = [sys.executable, "-m", "bench.chat_bench", *bench_args,
                               "--out", str(out)]  # fmt: skip
                    print(f"== pair {i + 1}, {label}: {' '.join(command[1:])}", flush=True)
                    subprocess.run(command, cwd=trees[label], check=True)
                    runs[label].append(json.loads(out.read_text())["rows"])
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    print("\n".join(summarize(runs, labels)))


if __name__ == "__main__":
    main()
