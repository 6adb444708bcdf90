"""Plain dataclasses the engine hands to the server."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one emitted (or prompt) token and the top-N alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What one engine step produced for one request (a delta, not the whole output)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # in the first output only
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    drafts_by_source: dict[str, tuple[int, int]] = field(default_factory=dict)
    """(drafted, accepted) by what drafted them (SpecStats.by_source)."""
    error: str | None = None
    error_code: str | None = None  # invalid_grammar: the request's own grammar failed (a 400)

    @classmethod
    def make(cls, request_id: str = "r0", new_token_ids: list[int] | None = None) -> RequestOutput:
        return cls(request_id=request_id, new_token_ids=list(new_token_ids or []))


@dataclass
class StepTokens:
    """Verified tokens for one request after a step: accepted drafts then one recovered/bonus."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    num_drafted: int = 0
    num_accepted: int = 0
