#!/usr/bin/env bash
# The GPU benchmark in one command per stage; see bench/GPU.md for what each measures and
# how long it should take. Run from anywhere; results land in $OUT when it is set (the
# device tool's folder that comes back), else in bench/results/.
#
#   bench/gpu_run.sh all       # train the pair (unless bench/gpu_models/trained has one) + bench
#   bench/gpu_run.sh train     # only train bench/gpu_models/trained
#   bench/gpu_run.sh bench     # only bench the trained pair, resuming an earlier run on it
#   bench/gpu_run.sh random    # random-weight pair, step times only: Tandem off + HF plain
#
# Extra arguments go to bench.gpu_bench (e.g. --levels 1 2 4). Environment: PY (python,
# default python3), DEVICE (auto|cuda|cpu), TINY=1 (toy scale on the CPU: a smoke test of
# this script), LIMIT_S (seconds this command may take, default 540: the device tool stops
# a command at 600).
set -euo pipefail
cd "$(dirname "$0")/.."
stage=${1:-all}
shift || true
PY=${PY:-python3}
DEVICE=${DEVICE:-auto}
LIMIT_S=${LIMIT_S:-540}
RES=${OUT:-bench/results}
MODELS=bench/gpu_models
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$RES" bench/results "$MODELS"
exec > >(tee -a "$RES/gpu_run_$stage.log") 2>&1

pair_args=(--device "$DEVICE")
bench_args=(--device "$DEVICE")
if [ -n "${TINY:-}" ]; then
  pair_args+=(--tiny --max-steps 5)
  bench_args+=(--levels 1 2 --max-tokens 6 --min-prompt 16 --max-prompt 32 --min-requests 2
    --check-prompts 2 --floor-iters 5 --copy-mb 16 --max-num-batched-tokens 256)
fi

say() { echo "== $* ($(date -u +%H:%M:%S) UTC, ${SECONDS}s into this command)"; }

make_pair() {  # $1 = trained|random
  local dir=$MODELS/$1
  if [ -f "$dir/pair.json" ]; then
    say "reusing $dir (delete it to train again)"
  else
    say "making the $1 pair in $dir"
    local extra=()
    [ "$1" = random ] && extra=(--random)
    "$PY" -m bench.gpu_pair --out "$dir" "${pair_args[@]}" "${extra[@]}"
  fi
  cp "$dir/pair.json" "$RES/pair_$1.json"
}

run_bench() {  # $1 = trained|random, then extra gpu_bench arguments
  local label=$1
  shift
  # Partial results live beside the pair they measured (both only on this machine), so a
  # later command on the same machine resumes, and a fresh machine starts afresh.
  local out=$RES/gpu_$label.json kept=$MODELS/$label/results.json resume=()
  [ -f "$kept" ] && resume=(--resume "$kept")
  local left=$((LIMIT_S - SECONDS - 15))
  if [ "$left" -lt 60 ]; then
    say "only ${left}s left: run 'bench/gpu_run.sh bench' next, on this machine"
    return 0
  fi
  say "benchmarking the $label pair, ${left}s left for it"
  "$PY" -m bench.gpu_bench --pair "$MODELS/$label" --out "$out" --time-limit-s "$left" \
    "${resume[@]}" "${bench_args[@]}" "$@"
  cp "$out" "$kept"
}

case "$stage" in
  all) make_pair trained && run_bench trained "$@" ;;
  train) make_pair trained ;;
  bench) run_bench trained "$@" ;;
  random) make_pair random && run_bench random --only off --systems tandem hf-plain "$@" ;;
  *) echo "unknown stage $stage: all | train | bench | random" >&2; exit 2 ;;
esac
say "done"
