"""POST /v1/chat/completions: messages through the chat template, an assistant message out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.errors import APIError
from server.logprobs import chat_logprobs
from server.prompts import (
    check_request_tokens,
    max_tokens_for,
    render_chat_off_loop,
    request_token_limit,
    sampling_params,
)
from server.protocol import ChatCompletionRequest
from server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    Delta,
    ToolCallDelta,
    dump,
    new_id,
    now,
)
from server.serving import ChoiceDelta, ChoiceRequest, ChoiceUsage, total_usage
from server.state import ServerState
from server.streaming import respond
from server.structured import compile_grammar, grammar_for
from server.tools import ToolCallParser, ToolSetup, parse_tool_calls, tool_grammar, tool_setup


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, raw: Request
) -> Response:
    arrival = time.monotonic()
    model = state.check_model(req.model)
    state.ready_engine()
    if req.max_tokens == 0:
        raise APIError("max_tokens must be at least 1", 400, param="max_tokens")
    if req.top_logprobs and not req.logprobs:
        raise APIError("top_logprobs needs logprobs to be true", 400, param="top_logprobs")
    tools = tool_setup(req)
    digits = state.settings.server.max_json_number_digits
    grammar = grammar_for(req, digits)  # a required call's grammar takes its place (no text)
    if tools is not None:
        grammar = tool_grammar(tools, digits) or grammar
    prompt = await render_chat_off_loop(state, req.messages, tools)
    await compile_grammar(state, grammar)
    max_tokens = max_tokens_for(state, prompt, req.output_limit, None)
    if req.output_limit is None:  # "as many as fit" also means: within the request budget
        share = (request_token_limit(state) - len(prompt.token_ids)) // req.n
        max_tokens = min(max_tokens, max(share, 1))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    request_id = new_id("chatcmpl")
    choices = [
        ChoiceRequest(
            i,
            f"{request_id}-{i}",
            prompt.token_ids,
            sampling_params(
                state,
                req,
                prompt,
                max_tokens=max_tokens,
                seed_offset=i,
                logprobs=logprobs,
                prompt_param="messages",
                grammar=grammar,
            ),
            tuple(req.stop_strings),
        )
        for i in range(req.n)
    ]
    check_request_tokens(state, [(len(prompt.token_ids), max_tokens)], req.n)
    view = _ChatView(state, req, len(prompt.token_ids), request_id, model, tools)
    return await respond(
        raw,
        state,
        choices,
        arrival=arrival,
        stream=req.stream,
        to_chunks=view.chunks,
        to_body=view.body,
    )


class _ChatView:
    """Turns choice deltas into chat completion bodies, streamed or whole."""

    def __init__(
        self,
        state: ServerState,
        req: ChatCompletionRequest,
        prompt_length: int,
        request_id: str,
        model: str,
        tools: ToolSetup | None = None,
    ) -> None:
        self.tools = tools
        """Set when the output may hold tool calls (server/tools.py)."""
        self.state = state
        self.req = req
        self.prompt_length = prompt_length
        self.id = request_id
        self.model = model
        self.created = now()

    def _logprobs(self, delta: ChoiceDelta) -> ChatLogprobs | None:
        if not self.req.logprobs or self.state.token_texts is None:
            return None
        top_n = self.req.top_logprobs or 0
        return ChatLogprobs(content=chat_logprobs(self.state.token_texts, delta.pieces, top_n))

    def _usage(self, usages: dict[int, ChoiceUsage]) -> Any:
        return total_usage([self.prompt_length], self.req.n, usages)

    def body(self, results: dict[int, ChoiceDelta]) -> dict[str, Any]:
        choices = []
        for i in sorted(results):
            result = results[i]
            content: str | None = result.text
            calls: list[dict[str, Any]] = []
            if self.tools is not None:
                content, calls = parse_tool_calls(result.text, self.tools)
            message = AssistantMessage(content=content, tool_calls=calls or None)
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=self._logprobs(result),
                    finish_reason=_finish_reason(result.finish_reason, calls),
                )
            )
        usage = self._usage({i: d.usage for i, d in results.items()})
        response = ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )
        return dump(response)

    def _chunk(self, choice: ChatChunkChoice | None, usage: Any = None) -> dict[str, Any]:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[choice] if choice else [],
            usage=usage,
        )
        body = dump(chunk, keep_usage=self.req.include_usage)
        for entry in body["choices"]:  # OpenAI deltas carry only the fields they set
            entry["delta"] = {k: v for k, v in entry["delta"].items() if v is not None}
        return body

    def _content_chunk(self, index: int, text: str) -> dict[str, Any]:
        """`_chunk` of a content delta with no logprobs, built directly: one per streamed token,
        so pydantic's construction and dump of the same fields were a share of the event loop's
        time per token (tests/test_server_text.py checks it against `_chunk`)."""
        choice = {
            "index": index,
            "delta": {"content": text},
            "logprobs": None,
            "finish_reason": None,
        }
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [choice],
        }
        if self.req.include_usage:
            body["usage"] = None
        return body

    async def chunks(self, deltas: AsyncIterator[ChoiceDelta]) -> AsyncIterator[dict[str, Any]]:
        usages: dict[int, ChoiceUsage] = {}
        parsers: dict[int, ToolCallParser] = {}
        async for delta in deltas:
            usages[delta.index] = delta.usage
            if delta.first:  # no content to come when a call is required
                forced = self.tools is not None and self.tools.mode != "auto"
                role = Delta(role="assistant", content=None if forced else "")
                yield self._chunk(ChatChunkChoice(index=delta.index, delta=role))
            logprobs = self._logprobs(delta)
            text, calls = delta.text, []
            if self.tools is not None:  # content is released once it cannot open a call
                parser = parsers.setdefault(delta.index, ToolCallParser(self.tools))
                text, calls = parser.feed(delta.text, final=delta.finish_reason is not None)
            if text and logprobs is None:
                yield self._content_chunk(delta.index, text)
            elif text or (logprobs and logprobs.content):
                content = Delta(content=text)
                yield self._chunk(
                    ChatChunkChoice(index=delta.index, delta=content, logprobs=logprobs)
                )
            if calls:
                done = len(parsers[delta.index].calls) - len(calls)
                tool_calls = [ToolCallDelta(index=done + j, **call) for j, call in enumerate(calls)]
                yield self._chunk(
                    ChatChunkChoice(index=delta.index, delta=Delta(tool_calls=tool_calls))
                )
            if delta.finish_reason:
                made = parsers[delta.index].calls if delta.index in parsers else []
                end = ChatChunkChoice(
                    index=delta.index,
                    delta=Delta(),
                    finish_reason=_finish_reason(delta.finish_reason, made),
                )
                yield self._chunk(end)
        if self.req.include_usage:
            yield self._chunk(None, usage=self._usage(usages))


def _finish_reason(reason: str | None, calls: list) -> Any:
    """ "tool_calls" for an output that stopped after making calls."""
    return "tool_calls" if calls and reason == "stop" else reason
