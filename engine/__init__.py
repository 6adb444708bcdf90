"""Tandem's engine: continuous batching with lossless speculative decoding over a paged KV
cache. This module is its public API; the server imports nothing else from `engine`
(docs/ARCHITECTURE.md maps the packages). Names load on first use, so reading the
configuration (`tandem --help`) does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncEngine": "engine.core.async_engine",
    "EngineClient": "engine.core.client",
    "LLMEngine": "engine.core.engine",
    "QueueFullError": "engine.core.engine",
    "InvalidRequest": "engine.types.request",
    "check_request": "engine.types.validation",
    "SamplingParams": "engine.types.request",
    "GrammarSpec": "engine.types.request",
    "JSON_STYLE": "engine.types.request",
    "RequestOutput": "engine.types.outputs",
    "TokenLogprob": "engine.types.outputs",
    "EngineStats": "engine.types.stats",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "CacheConfig": "engine.config",
    "SchedulerConfig": "engine.config",
    "SpecConfig": "engine.config",
    "ATTENTION_BACKENDS": "engine.config",
    "DEVICES": "engine.config",
    "DRAFT_LENGTH_POLICIES": "engine.config",
    "DTYPES": "engine.config",
    "KV_CACHE_DTYPES": "engine.config",
    "MODEL_IMPLS": "engine.config",
    "QUANTIZATIONS": "engine.config",
    "CPU_ACTIVATIONS": "engine.config",
    "CPU_ATTENTION": "engine.config",
    "SPEC_METHODS": "engine.config",
    "VERIFICATIONS": "engine.config",
    "TREE_DRAFTS": "engine.config",
    "PACKAGE_SCHEME": "engine.model.files",
    "check_model_path": "engine.model.files",
    "default_served_name": "engine.model.files",
    "prepare_config": "engine.model.files",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from engine.config import (
        ATTENTION_BACKENDS,
        CPU_ACTIVATIONS,
        CPU_ATTENTION,
        DEVICES,
        DRAFT_LENGTH_POLICIES,
        DTYPES,
        KV_CACHE_DTYPES,
        MODEL_IMPLS,
        QUANTIZATIONS,
        SPEC_METHODS,
        TREE_DRAFTS,
        VERIFICATIONS,
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
        SpecConfig,
    )
    from engine.core.async_engine import AsyncEngine
    from engine.core.client import EngineClient
    from engine.core.engine import LLMEngine, QueueFullError
    from engine.model.files import (
        PACKAGE_SCHEME,
        check_model_path,
        default_served_name,
        prepare_config,
    )
    from engine.types.outputs import RequestOutput, TokenLogprob
    from engine.types.request import JSON_STYLE, GrammarSpec, InvalidRequest, SamplingParams
    from engine.types.stats import EngineStats
    from engine.types.validation import check_request


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
