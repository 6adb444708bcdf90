"""One mutable record per request; progress is counters, not phase flags: verification is
scheduling 1 + K tokens after `num_computed_tokens`, rejection is rolling that counter back."""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class InvalidRequest(ValueError):
    """Input the engine cannot serve; `param` names the request field, `code` the kind."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


GREEDY_BELOW = 1e-5  # temperatures below this decode greedily

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
# Constrained JSON as json.dumps lays it out: no free whitespace, which small models fill forever.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """What a constrained request's output must match: `kind` one of GRAMMAR_KINDS, `source`
    the schema as JSON text, a regex, a JSON list of choices, or a Lark grammar."""

    kind: str
    source: str = ""
    param: str = field(default="response_format", compare=False)  # named by a bad grammar's 400
    number_digits: int = 0
    """> 0: the output is JSON text and each number in it takes at most this many digits."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_BELOW: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut
    min_tokens: int = 0  # stop tokens are masked until this many were generated
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # N: the sampled token's logprob plus the top N
    prompt_logprobs: int | None = None  # the same for the prompt; disables prefix-cache hits
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: GrammarSpec | None = None
    max_draft_tokens: int | None = None  # this request's cap on K every step; None = K_max
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)

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
        bad = next((b for _, b in self.logit_bias if not -100.0 <= b <= 100.0), None)
        if bad is not None:
            raise InvalidRequest(
                f"logit_bias values must be in [-100, 100] (got {bad})", "logit_bias"
            )
        if self.max_draft_tokens is not None and self.max_draft_tokens < 0:
            raise InvalidRequest(
                f"max_draft_tokens must be >= 0 (got {self.max_draft_tokens})",
                "speculation.max_draft_tokens",
            )
        if self.grammar is not None and self.grammar.kind not in GRAMMAR_KINDS:
            raise InvalidRequest(f"unknown grammar kind {self.grammar.kind!r}", self.grammar.param)
        if self.grammar is not None and self.grammar.number_digits < 0:
            raise InvalidRequest("number_digits must be at least 0", self.grammar.param)

    @property
    def greedy(self) -> bool:
        """Below GREEDY_BELOW, dividing logits by it overflows: the argmax (as in vLLM)."""
        return self.temperature < GREEDY_BELOW

    @property
    def coupled(self) -> bool:
        """Seeded sampling: noise keyed by (seed, position), text independent of speculation."""
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

    def __init__(self, value: str) -> None:
        self.finished = value not in ("waiting", "running")


@dataclass
class SpecStats:
    """What speculation did for one request (or, summed, for the engine)."""

    drafted: int = 0
    accepted: int = 0
    trials: int = 0  # drafts judged: the accepted plus the rejection that ended each run
    verify_passes: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    by_source: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Drafted and accepted tokens by what drafted them: the proposer's method (draft, ngram,
    suffix), "lookup" (prompt lookups in the draft model's place), "grammar" (forced
    tokens). Only a request's own stats keep these."""

    def count(self, source: str, num_drafted: int, num_accepted: int) -> None:
        drafted, accepted = self.by_source.get(source, (0, 0))
        self.by_source[source] = (drafted + num_drafted, accepted + num_accepted)

    def record(self, num_drafted: int, num_accepted: int, by_position: bool = True) -> None:
        if by_position:
            self.record_many([num_drafted], [num_accepted])
            return
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.trials += num_accepted + (num_accepted < num_drafted)
        self.verify_passes += 1

    def record_many(self, num_drafted: list[int], num_accepted: list[int]) -> None:
        """`record` of each pair (one verified chain each), by position included."""
        self.drafted += sum(num_drafted)
        self.accepted += sum(num_accepted)
        ended = sum(a < d for d, a in zip(num_drafted, num_accepted, strict=True))  # by a rejection
        self.trials += sum(num_accepted) + ended
        self.verify_passes += len(num_drafted)
        depth = max(num_drafted, default=0)
        for counts, values in (
            (self.drafted_by_position, num_drafted),
            (self.accepted_by_position, num_accepted),
        ):
            counts.extend([0] * (depth - len(counts)))
            ending = [0] * (depth + 1)  # chains of each length
            for n in values:
                ending[n] += 1
            longer = 0  # chains longer than pos - 1
            for pos in range(depth, 0, -1):
                longer += ending[pos]
                counts[pos - 1] += longer


class GrammarMatcher(Protocol):
    """A constrained request's matcher at its committed output (engine/sample/grammar.py)."""

    failure: str | None

    @property
    def stopped(self) -> bool: ...

    def allowed(self, prior: Sequence[int]) -> torch.Tensor:
        """[vocab] bool: what may follow the output plus `prior` drafts."""
        ...

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (may be empty)."""
        ...

    def valid_prefix(self, tokens: Sequence[int]) -> int: ...

    def commit(self, token: int) -> bool: ...


class DraftFeatures(Protocol):
    """A feature draft's store of the target's hidden states a request has yet to feed
    (engine/spec/proposers/eagle.py)."""

    def write(self, start: int, rows: torch.Tensor) -> None: ...

    def read(self, start: int, end: int, width: int) -> torch.Tensor: ...


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens of all_token_ids whose K/V are cached (verified)
    num_draft_computed_tokens: int = 0  # the draft model's (it may lag when K was 0)
    draft_features: DraftFeatures | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    generator: torch.Generator | None = None  # seeded: samples independent of the batch
    prompt_logprobs: list | None = None  # gathered chunk by chunk; None until asked for
    grammar: GrammarMatcher | None = None
    error: str | None = None
    error_code: str | None = None  # invalid_grammar: the request's own grammar failed
    _token_bytes: bytearray = field(default_factory=bytearray, repr=False)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_bytes(self) -> bytearray:
        """all_token_ids as int32s, as prompt lookups search them: extended as output comes."""
        have, n = len(self._token_bytes) // 4, self.num_tokens
        if have < n:
            self._token_bytes += array("i", self.token_ids(have, n)).tobytes()
        return self._token_bytes

    def token_ids(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without joining the whole context first."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

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
