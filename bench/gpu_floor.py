"""The bandwidth floor of a target pass, beside what a Tandem target pass measures.

At batch 1 a decode pass must read every weight of the target once, so no pass can be
faster than weight bytes / memory bandwidth. The bandwidth is measured here, not taken from
a data sheet: a device-to-device copy of a buffer much larger than the caches, counting
bytes read plus bytes written, which is what the memory system moves in that time. The
floor leaves out the KV cache a pass also reads (at a few hundred tokens of context, about
2% of the weights of the GPU pair) and every kernel-launch and Python cost, which is the
point: the ratio measured / floor says how far a pass is from the hardware's limit.
"""

from __future__ import annotations

import statistics
import time

import torch

from engine.model.inputs import SeqInput
from engine.model.runner import ModelRunner


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    # parameters() yields a tied embedding / lm_head matrix once, as a pass reads it once.
    return sum(p.numel() * p.element_size() for p in model.parameters())


@torch.inference_mode()
def decode_pass_seconds(runner: ModelRunner, context: int, iters: int) -> list[float]:
    """Seconds of each of `iters` one-token passes at position `context` (batch 1), timed
    with the device synchronised before and after each, after a warm-up of 5.

    Needs the runner's KV pool idle: it writes a garbage key/value into blocks 0..n, as the
    engine's own cost-model calibration does.
    """
    table = list(range(context // runner.block_size + 1))
    seq = [SeqInput([0], context, table, [0])]
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
    """GPU seconds of one replay of the batch-1, one-token decode graph (the model body
    without the LM head), timed with CUDA events over `iters` back-to-back replays: the
    pass without its host side. None where no such graph was captured (CPU, graphs off).

    Call right after decode_pass_seconds: the graph replays that pass's last inputs."""
    graphs = runner.decode_graphs
    static = graphs.batches.get((1, 1, False)) if graphs is not None else None
    if static is None or static.graph is None:
        return None
    return replay_seconds(static.graph, runner.device, iters)


def replay_seconds(graph: torch.cuda.CUDAGraph, device: torch.device, iters: int) -> float:
    """GPU seconds of one replay of a captured `graph`: CUDA events around `iters`
    back-to-back replays, after 5 to warm up."""
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(device)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    sync(device)
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
