"""POST /v1/completions: prompts in (text or token ids, several -> several choices), text out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.detokenizer import IncrementalDetokenizer, Piece
from server.errors import APIError
from server.logprobs import completion_logprobs, piece_offsets
from server.prompts import (
    Prompt,
    check_request_tokens,
    encode_prompts,
    max_tokens_for,
    sampling_params,
)
from server.protocol import MAX_CHOICES, CompletionRequest
from server.responses import CompletionChoice, CompletionResponse, dump, new_id, now
from server.serving import ChoiceDelta, ChoiceRequest, ChoiceUsage, total_usage
from server.state import ServerState
from server.streaming import respond
from server.structured import compile_grammar, grammar_for

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for the legacy completions endpoint."""


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    model = state.check_model(req.model)
    state.ready_engine()
    if req.max_tokens == 0 and not req.echo:
        raise APIError("max_tokens must be at least 1 (0 only with echo)", 400, param="max_tokens")
    if len(req.prompts()) * req.n > MAX_CHOICES:
        raise APIError(
            f"{len(req.prompts())} prompts x n={req.n} is more than the {MAX_CHOICES} choices "
            "one request may start",
            400,
            param="n",
        )
    prompts = await encode_prompts(state, req.prompts())
    grammar = grammar_for(req, state.settings.server.max_json_number_digits)
    await compile_grammar(state, grammar)
    # echo + logprobs scores the prompt; echo with max_tokens 0 needs that pass to finish at all.
    prompt_logprobs = req.logprobs if req.echo else None
    if req.echo and req.max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0
    request_id = new_id("cmpl")
    limits = [
        max_tokens_for(state, prompt, req.max_tokens, DEFAULT_MAX_TOKENS) for prompt in prompts
    ]
    choices = []
    for p, (prompt, max_tokens) in enumerate(zip(prompts, limits, strict=True)):
        for i in range(req.n):
            params = sampling_params(
                state,
                req,
                prompt,
                max_tokens=max_tokens,
                seed_offset=i,
                logprobs=req.logprobs,
                prompt_logprobs=prompt_logprobs,
                grammar=grammar,
            )
            index = p * req.n + i
            choices.append(
                ChoiceRequest(
                    index,
                    f"{request_id}-{index}",
                    prompt.token_ids,
                    params,
                    tuple(req.stop_strings),
                )
            )
    check_request_tokens(  # each prompt fits its context (sampling_params): now all together
        state, [(len(p.token_ids), m) for p, m in zip(prompts, limits, strict=True)], req.n
    )
    view = _CompletionView(state, req, prompts, request_id, model)
    return await respond(
        raw,
        state,
        choices,
        arrival=arrival,
        stream=req.stream,
        to_chunks=view.chunks,
        to_body=view.body,
    )


class _CompletionView:
    """Turns choice deltas into completion bodies, streamed or whole."""

    def __init__(
        self,
        state: ServerState,
        req: CompletionRequest,
        prompts: list[Prompt],
        request_id: str,
        model: str,
    ) -> None:
        self.state = state
        self.req = req
        self.prompts = prompts
        self.id = request_id
        self.model = model
        self.created = now()
        self.offsets: dict[int, int] = {}
        """Characters of each choice's text sent so far (for logprobs' text_offset)."""

    def _response(self, choices: list[CompletionChoice], **extra: Any) -> CompletionResponse:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, **extra
        )

    def choice(self, delta: ChoiceDelta) -> CompletionChoice:
        start = self.offsets.get(delta.index, 0)
        prefix, echoed = "", []
        if delta.first and self.req.echo:
            prompt = self.prompts[delta.index // self.req.n]
            echoed = _prompt_pieces(self.state, prompt, delta.prompt_logprobs)
            prefix = prompt.text if prompt.text is not None else "".join(p.text for p in echoed)
        text = prefix + delta.text
        self.offsets[delta.index] = start + len(text)
        logprobs = None
        if self.req.logprobs is not None and self.state.token_texts is not None:
            # A text prompt is echoed verbatim, so generated offsets count from its length.
            offsets = piece_offsets(echoed, start) + piece_offsets(
                delta.pieces, start + len(prefix)
            )
            kept = [
                (p.token_id, p.logprob, offset)
                for p, offset in zip(echoed + delta.pieces, offsets, strict=True)
                if p.token_id is not None
            ]
            logprobs = completion_logprobs(
                self.state.token_texts, [(t, lp) for t, lp, _ in kept], [o for _, _, o in kept]
            )
        return CompletionChoice(
            index=delta.index, text=text, logprobs=logprobs, finish_reason=delta.finish_reason
        )

    def usage(self, usages: dict[int, ChoiceUsage]) -> Any:
        return total_usage([len(p.token_ids) for p in self.prompts], self.req.n, usages)

    def body(self, results: dict[int, ChoiceDelta]) -> dict[str, Any]:
        choices = [self.choice(results[i]) for i in sorted(results)]
        usage = self.usage({i: d.usage for i, d in results.items()})
        return dump(self._response(choices, usage=usage))

    async def chunks(self, deltas: AsyncIterator[ChoiceDelta]) -> AsyncIterator[dict[str, Any]]:
        usages: dict[int, ChoiceUsage] = {}
        keep_usage = self.req.include_usage
        async for delta in deltas:
            usages[delta.index] = delta.usage
            choice = self.choice(delta)
            if choice.text or choice.finish_reason or (choice.logprobs and choice.logprobs.tokens):
                yield dump(self._response([choice]), keep_usage=keep_usage)
        if keep_usage:
            yield dump(self._response([], usage=self.usage(usages)))


def _prompt_pieces(state: ServerState, prompt: Prompt, logprobs: list | None) -> list[Piece]:
    """The prompt as pieces (its tokens' text and logprobs) for echo."""
    detok = IncrementalDetokenizer(state.tokenizer, [])
    entries = logprobs or [None] * len(prompt.token_ids)
    pieces = [Piece(t, detok.step(t), lp) for t, lp in zip(prompt.token_ids, entries, strict=False)]
    tail = detok.flush()
    if tail and pieces:
        pieces[-1] = Piece(pieces[-1].token_id, pieces[-1].text + tail, pieces[-1].logprob)
    return pieces
