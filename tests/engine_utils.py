"""Helpers shared by the engine tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from engine.core.engine import LLMEngine
from engine.model.quantization import round_weights
from engine.types.request import SamplingParams


def make_engine(
    model: Path,
    *,
    spec: SpecConfig | None = None,
    block_size: int = 4,
    num_blocks: int = 256,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 128,
    prefix_caching: bool = True,
    max_waiting: int = 1024,
    device: str = "cpu",
    dtype: str = "auto",
    attention_backend: str = "auto",
    cuda_graphs: bool = True,
    cpu_packed_linear: bool = True,
    model_impl: str = "auto",
    cpu_bind: bool = True,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
    cpu_activations: str = "float32",
    cpu_attention: str = "float32",
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(
                model=str(model),
                device=device,
                dtype=dtype,
                attention_backend=attention_backend,
                cuda_graphs=cuda_graphs,
                cpu_packed_linear=cpu_packed_linear,
                model_impl=model_impl,
                cpu_bind=cpu_bind,
                cpu_activations=cpu_activations,
                cpu_attention=cpu_attention,
                quantization=quantization,
            ),
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=prefix_caching,
                kv_cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_waiting=max_waiting,
            ),
            spec=spec or SpecConfig(method="off"),
        )
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def drain(engine: LLMEngine, outputs: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Step until idle, checking the pool after every step; return tokens per request."""
    outputs = {} if outputs is None else outputs
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_invariants()
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return outputs


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_tokens: int,
    quantization: str = "none",
    logit_bias: tuple[tuple[int, float], ...] = (),
) -> list[list[int]]:
    """The reference: transformers' own generate(), greedy, no EOS stop, on the weights
    `--quantization` serves; `logit_bias` through its `sequence_bias` (one-token sequences)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    round_weights(model, quantization)
    bias = {"sequence_bias": [[[t], b] for t, b in logit_bias]} if logit_bias else {}
    results = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **bias,
        )
        results.append(out[0, len(prompt) :].tolist())
    return results
