"""One mutable record per request; progress is counters, not phase flags.

The KV cache holds `num_computed_tokens` tokens of `all_token_ids`. A step schedules the
tokens after that: a prefill chunk, or (decoding) the last sampled token plus K draft tokens
to verify. Verification is therefore just scheduling 1 + K tokens, and rejection is rolling
`num_computed_tokens` back to what was accepted.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class InvalidRequest(ValueError):
    """Input the engine cannot serve; `param` names the request field, `code` the kind."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily."""

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How constrained JSON is laid out (llguidance's options): as json.dumps writes it, with no
free whitespace, which small models fill without end."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a constrained request's output must match (engine/sample/grammar.py compiles it).

    kind: json_schema (source: the schema as JSON text), json_object (any JSON object),
    regex, choice (source: a JSON list of the allowed strings) or lark (llguidance's Lark
    dialect, which may embed JSON schemas with %json)."""

    kind: str
    source: str = ""
    param: str = field(default="response_format", compare=False)
    """The request field it came from, named by the 400 a bad grammar gets."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    """0 (or below GREEDY_BELOW) = greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k cut."""
    min_tokens: int = 0
    """Stop tokens are masked out until this many tokens were generated."""
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """None = none; N >= 0 = the sampled token's logprob plus the top N."""
    prompt_logprobs: int | None = None
    """Same for the prompt tokens (echo + logprobs); disables prefix-cache hits."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: GrammarSpec | None = None
    """Structured output: every token is masked to what the grammar allows next."""

    def validate(self) -> None:
        """Raise InvalidRequest naming the field (engine/types/validation.py runs this)."""
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise InvalidRequest(
                f"max_tokens must be at least 1 (got {self.max_tokens})", "max_tokens"
            )
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequest(
                f"temperature must be in [0, 2] (got {self.temperature})", "temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1] (got {self.top_p})", "top_p")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (got {self.top_k})", "top_k")
        if self.min_tokens < 0 or self.min_tokens > max(self.max_tokens, 0):
            raise InvalidRequest(
                f"min_tokens must be in [0, max_tokens] (got {self.min_tokens})", "min_tokens"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise InvalidRequest(f"{name} must be in [0, 20] (got {value})", name)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2] (got {getattr(self, name)})", name)
        if self.grammar is not None and self.grammar.kind not in GRAMMAR_KINDS:
            raise InvalidRequest(f"unknown grammar kind {self.grammar.kind!r}", self.grammar.param)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it that dividing logits by it overflows: such a
        request's distribution is the argmax anyway (vLLM draws the line at 1e-5 too)."""
        return self.temperature < GREEDY_BELOW

    @property
    def coupled(self) -> bool:
        """A seeded sampling request: its tokens come from noise keyed by (seed, position),
        so its text does not depend on speculation or the batch (engine/sample/sampler.py)."""
        return self.seed is not None and not self.greedy

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass
class SpecStats:
    """What speculation did for one request (or, summed, for the engine)."""

    drafted: int = 0
    accepted: int = 0
    trials: int = 0
    """Drafts actually judged: the accepted ones plus the rejection that ended each run."""
    verify_passes: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.trials += num_accepted + (num_accepted < num_drafted)
        self.verify_passes += 1
        grow = num_drafted - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for pos in range(num_drafted):
            self.drafted_by_position[pos] += 1
            self.accepted_by_position[pos] += pos < num_accepted


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens of all_token_ids whose K/V are in the cache (verified only)."""
    num_draft_computed_tokens: int = 0
    """Tokens whose K/V the draft model holds (it may lag when K was 0 for a while)."""
    draft_features: Any = None
    """A feature draft's store of the target's hidden states it has yet to feed
    (engine/spec/proposers/eagle.py); None for other proposers."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at admission."""
    num_preemptions: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    generator: torch.Generator | None = None
    """Seeded per request so its samples do not depend on what else is in the batch."""
    coupled_noise: dict[int, Any] = field(default_factory=dict)
    """A seeded request's noise by output position (engine/sample/sampler.py), kept from the
    draft's use to the target's and for positions a rejection leaves to the next step."""
    prompt_logprobs: list | None = None
    """Prompt-token logprobs gathered chunk by chunk (echo + logprobs); None until asked for."""
    grammar: Any = None
    """A constrained request's GrammarState (engine/sample/grammar.py): the matcher follows
    the output, and this step's drafts while they are being proposed and verified."""
    error: str | None = None
    error_code: str | None = None
    """What kind of error (invalid_grammar: the request's grammar failed; None: the engine)."""

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        """True while tokens before the last one are still missing from the cache."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return eos + self.params.stop_token_ids
