"""How long the linear layers of one target forward take: torch eager (what Tandem runs,
through the Hugging Face Llama code: q/k/v and gate/up as separate F.linear calls) against
vLLM's CPU path (fused qkv and gate_up, weights prepacked once into oneDNN handles).

Run it with vLLM's interpreter, one thread, like the peers benchmark:
  OMP_NUM_THREADS=1 .venv-peers/vllm/bin/python -m bench.peers.gemm_probe bench/toy_pair/target

It prints, per number of tokens in the pass, milliseconds for all linears of one forward
(8 layers + lm_head), for both paths, and their ratio.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def shapes(config: dict) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(in, out) of every linear of one forward: HF eager, and vLLM's fused layout."""
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    eager = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)] * layers + [(h, vocab)]
    fused = [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)] * layers + [(h, vocab)]
    return eager, fused


def timed(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    from vllm import _custom_ops as ops

    torch.set_num_threads(1)
    config = json.loads((Path(sys.argv[1]) / "config.json").read_text())
    eager, fused = shapes(config)
    weights = {s: torch.randn(s[1], s[0]) / s[0] ** 0.5 for s in set(eager) | set(fused)}
    handles = {s: ops.create_onednn_mm(weights[s].t(), 32) for s in set(fused)}
    print("tokens | torch F.linear, unfused (ms) | vLLM onednn_mm, fused (ms) | ratio")
    for m in (1, 2, 3, 5, 16, 48, 80):
        xs = {k: torch.randn(m, k) for k in {s[0] for s in weights}}

        def run_eager(xs=xs) -> None:
            for s in eager:
                torch.nn.functional.linear(xs[s[0]], weights[s])

        def run_fused(xs=xs) -> None:
            for s in fused:
                ops.onednn_mm(handles[s], xs[s[0]], None)

        a, b = timed(run_eager) * 1e3, timed(run_fused) * 1e3
        print(f"{m} | {a:.2f} | {b:.2f} | {a / b:.2f}x", flush=True)


if __name__ == "__main__":
    main()
