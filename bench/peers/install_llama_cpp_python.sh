#!/usr/bin/env bash
# Installs llama-cpp-python's OpenAI server into .venv-peers/llama-cpp-python (ignored), for
# `python -m bench.chat_bench --llama-cpp-python`. It is built from source (PyPI has no binary
# wheel of it) with the flags build_llama_server.sh gives llama.cpp's own server
# (llama_cpp_flags.sh: AVX2, plus AVX-512 where the CPU has it; AMX off). About 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3.11}
VENV=.venv-peers/llama-cpp-python
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
source bench/peers/llama_cpp_flags.sh
CMAKE_ARGS=$(echo $LLAMA_CPP_CPU_FLAGS)  # one line: pip hands it on as one string
export CMAKE_ARGS
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
"$VENV/bin/pip" install "llama-cpp-python[server]==$VERSION"
"$VENV/bin/python" -c "import llama_cpp.server.app; import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready in $VENV')"
