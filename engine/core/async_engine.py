"""AsyncEngine: the LLMEngine step loop on its own thread, results to asyncio queues.

`from_config` builds the engine on the thread that runs its steps, so one OpenMP pool serves
every pass (a second pool makes libgomp stop its workers spinning)."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.core.client import EngineClient
from engine.core.engine import LLMEngine, QueueFullError
from engine.cpu import affinity as cpu_affinity
from engine.model.runner import resolve_device
from engine.types.outputs import RequestOutput
from engine.types.request import GrammarSpec, SamplingParams
from engine.types.stats import EngineStats

logger = logging.getLogger(__name__)

STALL_SECONDS = 120.0  # a step that has not returned after this long counts as hung


class AsyncEngine(EngineClient):
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.eos_token_ids = engine.eos_token_ids
        self.cpu_isa = engine.cpu_isa
        self._inbox: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._step_lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Admission counts requests no snapshot has reported; one writer per counter.
        self._num_submitted = 0
        self._num_published = 0
        self._stats = EngineStats()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.stall_seconds = STALL_SECONDS
        self._step_started: float | None = None
        self._died: str | None = None
        self.cores: set[int] | None = None  # the engine thread's (--cpu-bind); None: unbound
        self._go: threading.Event | None = None  # set by `start()`: from_config's thread runs

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Build the engine on the thread that will run its steps; raises what building raised."""
        built: queue.SimpleQueue[AsyncEngine | BaseException] = queue.SimpleQueue()
        go = threading.Event()

        def body() -> None:
            cores = _cores_for(config)
            if cores is not None:  # before loading: the OpenMP workers it creates inherit them
                os.sched_setaffinity(0, cores)
            try:
                engine = cls(LLMEngine(config))
            except BaseException as exc:
                built.put(exc)
                return
            engine._thread, engine.cores = threading.current_thread(), cores
            built.put(engine)
            go.wait()
            if not engine._stop.is_set():
                engine._run()

        thread = threading.Thread(target=body, name="tandem-engine", daemon=True)
        thread.start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        result._go = go
        return result

    def start(self) -> None:
        if self._go is not None:  # built by from_config: its thread is waiting for this
            self._go.set()
            self._go = None
            return
        if self._thread is not None:
            return
        self._stop.clear()
        self.cores = _cores_for(self.engine.config, self.engine.device)
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._go is not None:  # built but never started: let its thread end
            self._go.set()
            self._go = None
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def spare_cores(self) -> set[int] | None:
        return cpu_affinity.others(self.cores) if self.cores else None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def problem(self) -> str | None:
        if self._died is not None:
            return f"the engine thread stopped: {self._died}"
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            return "the engine thread stopped"
        started = self._step_started
        if started is not None and time.monotonic() - started > self.stall_seconds:
            return f"an engine step has not returned for {time.monotonic() - started:.0f} s"
        return None

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        # Reads only settings fixed at start-up: safe from the caller's thread.
        self.engine.validate(prompt_token_ids, params)

    def check_grammar(self, spec: GrammarSpec) -> None:
        # The compiled-grammar cache takes a lock: safe from any thread.
        self.engine.grammars.check(spec)

    def admit(self, count: int) -> None:
        published = self._num_published  # read first: the snapshot is then at least as new
        waiting = self._stats.num_waiting + self._num_submitted - published
        if waiting + count > self.engine.config.scheduler.max_waiting:
            raise QueueFullError(f"{waiting} requests are already waiting")

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        self.engine.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.admit(1)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = (loop, outputs)
        self._num_submitted += 1
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params))
        self._wake.set()
        return self._stream(request_id, outputs)

    async def _stream(
        self, request_id: str, outputs: asyncio.Queue[RequestOutput]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        """A snapshot published by the engine thread after every step."""
        return self._stats

    def check_invariants(self) -> None:
        with self._step_lock:
            self.engine.check_invariants()

    def _run(self) -> None:
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)  # this thread only; its OpenMP workers inherit
            logger.info("engine thread bound to cores %s", sorted(self.cores))
        try:
            self._loop()
        except Exception as exc:  # outside a step's own handling: scheduler or bookkeeping code
            logger.exception("the engine thread stopped")
            self._died = f"{type(exc).__name__}: {exc}"
            message = "internal error: the engine stopped"
        else:
            message = "the server is shutting down"
        with self._step_lock:  # fail whatever is left so no client waits forever
            try:
                outputs = self.engine.fail_all(message)
            except Exception:
                logger.exception("failing the remaining requests")
                outputs = [_error_output(rid, message) for rid in list(self._streams)]
        self._publish(outputs)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._step_lock:
                outputs, num_taken = self._drain_inbox()
                if self.engine.has_work():
                    self._step_started = time.monotonic()
                    stepped = self.engine.step()
                    self._step_started = None
                    # Aborts that came during the step win over its tokens (timed out, client gone).
                    late, late_taken = self._drain_inbox()
                    aborted = {out.request_id for out in late if out.finished}
                    outputs += [o for o in stepped if o.finished or o.request_id not in aborted]
                    outputs += late
                    num_taken += late_taken
                self._stats = self.engine.stats().snapshot()
                self._num_published += num_taken
            self._publish(outputs)
            if outputs:
                # Let the woken event loop run between passes, not preempt a kernel thread.
                os.sched_yield()
            if not self.engine.has_work() and self._inbox.empty():
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _drain_inbox(self) -> tuple[list[RequestOutput], int]:
        """Apply queued adds and aborts: (outputs for the clients, requests taken)."""
        outputs: list[RequestOutput] = []
        num_taken = 0
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return outputs, num_taken
            if isinstance(item, _Add):
                num_taken += 1
                if item.request_id not in self._streams:
                    continue  # the client went away before the engine saw it
                try:
                    # generate() validated and admitted it; only a reused id can fail here.
                    self.engine.enqueue(item.request_id, item.prompt_token_ids, item.params)
                except ValueError as exc:
                    outputs.append(_error_output(item.request_id, str(exc)))
            elif isinstance(item, _Abort):
                out = self.engine.abort(item.request_id)
                if out is not None:
                    outputs.append(out)
            else:
                raise TypeError(f"unknown engine message {item!r}")

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:  # dropped here too: no reader may ever come to drop it
                stream = self._streams.pop(out.request_id, None)
            else:
                stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            loop, q = stream
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:  # the client's event loop is closed
                pass


@dataclass(frozen=True)
class _Add:
    """Inbox message: a request `generate()` validated and admitted."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    """Inbox message: stop a request (its client left, or it was cancelled)."""

    request_id: str


def _cores_for(config: EngineConfig, device: torch.device | None = None) -> set[int] | None:
    """The cores the engine thread binds to (--cpu-bind), or None to leave it unbound."""
    if not config.model.cpu_bind or not hasattr(os, "sched_setaffinity"):  # or not Linux
        return None
    if (device or resolve_device(config.model.device)).type != "cpu":
        return None
    return cpu_affinity.engine_cores(torch.get_num_threads(), os.sched_getaffinity(0))


def _error_output(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        finished=True,
        finish_reason="error",
        error=message,
    )
