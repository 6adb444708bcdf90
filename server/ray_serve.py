"""Tandem on Ray Serve: engine replicas behind Serve's router, the OpenAI API through Serve's
HTTP proxy (docs/DEPLOY.md).

  python -m server.ray_serve --num-replicas 2 --port 8000 [any `tandem serve` flag]
  python -m server.ray_serve --min-replicas 1 --max-replicas 4 ...   # autoscaling
  serve run docker/ray-serve.yaml                                    # or serve deploy

The command starts a local Ray instance, or joins the cluster at $RAY_ADDRESS. Two
deployments make the application:

- `TandemEngine`: one Tandem server per replica, the same FastAPI app and engine `tandem serve`
  runs, called in-process through an ASGI bridge (`handle`), streaming included. Serve's
  router picks the replica, its autoscaler sizes the deployment by ongoing requests, its
  health check asks the engine. A replica scaled down or stopped drains: no new requests,
  up to `--drain-timeout` for the in-flight ones, then its engine stops.
- `TandemGateway`: the HTTP ingress. It forwards every request to an engine replica and
  streams the answer back; when a replica dies mid-request, only that replica's requests
  fail, with an OpenAI error (503 `replica_unavailable` for a whole answer, which the
  official client retries on another replica; an SSE error event mid-stream), never a hang.

Engine replicas mirror their counters into Ray's metrics, tagged by replica (each node
exports them to Prometheus). Responses carry `x-tandem-replica`, the replica that served them.
"""

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from server.errors import APIError, error_response
from server.settings import load_settings
from server.state import Status

ENGINE_OVERRIDES = {"model.cpu_bind": False}
"""Replicas share a node's cores: none binds its engine thread to cores of its own."""
REPLICA_HEADER = "x-tandem-replica"


def _replica_died(exc: BaseException) -> bool:
    """A failure of the replica or of Serve's routing, not of the request: a 503 to retry."""
    from ray.exceptions import ActorUnavailableError, RayActorError, WorkerCrashedError
    from ray.serve.exceptions import (
        BackPressureError,
        DeploymentUnavailableError,
        ReplicaUnavailableError,
    )

    gone = (RayActorError, ActorUnavailableError, WorkerCrashedError, ReplicaUnavailableError)
    return isinstance(exc, gone + (BackPressureError, DeploymentUnavailableError))


