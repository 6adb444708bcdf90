"""KV blocks when --kv-cache-blocks is auto: `cache.memory_gb` on the CPU; on CUDA, the
`--gpu-memory-utilization` share less what loading used and the largest step's peak."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.model.inputs import SeqInput
from engine.model.runner import ModelRunner, resolve_dtype

logger = logging.getLogger(__name__)


def kv_cache_dtype(name: str, device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache holds for --kv-cache-dtype `name` (auto = the model's). Another
    dtype than the model's is for the CPU: CUDA's attention and graphs read the model's."""
    dtype = model_dtype if name == "auto" else resolve_dtype(name, device)
    if dtype != model_dtype and device.type != "cpu":
        raise ValueError(
            f"--kv-cache-dtype {name} runs on the CPU; on {device.type} the KV cache holds the "
            f"model's dtype ({str(model_dtype).removeprefix('torch.')}): use auto"
        )
    return dtype


def num_kv_blocks(
    config: EngineConfig, device: torch.device, runners: list[ModelRunner], max_model_len: int
) -> int:
    """Blocks for the pool shared by `runners` (target, then draft), all loaded already and
    none holding a pool yet."""
    block_size = config.cache.block_size
    per_block = sum(runner.kv_bytes_per_block(block_size) for runner in runners)
    if device.type != "cuda":
        return blocks_for_budget(config.cache.memory_gb * 2**30, per_block)
    tokens = config.scheduler.max_num_batched_tokens
    memory = profile_gpu_memory(device, runners, block_size, tokens, max_model_len)
    budget = gpu_kv_budget(memory, config.cache.gpu_memory_utilization)
    logger.info(
        "GPU memory: %.2f GiB total, %.2f GiB in use after loading, %.2f GiB peak activations; "
        "%.2f GiB for the KV cache",
        memory.total / 2**30,
        (memory.total - memory.free) / 2**30,
        memory.activation_peak / 2**30,
        max(budget, 0) / 2**30,
    )
    return blocks_for_budget(budget, per_block)


@dataclass(frozen=True)
class GpuMemory:
    total: int
    """Bytes on the device."""
    free: int
    """Bytes free with both models' weights loaded and torch's cached blocks released."""
    activation_peak: int
    """Bytes the largest step allocated on top of the weights and its KV (0 if not measured)."""


def gpu_kv_budget(memory: GpuMemory, utilization: float) -> float:
    """Bytes for the KV pool: our device share less what is in use and the peak activations."""
    in_use = memory.total - memory.free
    return memory.total * utilization - in_use - memory.activation_peak


def blocks_for_budget(budget: float, bytes_per_block: int) -> int:
    num_blocks = int(budget // bytes_per_block)
    if num_blocks < 1:
        raise ValueError(
            "no memory left for the KV cache: raise --gpu-memory-utilization (or cache.memory_gb "
            "on CPU), lower --max-num-batched-tokens, or use smaller models"
        )
    return num_blocks


def largest_step(num_tokens: int, max_len: int, block_size: int) -> list[SeqInput]:
    """num_tokens tokens in requests of at most max_len (a model cannot take longer ones),
    every position's logits wanted (prompt logprobs ask for that), on consecutive blocks."""
    seqs, next_block = [], 0
    for start in range(0, num_tokens, max_len):
        n = min(max_len, num_tokens - start)
        blocks = -(-n // block_size)
        table = list(range(next_block, next_block + blocks))
        seqs.append(SeqInput([0] * n, 0, table, list(range(n))))
        next_block += blocks
    return seqs


def profile_gpu_memory(
    device: torch.device,
    runners: list[ModelRunner],
    block_size: int,
    num_tokens: int,
    max_len: int,
) -> GpuMemory:
    """Run the largest step through every runner on a throwaway KV pool and measure its peak;
    call after loading, before any runner has its real pool."""
    seqs = largest_step(num_tokens, max_len, block_size)
    scratch_blocks = sum(len(seq.block_table) for seq in seqs)
    for runner in runners:
        runner.allocate_kv(scratch_blocks, block_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    for runner in runners:
        runner.forward(seqs)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before
    for runner in runners:
        runner.free_kv()
    torch.cuda.empty_cache()  # cached blocks would otherwise count as in use
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(total=total, free=free, activation_peak=activation_peak)
