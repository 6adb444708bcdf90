"""The one check of a request against what the engine can serve (vocabulary, context length, KV
pool, `SamplingParams.validate`), raised as `InvalidRequest`; the server checks every choice."""

from __future__ import annotations

from engine.types.request import InvalidRequest, SamplingParams

__all__ = ["InvalidRequest", "check_request"]


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    pool_tokens: int,
    max_draft_tokens: int | None = None,
) -> None:
    """Raise InvalidRequest unless the engine can serve this prompt with these parameters
    (`max_draft_tokens`: the engine's K_max, which a request's own cap may not exceed)."""
    params.validate()
    cap = params.max_draft_tokens
    if cap is not None and max_draft_tokens is not None and cap > max_draft_tokens:
        raise InvalidRequest(
            f"speculation.max_draft_tokens must be between 0 and this server's "
            f"--max-draft-tokens, {max_draft_tokens} (got {cap}).",
            "speculation.max_draft_tokens",
        )
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequest("The prompt is empty after tokenization.", "prompt")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"Token id {bad} is out of range [0, {vocab_size}).", "prompt")
    # The sampler indexes logits with these ids: one bad id would fail the step.
    for field, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", [t for t, _ in params.logit_bias]),
    ):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"{field}: token id {bad} is out of range [0, {vocab_size}).", field
            )
    completion = params.max_tokens  # 0 only when scoring the prompt (prompt_logprobs)
    if n + completion > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {n + completion} tokens ({n} in the prompt, {completion} for the "
            "completion). Please reduce the prompt or the completion length.",
            "prompt" if n >= max_model_len else "max_tokens",
            "context_length_exceeded",
        )
    if n + completion > pool_tokens:
        raise InvalidRequest(
            f"The request needs {n + completion} tokens of KV cache but the pool holds only "
            f"{pool_tokens}.",
            "max_tokens",
            "context_length_exceeded",
        )
