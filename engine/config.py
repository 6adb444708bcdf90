"""Frozen engine configuration, validated once at construction (each `ValueError` names the
flag); each field's meaning is its option's help (server/options.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
SPEC_METHODS = ("draft", "ngram", "suffix", "off")
DRAFT_LENGTH_POLICIES = ("adaptive", "fixed")
TREE_DRAFTS = ("sampled", "top")
AUTO_BRANCHES = 4  # the most draft-tree branches --draft-branches auto considers
VERIFICATIONS = ("block", "token")  # rejection_sample's `method`
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "triton")  # attention/backends.py + auto
MODEL_IMPLS = ("auto", "native", "transformers")  # model/native MODEL_IMPLS
QUANTIZATIONS = ("none", "bf16", "int8", "int4")
CPU_ACTIVATIONS = ("auto", "float32", "int8")  # engine/cpu/kernels.py ACTIVATIONS
CPU_ATTENTION = ("auto", "float32", "bfloat16")  # engine/cpu/csrc/attention_pairs.c
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, f"{flag} must be one of {', '.join(allowed)} (got {value!r})")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    model_impl: str = "auto"
    cpu_packed_linear: bool = True
    gguf_blocks: bool = True
    quantization: str = "none"
    cache_dir: str | None = None
    cpu_bind: bool = True
    cpu_activations: str = "auto"
    cpu_attention: str = "auto"

    def __post_init__(self) -> None:
        _check(bool(self.model), "--model must name a model directory or GGUF file")
        _check_choice("--dtype", self.dtype, DTYPES)
        _check_choice("--device", self.device, DEVICES)
        _check_choice("--attention-backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("--model-impl", self.model_impl, MODEL_IMPLS)
        _check_choice("--quantization", self.quantization, QUANTIZATIONS)
        _check_choice("--cpu-activations", self.cpu_activations, CPU_ACTIVATIONS)
        _check_choice("--cpu-attention", self.cpu_attention, CPU_ATTENTION)
        _check(
            self.quantization == "none" or not self.model.endswith(".gguf"),
            f"--quantization {self.quantization} applies to Hugging Face checkpoints: a .gguf "
            "model is served on its own quantized weights",
        )
        _check(
            self.max_model_len is None or self.max_model_len >= 2,
            f"--max-model-len must be at least 2 (got {self.max_model_len})",
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None
    memory_gb: float = 1.0
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check_choice("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check(
            1 <= self.block_size <= 256,
            f"--block-size must be between 1 and 256 (got {self.block_size})",
        )
        _check(
            self.num_blocks is None or self.num_blocks >= 1,
            f"--kv-cache-blocks must be at least 1 (got {self.num_blocks})",
        )
        _check(self.memory_gb > 0, f"cache.memory_gb must be positive (got {self.memory_gb})")
        _check(
            0 < self.gpu_memory_utilization <= 1,
            f"--gpu-memory-utilization must be in (0, 1] (got {self.gpu_memory_utilization})",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_waiting: int = 1024

    def __post_init__(self) -> None:
        _check(
            self.max_num_seqs >= 1, f"--max-num-seqs must be at least 1 (got {self.max_num_seqs})"
        )
        _check(
            self.max_num_batched_tokens >= 16,
            f"--max-num-batched-tokens must be at least 16 (got {self.max_num_batched_tokens})",
        )
        _check(self.max_waiting >= 0, f"--max-waiting must be >= 0 (got {self.max_waiting})")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "draft"
    draft_model: str | None = None
    max_draft_tokens: int = 4
    draft_length: str = "adaptive"
    ngram_max: int = 16
    ngram_min: int = 1
    ngram_assist: int = 0
    suffix_max_depth: int = 24
    suffix_cache_tokens: int = 10_000
    recalibrate: bool = False
    draft_branches: int | None = 1
    tree_drafts: str = "top"
    verification: str = "block"
    draft_quantization: str = "auto"
    max_request_slowdown: float | None = 0.03

    def __post_init__(self) -> None:
        _check_choice("--speculative-method", self.method, SPEC_METHODS)
        _check_choice("--draft-length", self.draft_length, DRAFT_LENGTH_POLICIES)
        _check_choice("--verification", self.verification, VERIFICATIONS)
        _check_choice("--tree-drafts", self.tree_drafts, TREE_DRAFTS)
        _check_choice("--draft-quantization", self.draft_quantization, ("auto", *QUANTIZATIONS))
        _check(
            self.draft_branches is None or 1 <= self.draft_branches <= 8,
            f"--draft-branches must be auto or between 1 and 8 (got {self.draft_branches})",
        )
        _check(
            (self.draft_branches or 1) * self.max_draft_tokens < 63,
            "--draft-branches x --max-draft-tokens must stay below 63 (a tree's nodes)",
        )
        _check(
            0 <= self.max_draft_tokens <= 16,
            f"--max-draft-tokens must be between 0 and 16 (got {self.max_draft_tokens})",
        )
        _check(
            self.method != "draft" or bool(self.draft_model),
            "--speculative-method draft needs --draft-model (or use ngram / suffix / off)",
        )
        _check(
            0 <= self.ngram_assist <= 16,
            f"ngram_assist must be between 0 and 16 (got {self.ngram_assist})",
        )
        _check(
            1 <= self.ngram_min <= self.ngram_max,
            "ngram sizes need 1 <= ngram_min <= ngram_max "
            f"(got {self.ngram_min}, {self.ngram_max})",
        )
        _check(
            2 <= self.suffix_max_depth <= 64,
            f"suffix_max_depth must be between 2 and 64 (got {self.suffix_max_depth})",
        )
        _check(
            self.method != "suffix" or self.suffix_max_depth > self.max_draft_tokens,
            "suffix_max_depth must exceed --max-draft-tokens (a match and its drafts share "
            f"the depth; got {self.suffix_max_depth} and {self.max_draft_tokens})",
        )
        _check(
            self.max_request_slowdown is None or 0 <= self.max_request_slowdown < 1,
            f"max_request_slowdown must be null or in [0, 1) (got {self.max_request_slowdown})",
        )
        _check(
            0 <= self.suffix_cache_tokens <= 10_000_000,
            f"suffix_cache_tokens must be between 0 and 10000000 (got {self.suffix_cache_tokens})",
        )

    @property
    def enabled(self) -> bool:
        return self.method != "off" and self.max_draft_tokens > 0

    def draft_weights(self, target_quantization: str, beside_gguf_blocks: bool = False) -> str:
        """The draft model's --quantization: its own, or (auto) the target's, int4 beside a
        target on GGUF blocks (engine/model/on_cpu.py `draft_beside_gguf_blocks`)."""
        if self.draft_quantization != "auto":
            return self.draft_quantization
        return "int4" if beside_gguf_blocks else target_quantization

    @property
    def max_branches(self) -> int:
        """The most branches a step may draft (auto: AUTO_BRANCHES, adaptive K only)."""
        if self.draft_branches is not None:
            return self.draft_branches
        if self.draft_length != "adaptive":
            return 1
        return max(1, min(AUTO_BRANCHES, 62 // max(self.max_draft_tokens, 1)))


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(method="off"))

    def __post_init__(self) -> None:
        # A verification pass schedules 1 + K tokens for a request; it must fit in one step.
        _check(
            self.scheduler.max_num_batched_tokens
            >= 1 + self.spec.max_draft_tokens * (self.spec.draft_branches or 1),
            "--max-num-batched-tokens must be at least 1 + --max-draft-tokens x --draft-branches",
        )
