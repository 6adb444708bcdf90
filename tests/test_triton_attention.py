"""The Triton paged-attention kernel against the reference path, and choosing a backend.

Without CUDA the kernel runs in Triton's interpreter: conftest.py sets TRITON_INTERPRET=1
before anything imports triton. With CUDA the kernel is compiled and the `gpu` tests check
it in bf16/fp16; the CPU tests then skip unless TRITON_INTERPRET=1 was set by hand.
"""

from __future__ import annotations

import functools

import pytest
import torch

from engine.attention.backends import BACKENDS, select_backend, triton_available
from engine.attention.paged import build_metadata
from engine.config import ATTENTION_BACKENDS, SpecConfig
from server.settings import load_settings
from tests.attention_helpers import poison_unread_slots
from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts

needs_triton = pytest.mark.skipif(
    not triton_available(),
    reason="triton is not installed (on Linux x86_64: pip install -e '.[dev]')",
)


@pytest.fixture(scope="module")
def kernel():
    from engine.attention import triton_kernel as triton_attention

    return triton_attention


@pytest.fixture
def interpreted(kernel):
    if not kernel.INTERPRETED:
        pytest.skip("the kernel is compiled for the GPU here; set TRITON_INTERPRET=1 to run it")
    return kernel


# (query_len, context_len) per request: decodes, a verification of 1 + K = 5 tokens, a prefill
# chunk in the middle of a prompt longer than the kernel's query block and the reference's
# decode group, a first prefill chunk (context == query), and contexts that span several KV
# tiles of the kernel, end mid-block, or hold one token.
BATCH = [(1, 7), (5, 12), (1, 1), (37, 70), (3, 3), (1, 66), (5, 5), (2, 33)]


def _random_case(
    block_size: int,
    group: int,
    dtype: torch.dtype,
    device: str,
    batch: list[tuple[int, int]] = BATCH,
    kv_heads: int = 2,
    head_dim: int = 24,
    seed: int = 0,
) -> dict:
    """Random caches and queries; block tables are a shuffled pool with spare blocks at the
    end of some tables (the lookahead the scheduler allocates for drafts)."""
    g = torch.Generator().manual_seed(seed)
    query_lens = [q for q, _ in batch]
    context_lens = [c for _, c in batch]
    needed = [-(-c // block_size) + (i % 2) for i, c in enumerate(context_lens)]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used : used + n])
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g).to(device, dtype)
    value_cache = torch.randn(shape, generator=g).to(device, dtype)
    query = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=g).to(device, dtype)
    return dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        query_lens=query_lens,
        context_lens=context_lens,
        tables=tables,
    )


def _attend(case: dict, backend: str, key_cache=None, value_cache=None) -> torch.Tensor:
    key_cache = case["key_cache"] if key_cache is None else key_cache
    value_cache = case["value_cache"] if value_cache is None else value_cache
    metadata = build_metadata(
        [(key_cache, value_cache)],
        key_cache.shape[1],
        case["query_lens"],
        case["context_lens"],
        case["tables"],
        key_cache.device,
        BACKENDS[backend],
    )
    scale = case["query"].shape[-1] ** -0.5
    return BACKENDS[backend].attend(case["query"], key_cache, value_cache, metadata, scale)


