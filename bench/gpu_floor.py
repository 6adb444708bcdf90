"""The bandwidth floor of a target pass, beside what a Tandem target pass measures.

A batch-1 decode pass reads every weight of the target once, so none is faster than weight
bytes / memory bandwidth, the bandwidth measured here by a device-to-device copy far larger than
the caches (bytes read plus written). The floor leaves out the KV cache (about 2% of the GPU
pair's weights at a few hundred tokens) and every launch and Python cost: measured / floor says
how far a pass is from the hardware's limit. As a program, it measures that on random weights
of real architectures (Llama 3.x bodies built on the GPU, never saved), since whether batch 1
is bound by bytes or by kernel latency depends on the model's size:

  python -m bench.gpu_floor --shapes 1b 3b 8b --out floor-shapes.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

from bench.hf_generate import sync
from engine.attention import paged as attention
from engine.model.inputs import SeqInput
from engine.model.runner import ModelRunner

SHAPES = {
    # name: (hidden, layers, heads, kv heads, MLP, tied embeddings), vocabulary 128,256, head 64
    # or hidden / heads: the published configs of Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B.
    "1b": (2048, 16, 32, 8, 8192, True),
    "3b": (3072, 28, 24, 8, 8192, True),
    "8b": (4096, 32, 32, 8, 14336, False),
}


def copy_bandwidth(device: torch.device, nbytes: int, copies: int = 10, repeats: int = 5) -> float:
    """Bytes per second (read + written) of `copies` back-to-back copies; best of `repeats`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):  # warm-up: first-touch page faults, clocks ramping up
        dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src)
        sync(device)
        best = min(best, (time.perf_counter() - start) / copies)
    return 2 * nbytes / best


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of weights one batch-1 pass reads: every parameter once (parameters() yields
    a tied embedding / LM head matrix once, as a pass reads it once), less an input embedding
    of its own, of which a pass reads one row."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    if embed is not model.get_output_embeddings().weight:
        total -= embed.numel() * embed.element_size()
    return total


def one_token(runner: ModelRunner, context: int) -> list[SeqInput]:
    """A batch of one request feeding one token at position `context`, on blocks 0..n."""
    return [SeqInput([0], context, list(range(context // runner.block_size + 1)), [0])]


@torch.inference_mode()
def decode_pass_seconds(runner: ModelRunner, context: int, iters: int) -> list[float]:
    """Seconds of each of `iters` one-token passes at position `context` (batch 1), the device
    synchronised around each, after 5. Writes garbage into blocks 0..n: the pool must be idle."""
    seq = one_token(runner, context)
    device = runner.device
    for _ in range(5):
        runner.forward(seq)
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        runner.forward(seq)
        sync(device)
        times.append(time.perf_counter() - start)
    return times


@torch.inference_mode()
def graph_replay_seconds(runner: ModelRunner, iters: int) -> float | None:
    """GPU seconds of one replay of the batch-1, one-token decode graph (the body without the
    LM head; CUDA events around `iters` replays after 5): the pass without its host side. None
    where no such graph was captured. Call right after decode_pass_seconds: it replays that
    pass's last inputs."""
    graphs = runner.decode_graphs
    static = graphs.batches.get((1, 1, False)) if graphs is not None else None
    if static is None or static.graph is None:
        return None
    for _ in range(5):
        static.graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(runner.device)
    start.record()
    for _ in range(iters):
        static.graph.replay()
    end.record()
    sync(runner.device)
    return start.elapsed_time(end) / 1e3 / iters


def measure_floor(runner: ModelRunner, context: int, iters: int, copy_bytes: int) -> dict:
    device = runner.device
    nbytes = weight_bytes(runner.model)
    bandwidth = copy_bandwidth(device, copy_bytes)
    passes = decode_pass_seconds(runner, context, iters)
    replay = graph_replay_seconds(runner, iters)
    floor_s = nbytes / bandwidth
    median = statistics.median(passes)
    return {
        "graph_replay_us": None if replay is None else 1e6 * replay,
        "target_weight_bytes": nbytes,
        "copy_bytes": copy_bytes,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "floor_us": 1e6 * floor_s,
        "pass_context": context,
        "pass_iters": iters,
        "pass_median_us": 1e6 * median,
        "pass_min_us": 1e6 * min(passes),
        "pass_over_floor": median / floor_s,
    }


def random_runner(shape: str, device: torch.device, context: int, workdir: Path) -> ModelRunner:
    """A runner as the engine builds one on CUDA (bfloat16, native forward, Triton attention,
    decode graphs for one request of one token) on random weights of `shape`."""
    hidden, layers, heads, kv_heads, mlp, tied = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=128_256,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context + 64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=tied,
    )
    config.save_pretrained(workdir)
    # Built in float32 and cast, as a saved checkpoint is: the rotary inverse frequencies
    # stay what float32 arithmetic makes them.
    attention.register()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention.ATTN_IMPLEMENTATION
        ).to(torch.bfloat16)
    runner = ModelRunner(str(workdir), device, torch.bfloat16, "triton", model=model)
    block = 16
    runner.allocate_kv(context // block + 2, block)
    if not runner.enable_decode_graphs(1, 1, context + 2 * block):
        raise RuntimeError("decode graphs could not be enabled")
    return runner


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--context", type=int, default=128, help="the pass's position")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--copy-mb", type=int, default=4096)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    data = {
        "kind": "gpu_floor_shapes",
        "command": "python -m bench.gpu_floor " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {
            "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "shapes": {},
    }
    for shape in args.shapes:
        with tempfile.TemporaryDirectory() as tmp:
            began = time.perf_counter()
            runner = random_runner(shape, device, args.context, Path(tmp))
            built = time.perf_counter() - began
            row = measure_floor(runner, args.context, args.iters, args.copy_mb * 2**20)
            row |= {
                "layers": SHAPES[shape][1],
                "model_impl": runner.model_impl,
                "kernels": runner.kernels,
                "build_s": built,
            }
            data["shapes"][shape] = row
            print(
                f"{shape}: {row['target_weight_bytes'] / 1e9:.2f} GB, floor {row['floor_us']:.0f} us "
                f"at {row['copy_bandwidth_gb_s']:,.0f} GB/s; pass {row['pass_median_us']:.0f} us "
                f"({row['pass_over_floor']:.2f}x), graph replay {row['graph_replay_us']:.0f} us "
                f"({row['graph_replay_us'] / row['floor_us']:.2f}x)",
                flush=True,
            )
            del runner
            torch.cuda.empty_cache()
        if args.out:
            args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
