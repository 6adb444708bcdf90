#!/usr/bin/env bash
# Installs llama-cpp-python's OpenAI server into .venv-peers/llama-cpp-python (ignored), for
# `python -m bench.chat_bench --llama-cpp-python`. It is built from source (PyPI has no binary
# wheel of it) with the flags build_llama_server.sh gives llama.cpp's own server: AVX2 + FMA +
# AVX-512 (F, VBMI, VNNI, BF16), AMX off, not -march=native (on some virtual machines a native
# build crashes in the AMX path). About 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3.11}
VENV=.venv-peers/llama-cpp-python
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
"$VENV/bin/pip" install "llama-cpp-python[server]==$VERSION"
"$VENV/bin/python" -c "import llama_cpp.server.app; import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready in $VENV')"
