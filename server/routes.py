"""HTTP routes: thin handlers that validate, check auth and delegate."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from importlib import metadata
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import JSONResponse, Response

from server.chat import create_chat_completion
from server.completions import create_completion
from server.errors import APIError
from server.metrics import CONTENT_TYPE
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.responses import ModelCard, ModelList
from server.state import ServerState, Status
from server.tokenization import detokenize, tokenize

JSONBody = Annotated[dict[str, Any], Body()]
"""A JSON object, parsed by the handler (a body of one of several shapes)."""


def get_state(request: Request) -> ServerState:
    return request.app.state.tandem


def require_api_key(request: Request) -> None:
    error = key_error(get_state(request).settings.server.api_key, request.headers)
    if error is not None:
        raise error


def key_error(key: str | None, headers: Mapping[str, str]) -> APIError | None:
    """The 401 for a request without `key` as its bearer token, or None (also with no key)."""
    if not key:
        return None
    scheme, _, token = headers.get("authorization", "").partition(" ")
    given = token.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() == "bearer" and hmac.compare_digest(given, key.encode("utf-8")):
        return None
    return APIError(
        "Missing or incorrect API key: send 'Authorization: Bearer <key>'.",
        401,
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def build_router() -> APIRouter:
    router = APIRouter()
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

    @router.get("/health")
    async def health(request: Request) -> JSONResponse:
        state = get_state(request)
        if state.status is not Status.READY:  # loading, draining or failed: 503
            raise state.unavailable()
        if state.engine is not None and (problem := state.engine.problem()) is not None:
            raise state.unavailable(problem)  # the watchdog: a dead or hung engine thread
        return JSONResponse({"status": Status.READY.value})

    @router.get("/version")
    async def version(request: Request) -> JSONResponse:
        # cpu_kernels: the instruction set Tandem's CPU kernels were compiled for when the
        # served model runs on them; null on the GPU, on torch's operators, or while loading.
        engine = get_state(request).engine
        return JSONResponse(
            {"version": package_version(), "cpu_kernels": engine.cpu_isa if engine else None}
        )

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)

    @v1.get("/models")
    async def models(request: Request) -> JSONResponse:
        card = model_card(get_state(request))
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    # :path, since a served name may hold slashes (org/model; the SDK sends them as %2F).
    @v1.get("/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        state = get_state(request)
        card = model_card(state)
        if model_id != card.id:  # only the listed id: the card names no other
            raise state.unknown_model(model_id)
        return JSONResponse(card.model_dump(mode="json"))

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(get_state(request), body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(get_state(request), body, request)

    # vLLM serves these at the root, outside /v1, so --api-key-scope v1 would leave them open;
    # they expose the served tokenizer and cost work, so they need the key whenever one is set.
    keyed = [Depends(require_api_key)]

    @router.post("/tokenize", dependencies=keyed)
    async def tokenize_text(body: JSONBody, request: Request) -> JSONResponse:
        return JSONResponse(await tokenize(get_state(request), body))

    @router.post("/detokenize", dependencies=keyed)
    async def detokenize_ids(body: JSONBody, request: Request) -> JSONResponse:
        return JSONResponse(await detokenize(get_state(request), body))

    router.include_router(v1)
    return router


def model_card(state: ServerState) -> ModelCard:
    """The served model as /v1/models lists it."""
    engine = state.engine
    return ModelCard(
        id=state.settings.served_model_name,
        created=state.created,
        root=state.settings.model_root,
        max_model_len=engine.max_model_len if engine is not None else None,
    )


def package_version() -> str:
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:
        return "unknown"
