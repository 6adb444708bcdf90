"""`create_app(settings, engine=None)`: the FastAPI application, one engine per app.

The lifespan loads the tokenizer (and, without an injected engine, the models) in a worker
thread after the server is already listening, so /health answers 503 while loading; then it
starts the engine's step loop inside the running event loop and stops it on shutdown.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from server.drain import DrainGate
from server.entry import EntryGate
from server.errors import install_error_handlers
from server.routes import build_router, package_version
from server.settings import Settings
from server.state import ServerState, Status

if TYPE_CHECKING:
    from engine import EngineClient

log = logging.getLogger("tandem.server")


def create_app(
    settings: Settings,
    engine: EngineClient | None = None,
    *,
    on_fatal: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """An app serving `engine`, or one it loads from `settings.engine` at start-up.

    on_fatal: called when loading fails (the CLI uses it to stop the server with an error).
    """
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load(state, engine, on_fatal))
        try:
            yield
        finally:
            state.status = Status.DRAINING
            loader.cancel()
            await asyncio.gather(loader, return_exceptions=True)
            if state.engine is not None:
                await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="Tandem", version=package_version(), lifespan=lifespan)
    app.state.tandem = state
    app.add_middleware(DrainGate, state=state)
    server = settings.server
    everywhere = server.api_key if server.api_key_scope == "all" else None
    app.add_middleware(EntryGate, limit=server.max_body_bytes, key=everywhere)
    install_error_handlers(app)
    app.include_router(build_router())
    return app


async def _load(
    state: ServerState,
    engine: EngineClient | None,
    on_fatal: Callable[[BaseException], None] | None,
) -> None:
    settings = state.settings
    try:
        from engine import prepare_config

        # GGUF files -> (cached) Hugging Face directories; directories stay as they are.
        config = await asyncio.to_thread(prepare_config, settings.engine)
        tokenizer, stop_ids = await asyncio.to_thread(_load_tokenizer, config.model.model)
        loaded_here = engine is None
        if engine is None:
            from engine import AsyncEngine  # imports torch; keep `--help` fast

            engine = await asyncio.to_thread(AsyncEngine.from_config, config)
    except Exception as exc:
        if isinstance(exc, ValueError):  # a setting the model cannot honour: no traceback
            log.error("loading %s failed: %s", settings.model_path, exc)
        else:
            log.exception("loading %s failed", settings.model_path)
        state.status, state.failure = Status.FAILED, str(exc)
        if on_fatal is not None:
            on_fatal(exc)
        return
    from server.logprobs import TokenTexts

    state.tokenizer = tokenizer
    state.token_texts = TokenTexts(tokenizer)
    state.stop_token_ids = stop_ids
    engine.start()
    rest = engine.spare_cores()
    if rest:  # the engine thread has cores of its own: keep off them
        os.sched_setaffinity(0, rest)
        log.info("event loop bound to cores %s", sorted(rest))
    state.engine = engine
    if loaded_here:
        _freeze_heap()
    if state.status is Status.LOADING:
        state.status = Status.READY
        log.info("serving %s as %r", settings.model_path, settings.served_model_name)


def _freeze_heap() -> None:
    """Move every object alive now (models, tokenizer, libraries) out of the garbage
    collector's sight: they live as long as the server, yet each full collection would walk
    them all while every thread, engine step and streams alike, stands still. Done once, when
    the server has loaded its own engine (an injected one belongs to its caller)."""
    gc.collect()
    gc.freeze()
    log.info("garbage collector: %d start-up objects frozen", gc.get_freeze_count())


def _load_tokenizer(model_path: str) -> tuple[Any, tuple[int, ...]]:
    """The target's tokenizer and every EOS id its generation config names."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = eos if isinstance(eos, list) else [eos]
    return tokenizer, tuple(int(t) for t in ids if t is not None)
