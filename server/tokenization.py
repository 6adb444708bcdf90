"""POST /tokenize and /detokenize in vLLM's shapes: the served model's tokenizer, run as the
completion endpoints run it (a chat through the same template, long inputs off the event loop).

A body with `messages` is a chat, any other a text `prompt`. Sizes are bounded as a
generation request's are: the body by --max-body-bytes, the tokens by --max-request-tokens.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from server.errors import APIError, validation_message
from server.prompts import ChatEnding, off_loop, render_chat_off_loop, request_token_limit
from server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from server.state import ServerState
from server.tools import ToolSetup, check_tools

CHARS_PER_TOKEN = 4
"""A rough size of a token in text, to decide when token lists leave the event loop."""
Body = TypeVar("Body", bound=BaseModel)


async def tokenize(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    chat = body.get("messages") is not None
    if chat and body.get("prompt") is not None:
        raise APIError(
            "Give either prompt (text) or messages (a chat), not both.", 400, param="prompt"
        )
    req = _parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    state.check_model(req.model)
    engine = state.ready_engine()
    tokenizer = state.tokenizer
    if isinstance(req, TokenizeChatRequest):
        check_tools(req.tools or [])
        # As /v1/chat/completions renders tools when no tool_choice is given.
        tools = ToolSetup(req.tools, "auto", True) if req.tools else None
        ending = ChatEnding(
            req.add_generation_prompt, req.continue_final_message, req.add_special_tokens
        )
        ids = (await render_chat_off_loop(state, req.messages, tools, ending)).token_ids
    else:
        text, special = req.prompt, req.add_special_tokens
        ids = await off_loop(len(text), lambda: tokenizer.encode(text, add_special_tokens=special))
    _check_size(state, len(ids), "messages" if chat else "prompt")
    out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
    if req.return_token_strs:
        chars = len(ids) * CHARS_PER_TOKEN
        out["token_strs"] = await off_loop(chars, tokenizer.convert_ids_to_tokens, ids)
    return out


async def detokenize(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    req = _parse(DetokenizeRequest, body)
    state.check_model(req.model)
    engine = state.ready_engine()
    tokens = req.tokens
    _check_size(state, len(tokens), "tokens")
    # The ids the engine takes in a prompt (and may generate): the model's vocabulary.
    vocab = engine.vocab_size
    bad = next((i for i, token in enumerate(tokens) if not 0 <= token < vocab), None)
    if bad is not None:
        raise APIError(
            f"tokens[{bad}] = {tokens[bad]} is not a token id of this model: ids are in "
            f"[0, {vocab}).",
            400,
            param="tokens",
        )
    text = await off_loop(len(tokens) * CHARS_PER_TOKEN, state.tokenizer.decode, tokens)
    return {"prompt": text}


def _parse(model: type[Body], body: dict[str, Any]) -> Body:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise APIError(message, 400, param=param) from exc


def _check_size(state: ServerState, count: int, param: str) -> None:
    limit = request_token_limit(state)
    if count > limit:
        raise APIError(
            f"`{param}` holds {count} tokens, more than this server takes in one request "
            f"({limit}, --max-request-tokens).",
            400,
            param=param,
            code="request_too_large",
        )
