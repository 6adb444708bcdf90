#!/usr/bin/env bash
# One install path for `make`, CI and the Dockerfile.
#   scripts/install.sh VENV [runtime|dev]
# torch is pinned and installed first so the wider range in pyproject.toml is already satisfied
# and pip does not pull a different (CUDA) build. Set TORCH_SPEC to override, e.g. on a GPU host.
set -euo pipefail
venv=${1:-.venv}
extras=${2:-runtime}
python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  "${pip[@]}" install -q "$torch_spec"
fi
if [ "$extras" = dev ]; then
  "${pip[@]}" install -q -e ".[dev]"
else
  "${pip[@]}" install -q -e .
fi
