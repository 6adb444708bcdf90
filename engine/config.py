"""Frozen engine configuration, validated once at construction.

Every `ValueError` raised here names the setting (as the CLI flag spells it) and what is allowed,
so the server can surface it unchanged at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
SPEC_METHODS = ("draft", "ngram", "off")
DRAFT_LENGTH_POLICIES = ("adaptive", "fixed")
TREE_DRAFTS = ("sampled", "top")
AUTO_BRANCHES = 4
"""The most draft-tree branches --draft-branches auto considers."""
# rejection_sample's `method` (engine/sample/rejection_sampler.py).
VERIFICATIONS = ("block", "token")
# The names registered in engine/attention/backends.py, plus auto.
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "triton")
# engine/model/native/__init__.py MODEL_IMPLS.
MODEL_IMPLS = ("auto", "native", "transformers")
# engine/model/quantization.py METHODS.
QUANTIZATIONS = ("none", "bf16", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, f"{flag} must be one of {', '.join(allowed)} (got {value!r})")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """Local Hugging Face model directory of the target model."""
    dtype: str = "auto"
    """auto = float32 on CPU, bfloat16 on CUDA."""
    device: str = "auto"
    """auto = cuda when available, else cpu."""
    max_model_len: int | None = None
    """Longest prompt + output; None = the target's max_position_embeddings."""
    seed: int = 0
    """Seed for requests that do not bring their own."""
    attention_backend: str = "auto"
    """auto = triton on CUDA when Triton is installed, cpu (Tandem's C kernel) on the CPU in
    float32 when it builds, else reference."""
    cuda_graphs: bool = True
    """Run steps in which no request feeds more than 1 + K tokens (its draft tree's nodes
    with trees) on padded fixed shapes, captured as CUDA graphs on CUDA. Needs the triton
    attention backend; ignored without it."""
    model_impl: str = "auto"
    """Forward pass of both models: native = Tandem's own (engine/model/native/, Llama family),
    transformers = the Hugging Face module with Tandem's attention, auto = native where
    registered and matching transformers' logits on a probe batch."""
    cpu_packed_linear: bool = True
    """On the CPU in float32, run both models' linear layers through Tandem's C GEMM on
    packed weights (engine/cpu/linear.py). Ignored on CUDA, and (with a warning) where the
    kernels do not build."""

    gguf_blocks: bool = True
    """With the CPU kernels, a model converted from a GGUF file runs its linear layers on the
    file's own Q8_0 / Q4_1 blocks (engine/cpu/gguf_blocks.py): the same outputs from about a
    fifth of the bytes per pass. Off = the dequantized float32 weights."""

    quantization: str = "none"
    """Weight-only quantization of Hugging Face checkpoints (engine/model/quantization.py): none,
    bf16, int8 (Q8_0 blocks), int4 (Q4_1 blocks, LM head int8). Changes the served model;
    runs on the CPU in float32. A GGUF model keeps its file's weights."""

    cache_dir: str | None = None
    """Where GGUF files are converted to (engine/model/files.py); None = the user cache."""
    cpu_bind: bool = True
    """On the CPU, bind the server's engine thread to cores of its own when the process may
    use more cores than torch has threads (engine/cpu/affinity.py)."""

    def __post_init__(self) -> None:
        _check(bool(self.model), "--model must name a model directory or GGUF file")
        _check_choice("--dtype", self.dtype, DTYPES)
        _check_choice("--device", self.device, DEVICES)
        _check_choice("--attention-backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("--model-impl", self.model_impl, MODEL_IMPLS)
        _check_choice("--quantization", self.quantization, QUANTIZATIONS)
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
    """Tokens per KV block."""
    num_blocks: int | None = None
    """Blocks in the pool; None = size the pool from the memory budget below."""
    memory_gb: float = 1.0
    """KV budget (GiB) on CPU when num_blocks is None."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory for weights + KV when num_blocks is None."""
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    """What the KV cache holds: auto = the model's dtype; float16 or bfloat16 store keys and
    values rounded to 16 bits on the CPU (half the bytes attention reads, twice the tokens a
    budget holds), a change to the served model's numerics, as llama.cpp's default float16
    cache is; float32 = the model's dtype on the CPU in float32."""

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
    """Most requests in the running batch."""
    max_num_batched_tokens: int = 512
    """Token budget per step (prefill chunks + decode + draft verification)."""
    max_waiting: int = 1024
    """Most requests waiting for admission; more are refused (HTTP 503)."""

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
    """draft = small draft model, ngram = prompt lookup, off = plain decoding."""
    draft_model: str | None = None
    """Local HF directory of the draft model (method=draft)."""
    max_draft_tokens: int = 4
    """K_max: most draft tokens per request per step."""
    draft_length: str = "adaptive"
    """adaptive = K chosen per step from a cost model; fixed = always max_draft_tokens."""
    ngram_max: int = 4
    """Longest suffix n-gram the prompt-lookup proposer matches."""
    ngram_min: int = 1
    """Shortest suffix n-gram it falls back to."""
    ngram_assist: int = 0
    """With a draft model: a decoding request whose last `ngram_assist` tokens (or more, up to
    ngram_max) occurred earlier in its context may verify what followed them (prompt lookup)
    in place of the draft model's drafts (engine/core/scheduler.py); 0 = never."""
    recalibrate: bool = False
    """Time the cost model afresh at start instead of reusing this machine's cached one."""
    draft_branches: int | None = 1
    """Draft trees: the most candidates a request drafts for its next token, each continued
    as a chain of K (docs/VERIFICATION.md). 1 = a single chain; None (auto) = the adaptive
    policy picks 1 to AUTO_BRANCHES from the cost model (a fixed K gets a chain)."""
    tree_drafts: str = "top"
    """How a sampling request's tree candidates are drafted: sampled = N draws from q without
    replacement (recursive rejection sampling verifies them), top = the top N - 1 of q fixed
    and one draw from the rest (Hu et al.'s greedy draft sampler, verified optimally)."""
    draft_min_prob: float = 0.0
    """A draft model's chain stops at the first draft whose row gives the draft's most likely
    token less than this probability (softmax at temperature 1): that draft and the deeper
    ones are not verified. 0 = never; trees are never cut (engine/spec/proposers)."""
    verification: str = "block"
    """How sampled drafts are verified: block = the block jointly (Sun et al.), token = token
    by token. Both are lossless; block keeps at least as many drafts in expectation."""
    draft_quantization: str = "auto"
    """Weight-only quantization of a draft model's Hugging Face checkpoint (the choices of
    --quantization), or auto = the target's --quantization, and int4 for a Hugging Face draft
    beside a GGUF target whose linears run on its file's blocks (a draft pass there is bound
    by reading its weights, and a quarter of the bytes left the default draft's acceptance
    where it was; a GGUF draft runs on its own blocks). The draft only proposes tokens, so
    the output stays the target's; its rounding moves acceptance and the draft pass's time."""

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
            "--speculative-method draft needs --draft-model (or use ngram / off)",
        )
        _check(
            0.0 <= self.draft_min_prob < 1.0,
            f"--draft-min-prob must be at least 0 and below 1 (got {self.draft_min_prob})",
        )
        _check(
            self.draft_min_prob == 0.0 or self.method == "draft",
            "--draft-min-prob needs a draft model (--speculative-method draft)",
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
