#!/usr/bin/env bash
# The CPU kernel tests on another machine's CPU, in one command: a GPU session's host is an
# Intel Xeon with AVX-512 (VNNI, BF16) and AMX, code paths a 2-core AVX2 development machine
# never runs. Sized for a second call on the warm GPU machine after bench/gpu_session.sh
# (LIMIT_S seconds of tests, default 240). The GGUF tests need the `gguf` package: where it
# is missing, carry its wheel in .whl/ (bench/GPU.md says how); they skip without it.
# Results land in $OUT when it is set, else in bench/results/host_cpu/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
RES=${OUT:-bench/results/host_cpu}
mkdir -p "$RES"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/host_site .whl/*.whl &&
    export PYTHONPATH=/tmp/host_site
fi
# The tests' Triton kernels on CPU tensors run in Triton's interpreter, as they do in CI (a
# machine with CUDA would otherwise compile them for the GPU).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRITON_INTERPRET=1
lscpu | grep -E "Model name|^CPU\(s\)"
grep -o -w -E "avx512(f|_vnni|_bf16|vbmi)|amx_(tile|bf16|int8)" /proc/cpuinfo | sort -u | tr '\n' ' '
echo
"${CC:-cc}" --version | head -1
"$PY" -c "import sys; sys.path.insert(0, '.'); from engine.cpu import kernels; print('kernels', kernels.isa())"
timeout "${LIMIT_S:-240}" "$PY" -m pytest -q -p no:cacheprovider -rfs tests/test_cpu_kernels.py \
  tests/test_gguf_linear.py tests/test_cpu_linear.py tests/test_kv_cache_dtype.py \
  >"$RES/pytest_host_cpu.log" 2>&1
echo "pytest exit $? (124: stopped at LIMIT_S)"
grep -E "^(FAILED|ERROR)|passed|failed" "$RES/pytest_host_cpu.log" | tail -15
