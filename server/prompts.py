"""Text -> token ids (plain prompts and chat templates), sampling parameters, length checks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from engine import GrammarSpec, SamplingParams
from server.errors import APIError
from server.protocol import ChatMessage, SamplingRequest
from server.state import ServerState
from server.tools import (
    ToolSetup,
    as_template_tools,
    render_tool_turns,
    supports_tools,
    tool_instructions,
)


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None = None
    """The prompt as the client sent it, when it was text (echoed verbatim)."""


T = TypeVar("T")

# Text past this many characters is tokenized on a worker thread. The tokenizer releases the
# GIL, so a 1 MB prompt (about a second of tokenizing) no longer stalls every other client's
# stream; short prompts stay inline, where a thread hop would cost more than it saves.
OFF_LOOP_CHARS = 16_384


async def encode_prompts(state: ServerState, prompts: Sequence[str | list[int]]) -> list[Prompt]:
    chars = sum(len(p) for p in prompts if isinstance(p, str))
    return await off_loop(chars, lambda: [encode_prompt(state, prompt) for prompt in prompts])


async def render_chat_off_loop(
    state: ServerState,
    messages: Sequence[ChatMessage],
    tools: ToolSetup | None = None,
    ending: ChatEnding | None = None,
) -> Prompt:
    """`render_chat`, on a worker thread when the messages are long (see OFF_LOOP_CHARS)."""
    return await off_loop(
        sum(len(m.text()) for m in messages), render_chat, state, messages, tools, ending
    )


async def off_loop(chars: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, on a worker thread when it handles `chars` characters or more."""
    if chars < OFF_LOOP_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def encode_prompt(state: ServerState, prompt: str | list[int]) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(state.tokenizer.encode(prompt), prompt)
    return Prompt(list(prompt))


@dataclass(frozen=True)
class ChatEnding:
    """How a rendered chat ends and is tokenized (vLLM's /tokenize options); the default is
    /v1/chat/completions': the assistant's turn opened, no special tokens added."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


def render_chat(
    state: ServerState,
    messages: Sequence[ChatMessage],
    tools: ToolSetup | None = None,
    ending: ChatEnding | None = None,
) -> Prompt:
    """Apply the model's chat template (with the assistant turn opened, unless `ending` says
    otherwise) and tokenize; with tools, in the template's own tool format or Tandem's
    convention (server/tools.py)."""
    ending = ending or ChatEnding()
    tokenizer = state.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise APIError(
            "This model has no chat template; use /v1/completions instead.", 400, param="messages"
        )
    native = supports_tools(template)
    conversation: list[dict[str, Any]] = []
    for message in messages:
        entry = {**(message.model_extra or {}), "role": message.role, "content": message.text()}
        if message.name is not None:
            entry["name"] = message.name
        entry.update(render_tool_turns(message, native))
        conversation.append(entry)
    extra: dict[str, Any] = {}
    if tools is not None and native:
        extra["tools"] = as_template_tools(tools)
    elif tools is not None:
        note = tool_instructions(tools)
        if conversation[0]["role"] in ("system", "developer"):
            conversation[0] = {
                **conversation[0],
                "content": conversation[0]["content"] + "\n\n" + note,
            }
        else:
            conversation.insert(0, {"role": "system", "content": note})
    if ending.continue_final_message:
        extra["continue_final_message"] = True
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=ending.add_generation_prompt,
            **extra,
        )
    except Exception as exc:  # jinja2 raises TemplateError, templates raise their own
        message = f"The chat template rejected the messages: {exc}"
        raise APIError(message, 400, param="messages") from exc
    # The template already wrote any BOS it wants: by default, do not add a second one.
    return Prompt(tokenizer.encode(text, add_special_tokens=ending.add_special_tokens))


def max_tokens_for(
    state: ServerState, prompt: Prompt, requested: int | None, default: int | None
) -> int:
    """The request's max_tokens, or when it gives none what the context has room for (at most
    `default`; None = all of it). Never below 1: a prompt with no room left is then refused,
    with the reason, by `sampling_params`' check."""
    if requested is not None:
        return requested
    room = state.ready_engine().max_model_len - len(prompt.token_ids)
    return max(1, room if default is None else min(default, room))


REQUEST_TOKENS_PER_CONTEXT = 8
"""--max-request-tokens auto = this many full contexts per request."""


def request_token_limit(state: ServerState) -> int:
    limit = state.settings.server.max_request_tokens
    if limit is None:
        return REQUEST_TOKENS_PER_CONTEXT * state.ready_engine().max_model_len
    return limit


def check_request_tokens(state: ServerState, sizes: Sequence[tuple[int, int]], n: int) -> None:
    """Refuse a request that may ask for more tokens than --max-request-tokens (400).

    sizes: (prompt tokens, max_tokens) per prompt; each prompt is counted once and its max_tokens
    n times. Without this cap one request (many prompts, large n) could fill the whole engine.
    """
    limit = request_token_limit(state)
    total = sum(prompt + n * completion for prompt, completion in sizes)
    if total > limit:
        raise APIError(
            f"This request may use {total} tokens (the prompts plus max_tokens for each of n={n} "
            f"choices per prompt), more than this server allows per request ({limit}). Lower "
            "max_tokens, n or the number of prompts.",
            400,
            param="max_tokens",
            code="request_too_large",
        )


def draft_cap(state: ServerState, req: SamplingRequest) -> int | None:
    """The request's `speculation` as a cap on its K (None: the server's choice); a method
    this server does not run is a 400 naming the field."""
    spec = req.speculation
    if spec is None:
        return None
    served = state.settings.engine.spec.method
    offered = ("auto", "off") + ((served,) if served != "off" else ())
    if spec.method not in offered:
        raise APIError(
            f"speculation.method {spec.method!r} is not offered by this server; it offers "
            f"{', '.join(offered)}.",
            400,
            param="speculation.method",
        )
    if spec.method == "off" and spec.max_draft_tokens:
        raise APIError(
            "speculation.method off allows no drafts; drop max_draft_tokens or give 0.",
            400,
            param="speculation.max_draft_tokens",
        )
    return 0 if spec.method == "off" else spec.max_draft_tokens


def sampling_params(
    state: ServerState,
    req: SamplingRequest,
    prompt: Prompt,
    *,
    max_tokens: int,
    seed_offset: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    prompt_param: str = "prompt",
    grammar: GrammarSpec | None = None,
) -> SamplingParams:
    """The engine's parameters for one choice, checked with the prompt by the engine's own
    validation (engine/types/validation.py): what it refuses is a 400 naming the field, the
    prompt's field being `prompt_param`."""
    stop_ids = tuple(req.stop_token_ids or ())
    if not req.ignore_eos:
        stop_ids += tuple(t for t in state.stop_token_ids if t not in stop_ids)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k, 0),
        min_tokens=req.min_tokens,
        seed=None if req.seed is None else req.seed + seed_offset,
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=req.logit_biases,
        grammar=grammar,
        max_draft_tokens=draft_cap(state, req),
    )
    from engine import InvalidRequest

    try:
        state.ready_engine().validate(prompt.token_ids, params)
    except InvalidRequest as exc:
        param = prompt_param if exc.param == "prompt" else exc.param
        raise APIError(str(exc), 400, param=param, code=exc.code) from exc
    return params
