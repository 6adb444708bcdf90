"""Everything one app instance serves with, hung on `app.state.tandem` (never module-level)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from server.errors import APIError
from server.metrics import Metrics
from server.settings import Settings

if TYPE_CHECKING:
    from engine import EngineClient
    from server.logprobs import TokenTexts


class Status(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics = field(init=False)
    engine: EngineClient | None = None
    tokenizer: Any = None
    """A transformers tokenizer loaded from the target's directory."""
    token_texts: TokenTexts | None = None
    stop_token_ids: tuple[int, ...] = ()
    """EOS ids from the model's generation config (the engine stops on them)."""
    status: Status = Status.LOADING
    failure: str | None = None
    in_flight: int = 0
    """API requests being answered now, streams included (a drain waits for zero)."""
    created: int = field(default_factory=lambda: int(time.time()))
    """The model card's `created`: when this server started, the same on every answer."""

    def __post_init__(self) -> None:
        self.metrics = Metrics(self._engine_stats)

    def _engine_stats(self) -> Any:
        return self.engine.stats() if self.engine is not None else None

    def ready_engine(self) -> EngineClient:
        """The engine, or a 503 telling the client to come back.

        A draining server still serves what its drain gate (server.drain) let in before the
        drain began; the gate refuses everything newer.
        """
        if self.status not in (Status.READY, Status.DRAINING) or self.engine is None:
            raise self.unavailable()
        problem = self.engine.problem()
        if problem is not None:
            raise self.unavailable(problem)
        return self.engine

    def unavailable(self, problem: str | None = None) -> APIError:
        """The 503 for a server that is not READY (or whose engine has a `problem`);
        Retry-After lets a balancer or client retry.

        A draining replica answers it before starting any work, so retrying elsewhere is safe.
        """
        reason = problem or {
            Status.LOADING: "the model is still loading",
            Status.DRAINING: "the server is shutting down",
            Status.FAILED: f"the model failed to load: {self.failure}",
        }.get(self.status, "the engine is not running")
        return APIError(
            f"Service unavailable: {reason}",
            503,
            code="not_ready",
            headers={"Retry-After": "5"},
        )

    def check_model(self, name: str | None) -> str:
        """The served model name, or a 404 when `name` is some other model."""
        if name is None or name in self.settings.model_names():
            return self.settings.served_model_name
        raise self.unknown_model(name)

    def unknown_model(self, name: str) -> APIError:
        served = self.settings.served_model_name
        return APIError(
            f"The model `{name}` does not exist. This server serves `{served}`.",
            404,
            param="model",
            code="model_not_found",
        )
