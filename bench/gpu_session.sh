#!/usr/bin/env bash
# Everything a GPU session checks, in one command: the GPU-marked tests, the CPU kernel tests
# on the GPU machine's host CPU (an Intel Xeon with AVX-512 and AMX: bench/host_cpu_check.sh),
# that CPU's GGUF linears on 2 cores (float32, VNNI, AMX), and the benchmark on the trained
# pair at concurrency 1 and 16 (bench/gpu_run.sh all --levels 1 16) with the adaptive policy's
# cost model traced (engine/spec/cost/trace.py). It fits a 10-minute limit per command; each
# stage has a limit of its own. Results (8 files)
# land in $OUT when it is set, else in bench/results/gpu_session/; see bench/GPU.md for what
# to do with them. Carry the `gguf` wheel in .whl/ for the host's GGUF tests (bench/GPU.md
# says how).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
RES=${OUT:-bench/results/gpu_session}
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
say() { echo "== $* ($(date -u +%H:%M:%S) UTC, ${SECONDS}s into this command)"; }
nvidia-smi -L
git log --oneline -1 2>/dev/null

say "GPU-marked tests"
timeout 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rfs tests/test_engine_core.py \
  tests/test_decode_graphs.py tests/test_triton_ops.py tests/test_sampler.py \
  tests/test_triton_attention.py tests/test_tree_attention.py >"$RES/pytest_gpu.log" 2>&1
echo "pytest exit $?"
grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$RES/pytest_gpu.log" | tail -8

say "the CPU kernel tests on the host CPU"
LIMIT_S=190 OUT=$RES bash bench/host_cpu_check.sh

say "the host CPU's GGUF linears on 2 cores"
(
  [ -d /tmp/host_site ] && export PYTHONPATH=/tmp/host_site:.
  timeout 60 taskset -c 0,1 "$PY" -m bench.cpu_kernels gguf --rows 1 2 4 8 16 32 --threads 2 \
    2>&1 | tail -9 | tee "$RES/gguf_kernels_host.txt"
)

say "bench/gpu_run.sh all at concurrency 1 and 16, the cost model traced"
rm -f "$RES/cost_trace.jsonl"
TANDEM_COST_TRACE=$RES/cost_trace.jsonl LIMIT_S=$((555 - SECONDS)) OUT=$RES \
  bench/gpu_run.sh all --levels 1 16 | grep -v '^\[transformers\]' | grep -v ' loss ' | tail -32
[ -s "$RES/cost_trace.jsonl" ] && gzip -f "$RES/cost_trace.jsonl"
say "done"