class TandemEngine:
    """One Tandem server (engine + app) per replica."""

    async def __init__(self, overrides: dict[str, Any], config: str | None = None) -> None:
        from uvicorn.config import Config
        from uvicorn.lifespan.on import LifespanOn

        from server.app import create_app

        self.settings = load_settings(config, {**ENGINE_OVERRIDES, **overrides})
        self.app = create_app(self.settings)
        self.state = self.app.state.tandem
        self.lifespan = LifespanOn(Config(self.app, lifespan="on", log_config=None))
        await self.lifespan.startup()
        while self.state.status is Status.LOADING:  # ready once the engine serves
            await asyncio.sleep(0.1)
        if self.state.status is not Status.READY:
            raise RuntimeError(f"the engine did not load: {self.state.failure}")
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.metrics = asyncio.create_task(_mirror_metrics(self.state, self.replica))

    async def check_health(self) -> None:
        problem = self.state.engine.problem() if self.state.engine is not None else "no engine"
        if problem:
            raise RuntimeError(problem)

    async def handle(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Run one HTTP request through the app; yield its ASGI messages (start, bodies).
        Closing the generator (the caller went away) is the app's client disconnect."""
        sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=64)  # backpressure
        gone = asyncio.Event()
        body = [request["body"]]

        async def receive() -> dict[str, Any]:
            if body:
                return {"type": "http.request", "body": body.pop(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await sent.put(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request["method"],
            "scheme": "http",
            "path": request["path"],
            "raw_path": request["path"].encode(),
            "query_string": request["query"].encode(),
            "root_path": "",
            "headers": [(k.encode(), v.encode()) for k, v in request["headers"]],
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 80),
        }
        app = asyncio.create_task(self.app(scope, receive, send))
        try:
            while True:
                message = await _next_message(sent, app)
                if message is None:
                    return
                if message["type"] == "http.response.start":
                    headers = [
                        *message.get("headers", []),
                        (REPLICA_HEADER.encode(), self.replica.encode()),
                    ]
                    message = {**message, "headers": headers}
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    return
        finally:
            gone.set()  # the app sees the client leave and aborts the engine request
            if not app.done():
                await asyncio.wait({app}, timeout=10)
            app.cancel()

    async def __del__(self) -> None:
        """Serve stops a replica after its in-flight requests finished (or the drain timed
        out): stop the engine."""
        await self.lifespan.shutdown()


async def _next_message(sent: asyncio.Queue, app: asyncio.Task) -> dict[str, Any] | None:
    """The app's next ASGI message, or None once the app returned without another."""
    getter = asyncio.ensure_future(sent.get())
    try:
        done, _ = await asyncio.wait({getter, app}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not getter.done():
            getter.cancel()
    if getter in done:
        return getter.result()
    app.result()  # raise what the app raised
    return None if sent.empty() else sent.get_nowait()


_MIRRORED = (
    "num_running",
    "num_waiting",
    "num_blocks_free",
    "num_blocks_total",
    "generation_tokens",
)


async def _mirror_metrics(state: Any, replica: str, period: float = 5.0) -> None:
    """Copy the engine's gauges and counters into Ray's metrics every `period` seconds."""
    from ray.util import metrics

    tags = ("replica",)
    gauges = {
        name: metrics.Gauge(f"tandem_{name}", f"Tandem engine: {name}", tag_keys=tags)
        for name in _MIRRORED
    }
    while True:
        if state.engine is not None:
            stats = state.engine.stats()
            for name, gauge in gauges.items():
                gauge.set(getattr(stats, name), tags={"replica": replica})
        await asyncio.sleep(period)


gateway = FastAPI(title="Tandem on Ray Serve", docs_url=None, redoc_url=None)


class TandemGateway:
    """The HTTP ingress: every request to an engine replica, the answer streamed back."""

    def __init__(self, engine: DeploymentHandle) -> None:
        self.engine = engine

    @gateway.api_route("/{path:path}", methods=["GET", "POST", "HEAD"])
    async def forward(self, path: str, request: Request) -> Response:
        payload = {
            "method": request.method,
            "path": "/" + path,
            "query": request.url.query,
            "headers": [(k, v) for k, v in request.headers.items() if k.lower() != "host"],
            "body": await request.body(),
        }
        stream = self.engine.options(stream=True).handle.remote(payload)
        try:
            start = await stream.__anext__()
        except Exception as exc:
            if not _replica_died(exc):
                raise
            return error_response(_replica_error(exc))
        headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
        headers.pop("content-length", None)  # the body is re-chunked
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_bodies(stream), status_code=start["status"], headers=headers)
        # A whole body (JSON) is read before answering: a replica that dies between the
        # status line and the body is then still a 503, not a 200 with nothing in it.
        try:
            body = b"".join([message.get("body", b"") async for message in stream])
        except Exception as exc:
            if not _replica_died(exc):
                raise
            return error_response(_replica_error(exc))
        return Response(body, status_code=start["status"], headers=headers)


async def _bodies(stream: Any) -> AsyncIterator[bytes]:
    finished = False
    try:
        async for message in stream:
            if message.get("body"):
                yield message["body"]
        finished = True
    except Exception as exc:
        if not _replica_died(exc):
            raise
        finished = True
        # The stream cannot turn into a status code any more: an error event ends it.
        yield f"data: {json.dumps(_replica_error(exc).body())}\n\n".encode()
    finally:
        if not finished:  # the client went away: so does the replica's request
            stream.cancel()


def _replica_error(exc: BaseException) -> APIError:
    message = (
        f"The replica serving this request stopped before it finished ({type(exc).__name__}); "
        "retry the request."
    )
    return APIError(message, 503, code="replica_unavailable", headers={"Retry-After": "1"})


def build_app(
    overrides: dict[str, Any],
    config: str | None = None,
    *,
    num_replicas: int | None = 1,
    min_replicas: int = 1,
    max_replicas: int = 1,
    target_ongoing_requests: float = 8,
    replica_cpus: float = 1,
) -> Any:
    """The Serve application: the gateway bound to the engine deployment. With
    num_replicas=None the engine deployment autoscales between min and max replicas."""
    settings = load_settings(config, {**ENGINE_OVERRIDES, **overrides})  # errors here, once
    scaling: dict[str, Any] = {"num_replicas": num_replicas}
    if num_replicas is None:
        scaling = {
            "autoscaling_config": {
                "min_replicas": min_replicas,
                "max_replicas": max_replicas,
                "target_ongoing_requests": target_ongoing_requests,
            }
        }
    engine = serve.deployment(
        TandemEngine,
        name="TandemEngine",
        max_ongoing_requests=settings.engine.scheduler.max_num_seqs
        + settings.engine.scheduler.max_waiting,
        graceful_shutdown_timeout_s=settings.server.drain_timeout,
        graceful_shutdown_wait_loop_s=1,
        health_check_period_s=5,
        ray_actor_options={
            "num_cpus": replica_cpus,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(max(1, int(replica_cpus)))}},
        },
        **scaling,
    )
    ingress = serve.deployment(
        serve.ingress(gateway)(TandemGateway),
        name="TandemGateway",
        max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(engine.bind(overrides, config))


def app_builder(args: dict[str, Any]) -> Any:
    """For `serve run` / `serve deploy` config files (docker/ray-serve.yaml): args are
    `config` (a Tandem YAML), `overrides` ({section.key: value}) and build_app's options."""
    args = dict(args)
    return build_app(args.pop("overrides", {}) or {}, args.pop("config", None), **args)


def main(argv: Sequence[str] | None = None) -> int:
    from server.cli import build_parser

    parser = argparse.ArgumentParser(prog="python -m server.ray_serve", description=__doc__)
    parser.add_argument("--num-replicas", type=int, default=None)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=None)
    parser.add_argument("--target-ongoing-requests", type=float, default=8)
    parser.add_argument("--replica-cpus", type=float, default=1)
    ours, rest = parser.parse_known_args(argv)
    tandem = vars(build_parser().parse_args(["serve", *rest]))
    config = tandem.pop("config", None)
    overrides = {k: v for k, v in tandem.items() if k not in ("command", "command_parser")}
    host = overrides.pop("server.host", "127.0.0.1")
    port = overrides.pop("server.port", 8000)
    autoscale = ours.max_replicas is not None
    try:
        app = build_app(
            overrides,
            config,
            num_replicas=None if autoscale else (ours.num_replicas or 1),
            min_replicas=ours.min_replicas,
            max_replicas=ours.max_replicas or ours.min_replicas,
            target_ongoing_requests=ours.target_ongoing_requests,
            replica_cpus=ours.replica_cpus,
        )
    except ValueError as exc:
        parser.error(str(exc))
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name="tandem", route_prefix="/")
    address = ray.get_runtime_context().gcs_address
    print(f"tandem on Ray Serve: http://{host}:{port} (ray cluster {address})", flush=True)
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    try:
        while not stopped:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    serve.shutdown()  # every replica drains (up to --drain-timeout), then stops
    return 0


if __name__ == "__main__":
    sys.exit(main())