def _poison_unread_slots(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return poison_unread_slots(
        case["key_cache"], case["value_cache"], case["context_lens"], case["tables"]
    )


@needs_triton
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_kernel_matches_reference_on_cpu(interpreted, block_size, group):
    case = _random_case(block_size, group, torch.float32, "cpu", seed=block_size + group)
    expected = _attend(case, "reference")
    got = _attend(case, "triton")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The kernel reads only the keys each request owns: NaN anywhere else changes nothing.
    poisoned = _attend(case, "triton", *_poison_unread_slots(case))
    torch.testing.assert_close(poisoned, expected, rtol=1e-5, atol=1e-5)


def _rows_match_decodes(block_size: int, group: int, dtype: torch.dtype, device: str) -> None:
    """Each query of a verification (5 queries at positions 35..39) beside a decode of another
    request gets the bits it gets attended alone, as a decode at its position: the program's
    rows and key tiles differ between the two."""
    case = _random_case(
        block_size, group, dtype, device, batch=[(5, 40), (1, 90)], head_dim=64, seed=group
    )
    together = _attend(case, "triton")
    for j in range(5):
        alone = {
            **case,
            "query": case["query"][j : j + 1],
            "query_lens": [1],
            "context_lens": [36 + j],
            "tables": case["tables"][:1],
        }
        got = _attend(alone, "triton")[0]
        if device == "cpu" and not _numpy_rows_are_position_free():
            # Interpreted, tl.dot is numpy's matmul, and this machine's BLAS sums a row of a
            # 16-row tile in another order by where it sits in the tile (the rows of a
            # verification and of a decode sit at different places): only the kernel's
            # arithmetic can be checked here, to float32 rounding. On a GPU the bits are.
            torch.testing.assert_close(together[j], got, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(together[j], got), j


@functools.cache
def _numpy_rows_are_position_free() -> bool:
    """Whether numpy's float32 matmul, what the interpreter runs for tl.dot, gives each row of
    the kernel's tiles (16 rows by a reduction of 64 or 32) the same bits wherever it sits in
    the tile. OpenBLAS on an AVX2 AMD EPYC (Zen 3) sums rows 6-15 in another order than 0-5."""
    import numpy as np

    rng = np.random.default_rng(0)
    for k, n in ((64, 32), (32, 64)):
        a = rng.standard_normal((16, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        full = a @ b
        for i in range(16):
            if not np.array_equal((np.roll(a, -i, axis=0) @ b)[0], full[i]):
                return False
    return True


@needs_triton
@pytest.mark.parametrize("block_size,group", [(4, 1), (16, 3)])
def test_verification_rows_equal_decodes_on_cpu(interpreted, block_size, group):
    _rows_match_decodes(block_size, group, torch.float32, "cpu")


@needs_triton
def test_padded_grid_and_empty_requests_change_nothing(interpreted):
    """A fixed-shape batch (CUDA graphs) pads max_query_len and adds requests with no query
    tokens; the real tokens' output must not move and the padding must cost no writes."""
    case = _random_case(4, 2, torch.float32, "cpu", batch=[(1, 9), (5, 14), (1, 30)])
    metadata = build_metadata(
        [(case["key_cache"], case["value_cache"])],
        4,
        case["query_lens"],
        case["context_lens"],
        case["tables"],
        torch.device("cpu"),
        BACKENDS["triton"],
    )
    scale = case["query"].shape[-1] ** -0.5
    expected = _attend(case, "reference")
    num_tokens = case["query"].shape[0]
    padded_query = torch.cat([case["query"], torch.full_like(case["query"][:3], float("nan"))])
    starts = torch.cat([metadata.query_start_loc, metadata.query_start_loc[-1:].repeat(2)])
    tables = torch.cat([metadata.block_tables, torch.zeros_like(metadata.block_tables[:2])])
    contexts = torch.cat([metadata.context_lens, torch.zeros(2, dtype=torch.int32)])
    out = interpreted.paged_attention(
        padded_query, case["key_cache"], case["value_cache"], tables, starts, contexts, 8, scale
    )
    torch.testing.assert_close(out[:num_tokens], expected, rtol=1e-5, atol=1e-5)


@needs_triton
def test_triton_backend_gives_the_reference_greedy_tokens(interpreted, tiny_dirs):
    """End to end on tiny Llamas, through the interpreter: plain decoding with chunked
    prefill, then draft-model speculation (verification passes of 1 + K tokens)."""
    prompts = random_prompts([5, 17, 40], vocab=300, seed=11)
    spec = SpecConfig(
        method="draft", draft_model=str(tiny_dirs["llama_draft"]), draft_length="fixed"
    )
    for spec_config in (None, spec):
        outputs = {}
        for backend in ("reference", "triton"):
            engine = make_engine(
                tiny_dirs["llama"],
                spec=spec_config,
                max_num_batched_tokens=32,
                attention_backend=backend,
                cuda_graphs=False,  # the padded path is test_decode_graphs.py's
            )
            assert engine.runner.attention_backend is BACKENDS[backend]
            if spec_config is not None:
                assert engine.proposer.runner.attention_backend is BACKENDS[backend]
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{i}", prompt, greedy(6))
            outputs[backend] = drain(engine)
            assert (engine.stats().spec_drafted_tokens > 0) == (spec_config is not None)
        assert outputs["triton"] == outputs["reference"]


def test_backend_names_match_the_setting(tiny_dirs):
    assert set(ATTENTION_BACKENDS) == {"auto", *BACKENDS}
    model = {"TANDEM_MODEL": str(tiny_dirs["llama"])}
    assert load_settings(environ=model).engine.model.attention_backend == "auto"
    env = {**model, "TANDEM_ATTENTION_BACKEND": "reference"}
    assert load_settings(environ=env).engine.model.attention_backend == "reference"
    with pytest.raises(ValueError, match=r"\$TANDEM_ATTENTION_BACKEND must be one of auto, ref"):
        load_settings(environ={**model, "TANDEM_ATTENTION_BACKEND": "flash"})


def test_backend_selection(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_backend("auto", cpu, torch.bfloat16) == "reference"  # cpu: test_cpu_kernels
    assert select_backend("reference", cuda) == "reference"
    monkeypatch.setattr("engine.attention.backends.triton_available", lambda: True)
    assert select_backend("auto", cuda) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("triton", cpu) == "triton"
    monkeypatch.setattr("engine.attention.backends.triton_available", lambda: False)
    assert select_backend("auto", cuda) == "reference"
    with pytest.raises(ValueError, match="needs the triton package"):
        select_backend("triton", cuda)
    with pytest.raises(ValueError, match="--attention-backend must be one of"):
        select_backend("flash", cpu)


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_kernel_matches_reference_on_cuda(kernel, dtype, block_size, group, head_dim):
    case = _random_case(block_size, group, dtype, "cuda", head_dim=head_dim, seed=group)
    upcast = {
        **case,
        "query": case["query"].float(),
        "key_cache": case["key_cache"].float(),
        "value_cache": case["value_cache"].float(),
    }
    expected = _attend(upcast, "reference")
    got = _attend(case, "triton")
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    poisoned = _attend(case, "triton", *_poison_unread_slots(case))
    torch.testing.assert_close(poisoned, got, rtol=0, atol=0)


@needs_triton
@pytest.mark.gpu
def test_triton_is_the_cuda_default_and_matches_transformers_in_float32(tiny_dirs):
    model = tiny_dirs["qwen2"]
    assert make_engine(model, device="cuda").attention_backend == "triton"
    prompts = random_prompts([1, 9, 33, 64], vocab=300, seed=12)
    engine = make_engine(
        model, device="cuda", dtype="float32", attention_backend="triton", max_num_batched_tokens=48
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, greedy(12))
    outputs = drain(engine)
    assert [outputs[f"g{i}"] for i in range(len(prompts))] == hf_greedy(model, prompts, 12)


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size,group", [(4, 1), (16, 3)])
def test_verification_rows_equal_decodes_on_cuda(kernel, dtype, block_size, group):
    _rows_match_decodes(block_size, group, dtype, "cuda")
