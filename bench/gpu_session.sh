#!/usr/bin/env bash
# Everything a GPU session checks, in one command: the GPU-marked tests, the benchmark on the
# trained pair (bench/gpu_run.sh all) with the adaptive policy's cost model traced, and where
# a step's time goes at concurrency 1 on that pair. 426 s on an H100 (2026-11-27, one run);
# at most 120 + 360 + 90 s for its three stages, inside a 10-minute limit per command. Results land in $OUT when it is
# set, else in bench/results/gpu_session/; see bench/GPU.md for what to do with them. Then,
# on the same warm machine, bench/host_cpu_check.sh runs the CPU kernel tests on its host.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
RES=${OUT:-bench/results/gpu_session}
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
say() { echo "== $* ($(date -u +%H:%M:%S) UTC, ${SECONDS}s into this command)"; }

say "GPU-marked tests"
timeout 120 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_engine_core.py \
  tests/test_decode_graphs.py tests/test_triton_ops.py tests/test_sampler.py \
  tests/test_triton_attention.py tests/test_tree_attention.py >"$RES/pytest_gpu.log" 2>&1
echo "pytest exit $?"
tail -3 "$RES/pytest_gpu.log"

say "bench/gpu_run.sh all, the cost model traced"
rm -f "$RES/cost_trace.jsonl"
TANDEM_COST_TRACE=$RES/cost_trace.jsonl LIMIT_S=360 OUT=$RES bench/gpu_run.sh all |
  grep -v '^\[transformers\]' | tail -45

say "the adaptive policy's predictions against what was measured"
if [ -s "$RES/cost_trace.jsonl" ]; then
  "$PY" -m bench.cost_trace "$RES/cost_trace.jsonl" --skip 20 | tee "$RES/cost_trace.txt"
  gzip -f "$RES/cost_trace.jsonl"
fi

say "where a step goes at concurrency 1 (trained pair)"
timeout 90 "$PY" -m bench.gpu_step_profile --pair bench/gpu_models/trained off "draft K=2" \
  adaptive --out "$RES/step_profile.txt" 2>&1 | grep -E '^(==|   graph)|built in'
say "done"
