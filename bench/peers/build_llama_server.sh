#!/usr/bin/env bash
# Builds llama.cpp's own server, `llama-server`, into .venv-peers/llama.cpp/bin (ignored), for
# `python -m bench.chat_bench --llama-server .venv-peers/llama.cpp/bin/llama-server`.
#
# The source is the llama.cpp tree that llama-cpp-python's source distribution carries
# (vendor/llama.cpp), fetched from PyPI like every other dependency. Built for AVX2 + FMA, plus
# AVX-512 (F, VBMI, VNNI, BF16) where this CPU has it, with AMX off, not -march=native: on
# some virtual machines a native build crashes in the AMX path (llama_cpp_flags.sh). Build it
# on the machine that runs the benchmark, and say which beside any figure measured with it.
# About 5 minutes on 2 cores.
#
# It then exports Tandem's draft (models/draft) to .venv-peers/llama.cpp/draft-q8_0.gguf with the
# same tree's convert_hf_to_gguf.py, for llama-server's own draft-model speculation
# (`python -m bench.chat_bench --llama-server ... --llama-draft ...`). The converter imports
# sentencepiece, which the project does not need: it goes into .venv-peers/llama.cpp/pydeps,
# on PYTHONPATH for the converter only.
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
WORK=.venv-peers/llama.cpp
mkdir -p "$WORK"
if [ ! -d "$WORK/src/vendor/llama.cpp" ]; then
  .venv/bin/pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
  mkdir -p "$WORK/src"
  tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK/src" --strip-components=1
fi
source bench/peers/llama_cpp_flags.sh
# shellcheck disable=SC2086  # the flags are words
cmake -S "$WORK/src/vendor/llama.cpp" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
  $LLAMA_CPP_CPU_FLAGS -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
cmake --build "$WORK/build" --target llama-server -j "$(nproc)"
mkdir -p "$WORK/bin"
ln -sf "$(pwd)/$WORK/build/bin/llama-server" "$WORK/bin/llama-server"
"$WORK/bin/llama-server" --version
.venv/bin/pip install --no-deps --target "$WORK/pydeps" sentencepiece
PYTHONPATH="$WORK/pydeps" .venv/bin/python "$WORK/src/vendor/llama.cpp/convert_hf_to_gguf.py" \
  models/draft --outtype q8_0 --outfile "$WORK/draft-q8_0.gguf"
