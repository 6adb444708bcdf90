"""Sizing the KV pool from --gpu-memory-utilization, with the GPU's memory numbers mocked."""

from __future__ import annotations

import pytest
import torch

from engine.config import SpecConfig
from engine.core.kv_budget import (
    GpuMemory,
    blocks_for_budget,
    gpu_kv_budget,
    largest_step,
    num_kv_blocks,
    profile_gpu_memory,
)
from engine.model.runner import ModelRunner
from tests.engine_utils import make_engine

GiB = 2**30


def test_budget_is_our_share_less_what_is_in_use_and_the_peak_activations():
    # 80 GiB device; weights of both models, the CUDA context and another process use 18 GiB.
    memory = GpuMemory(total=80 * GiB, free=62 * GiB, activation_peak=3 * GiB)
    assert gpu_kv_budget(memory, 0.9) == pytest.approx(51 * GiB)
    assert blocks_for_budget(51 * GiB, 2 * 2**20) == 51 * 512
    assert gpu_kv_budget(memory, 0.25) < 0  # the share is already used up
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        blocks_for_budget(gpu_kv_budget(memory, 0.25), 2 * 2**20)


def test_largest_step_splits_into_requests_the_model_can_take():
    seqs = largest_step(num_tokens=512, max_len=200, block_size=16)
    assert [len(s.token_ids) for s in seqs] == [200, 200, 112]
    assert all(s.logit_offsets == list(range(len(s.token_ids))) for s in seqs)
    blocks = [b for s in seqs for b in s.block_table]
    assert blocks == list(range(13 + 13 + 7))  # disjoint, each just long enough


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's memory probes replaced by a script; returns the log of calls."""
    log: list[str] = []

    def probe(name, value=None):
        def fn(*args, **kwargs):
            log.append(name)
            return value

        monkeypatch.setattr(torch.cuda, name, fn)

    probe("synchronize")
    probe("reset_peak_memory_stats")
    probe("empty_cache")
    probe("memory_allocated", 10 * GiB)
    probe("max_memory_allocated", 13 * GiB)
    probe("mem_get_info", (60 * GiB, 80 * GiB))
    return log


def test_profile_runs_every_model_on_a_scratch_pool_and_measures_around_it(
    fake_cuda, tiny_dirs, monkeypatch
):
    runners = [
        ModelRunner(str(tiny_dirs[name]), torch.device("cpu"), torch.float32)
        for name in ("llama", "llama_draft")
    ]
    forwarded = []
    for name, runner in zip(("target", "draft"), runners, strict=True):

        def forward(seqs, runner=runner, name=name, original=runner.forward, **kwargs):
            assert runner.kv_caches, "the scratch pool is allocated before the forward"
            fake_cuda.append(f"forward {name}")
            forwarded.append(sum(len(s.token_ids) for s in seqs))
            return original(seqs, **kwargs)

        monkeypatch.setattr(runner, "forward", forward)

    memory = profile_gpu_memory(torch.device("cuda"), runners, 4, 48, 20)
    assert memory == GpuMemory(total=80 * GiB, free=60 * GiB, activation_peak=3 * GiB)
    assert forwarded == [48, 48]
    assert all(r.kv_caches == [] for r in runners)  # released before free memory is read
    measured = [e for e in fake_cuda if e != "synchronize"]
    assert measured == [
        "reset_peak_memory_stats",
        "memory_allocated",
        "forward target",
        "forward draft",
        "max_memory_allocated",
        "empty_cache",
        "mem_get_info",
    ]


def test_engine_sizes_the_pool_for_both_models(tiny_dirs, monkeypatch):
    spec = SpecConfig(method="draft", draft_model=str(tiny_dirs["llama_draft"]))
    engine = make_engine(tiny_dirs["llama"], spec=spec, max_num_batched_tokens=64)
    assert engine.runners == [engine.runner, engine.proposer.runner]
    profiled = []

    def fake_profile(device, runners, block_size, num_tokens, max_len):
        profiled.append((runners, block_size, num_tokens, max_len))
        return GpuMemory(total=80 * GiB, free=62 * GiB, activation_peak=3 * GiB)

    monkeypatch.setattr("engine.core.kv_budget.profile_gpu_memory", fake_profile)
    runners, config = engine.runners, engine.config
    per_block = sum(r.kv_bytes_per_block(config.cache.block_size) for r in runners)
    assert per_block > engine.runner.kv_bytes_per_block(config.cache.block_size)
    blocks = num_kv_blocks(config, torch.device("cuda"), runners, 200)
    assert blocks == int(51 * GiB // per_block)
    assert profiled == [(runners, config.cache.block_size, 64, 200)]
    # On the CPU the budget is cache.memory_gb, and nothing is profiled.
    assert num_kv_blocks(config, torch.device("cpu"), runners, 200) == GiB // per_block
    assert len(profiled) == 1
