from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported, and torch imports it as a side effect
# once transformers loads a model, so the choice is made here, before any test module imports
# the engine: without CUDA the Triton attention kernel runs in the interpreter. (Importing
# torch itself does not import triton.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny_models import DRAFT_SHAPE, build_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _float32_kernels():
    """The kernels' --cpu-activations mode is process-wide, and each runner sets its own
    before its passes: a test that calls the kernels itself starts from float32."""
    from engine.cpu import kernels as cpu_kernels

    if cpu_kernels.activations() != "float32":
        cpu_kernels.use_activations("float32")
    yield


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny random models sharing one tokenizer: two Llamas, a Qwen2 (GQA), a Mistral."""
    root = tmp_path_factory.mktemp("tiny")
    target = build_model(root / "llama", "llama", seed=0)
    return {
        "llama": target,
        "llama_draft": build_model(
            root / "llama_draft", "llama", seed=1, tokenizer_dir=target, **DRAFT_SHAPE
        ),
        "qwen2": build_model(root / "qwen2", "qwen2", seed=2, tokenizer_dir=target),
        "mistral": build_model(root / "mistral", "mistral", seed=3, tokenizer_dir=target),
    }


@pytest.fixture(scope="session")
def tiny_vocab_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A target and a draft over a 4-token vocabulary (tests/test_speculative.py VOCAB): few
    enough continuations to test sampled output against its exact distribution."""
    root = tmp_path_factory.mktemp("vocab4")
    kw = {"vocab_size": 4, "max_positions": 32}
    target = build_model(root / "target", seed=21, **kw)
    draft = build_model(root / "draft", seed=22, hidden_size=32, num_layers=1, **kw)
    return target, draft
