#!/usr/bin/env bash
# Regenerates every benchmark number and plot on this machine: the engine sweeps
# (bench.engine_bench), Tandem beside its peers (bench.peers), then docs/BENCHMARKS.md and
# docs/*.png (bench.report). Run it on an otherwise idle machine: every system uses
# $THREADS OpenMP threads, and a busy core slows multi-threaded torch many times over.
#   bench/run_all.sh                      # all of it, 1 thread per system (+ peers at 2)
#   SKIP_ENGINE=1 bench/run_all.sh        # peers + report only
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
THREADS=${THREADS:-1}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS TOKENIZERS_PARALLELISM=false

step() {
  local start=$SECONDS
  echo "== $* ($(date -u +%H:%M:%S) UTC)"
  "$@"
  echo "== done in $((SECONDS - start))s"
}

if [ ! -d .venv-peers/accelerate ] || [ ! -x .venv-peers/vllm/bin/python ]; then
  step bench/peers/install_peers.sh
fi
if [ -z "${SKIP_ENGINE:-}" ]; then
  step "$PY" -m bench.engine_bench k-sweep --threads "$THREADS"
  step "$PY" -m bench.engine_bench concurrency --threads "$THREADS"
fi
# Every configuration 3 times, round-robin: on a shared machine identical runs differ by 10-20%.
ROUNDS=${ROUNDS:-3}
step "$PY" -m bench.peers --threads "$THREADS" --rounds "$ROUNDS" --out bench/results/peers.json
# The same peers benchmark with 2 threads each: shown beside the headline as a ratio table.
step "$PY" -m bench.peers --threads 2 --rounds "$ROUNDS" --out bench/results/peers-2threads.json
step "$PY" -m bench.peers.profile_tandem --threads "$THREADS" --out bench/results/peers-profile.json
step "$PY" -m bench.report
