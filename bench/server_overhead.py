"""The server's own CPU per streamed chunk, with the model taken out.

  python -m bench.server_overhead                        # c=1 and c=16, chat, streamed
  python -m bench.server_overhead --levels 1 --requests 16 --step-ms 0.2 5 20

A real `tandem` app under uvicorn on 127.0.0.1 (a child process) serves the default model's
tokenizer and chat template, but its engine is a stand-in: the real AsyncEngine (engine
thread, inbox, outputs handed to the event loop) around a paced engine whose step sleeps
--step-ms and then gives every running request one token of a fixed English text. The
child's CPU time (all its threads, from /proc) over a run of streamed /v1/chat/completions
requests, divided by the chunks it streamed, is what the HTTP side costs per token: the
chunk, the SSE frame, the detokenizer, the socket write, and per request the chat template,
tokenizing and routing. On a machine whose cores all run the model's kernels, that CPU is
taken from them. The event loop's share (the main thread) and the engine thread's (its step
loop around the stand-in: inbox, stats snapshot, handing outputs over) are printed apart.

Each --step-ms starts its own child; --model takes another Hugging Face directory or GGUF
file (its tokenizer and chat template are all that is used).

`--app raw` serves the same load from the floor under the app: the same uvicorn, engine
thread and hand-over to the event loop, but a bare ASGI handler that streams one SSE frame
per output (a small chat chunk from `json.dumps`), with no FastAPI routing or middleware, no
validation, chat template, detokenizer or sse-starlette. What Tandem's app costs above that
floor is what its own code could still save.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.chat_prompts import bench_messages
from bench.loadgen import check_loopback

ROOT = Path(__file__).resolve().parent.parent
TEXT = (
    "The sea was calm that morning, and the light came in low over the water. We walked "
    "along the harbour wall, talking about nothing in particular, while the boats went out "
    "one by one. By noon the wind had turned, and the first clouds gathered in the west."
)


class PacedEngine:
    """Enough of LLMEngine for AsyncEngine: each step sleeps, then one token per request."""

    def __init__(self, tokens: list[int], step_seconds: float, max_model_len: int) -> None:
        from engine.types.stats import EngineStats

        self.tokens = tokens
        self.step_seconds = step_seconds
        self.max_model_len = max_model_len
        self.vocab_size = 49152
        self.eos_token_ids = (0,)
        self.cpu_isa = None
        self.device = None
        self.config = _Config()
        self.grammars = None
        self.running: dict[str, list] = {}  # id -> [prompt length, made, max_tokens]
        self.thread_id = 0
        self._stats = EngineStats(num_blocks_total=1024, num_blocks_free=1024)

    def validate(self, prompt_token_ids, params) -> None:
        pass

    def enqueue(self, request_id, prompt_token_ids, params) -> None:
        self.running[request_id] = [len(prompt_token_ids), 0, params.max_tokens]

    def abort(self, request_id):
        from engine.types.outputs import RequestOutput

        if self.running.pop(request_id, None) is None:
            return None
        return RequestOutput(request_id, [], finished=True, finish_reason="abort")

    def has_work(self) -> bool:
        return bool(self.running)

    def step(self):
        from engine.types.outputs import RequestOutput

        self.thread_id = threading.get_native_id()  # the engine thread's, for the parent
        time.sleep(self.step_seconds)
        outputs = []
        for rid, state in list(self.running.items()):
            prompt, made, limit = state
            token = self.tokens[made % len(self.tokens)]
            state[1] = made = made + 1
            done = made >= limit
            if done:
                del self.running[rid]
            outputs.append(
                RequestOutput(
                    rid, [token], finished=done, finish_reason="length" if done else None,
                    num_prompt_tokens=prompt, num_output_tokens=made,
                )
            )  # fmt: skip
        return outputs

    def stats(self):
        self._stats.num_running = len(self.running)
        return self._stats

    def fail_all(self, message: str):
        return [self.abort(rid) for rid in list(self.running)]

    def check_invariants(self) -> None:
        pass


class _Config:
    class scheduler:  # noqa: N801
        max_waiting = 1024

    class model:  # noqa: N801
        cpu_bind = False
        device = "cpu"


def serve(port: int, step_ms: float, model: str | None) -> None:
    """The child: the app on the paced engine."""
    import uvicorn
    from transformers import AutoTokenizer

    from engine import prepare_config
    from engine.core.async_engine import AsyncEngine
    from server.app import create_app
    from server.settings import load_settings

    overrides = {
        "speculative.method": "off", "server.log_level": "warning",
        "server.served_model_name": "default",
    }  # fmt: skip
    if model:
        overrides["model.path"] = model
    settings = load_settings(None, overrides, environ={})
    model_dir = prepare_config(settings.engine).model.model
    tokens = AutoTokenizer.from_pretrained(model_dir).encode(TEXT)
    paced = PacedEngine(tokens, step_ms / 1000, 8192)
    app = create_app(settings, AsyncEngine(paced))
    app.get("/bench/engine-thread")(lambda: {"id": paced.thread_id})
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_raw(port: int, step_ms: float) -> None:
    """The child of `--app raw`: a bare ASGI handler on the paced engine (see the docstring)."""
    import uvicorn

    from engine.core.async_engine import AsyncEngine
    from engine.types.request import SamplingParams

    paced = PacedEngine(list(range(100, 164)), step_ms / 1000, 8192)
    engine, ids = AsyncEngine(paced), itertools.count()
    words = [f" w{i}" for i in range(64)]

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    engine.start()
                    await send({"type": "lifespan.startup.complete"})
                else:
                    engine.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        if scope["path"] != "/v1/chat/completions":
            answer = {"id": paced.thread_id} if scope["path"] == "/bench/engine-thread" else {}
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": json.dumps(answer).encode()})
            return
        rid = f"raw-{next(ids)}"
        params = SamplingParams(max_tokens=json.loads(body)["max_tokens"], ignore_eos=True)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        async for out in engine.generate(rid, paced.tokens[:32], params):
            for token in out.new_token_ids:
                chunk = {
                    "id": rid, "object": "chat.completion.chunk", "created": 0,
                    "model": "default", "choices": [{"index": 0, "delta":
                    {"content": words[token % 64]}, "finish_reason": None}],
                }  # fmt: skip
                frame = b"data: " + json.dumps(chunk).encode() + b"\n\n"
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _cpu_seconds(pid: int, engine_tid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the process's threads: the event loop (the main
    thread), the engine thread, and the others summed."""
    out = {"loop": 0.0, "engine": 0.0, "other": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        tid = int(task.name)
        kind = "loop" if tid == pid else "engine" if tid == engine_tid else "other"
        out[kind] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


async def _chat(client: httpx.AsyncClient, url: str, messages, max_tokens: int) -> int:
    body = {
        "model": "default", "messages": messages, "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    chunks = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                choices = json.loads(line[5:])["choices"]
                chunks += bool(choices and choices[0]["delta"].get("content"))
    return chunks


async def _load(url: str, level: int, requests: int, max_tokens: int) -> int:
    messages = bench_messages(requests)
    gate = asyncio.Semaphore(level)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:

        async def one(m) -> int:
            async with gate:
                return await _chat(client, url, m, max_tokens)

        return sum(await asyncio.gather(*(one(m) for m in messages)))


def measure(args: argparse.Namespace, step_ms: float, app: str = "tandem") -> list[dict]:
    """One child serving `app` at `step_ms`; a row per level."""
    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "bench.server_overhead", "--serve", "--port",
               str(args.port), "--step-ms", str(step_ms), "--app", app]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    child = subprocess.Popen(command, cwd=ROOT)
    rows = []
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if child.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        asyncio.run(_load(url, 1, 2, 16))  # warm-up
        tid = httpx.get(url + "/bench/engine-thread").json()["id"]
        for level, count in zip(args.levels, args.requests, strict=True):
            before, start = _cpu_seconds(child.pid, tid), time.perf_counter()
            chunks = asyncio.run(_load(url, level, count, args.max_tokens))
            wall = time.perf_counter() - start
            cpu = _delta(_cpu_seconds(child.pid, tid), before)
            rows.append({
                "app": app, "step_ms": step_ms, "level": level, "requests": count, "chunks": chunks,
                "wall_s": wall, **{f"{k}_ms": v / chunks * 1e3 for k, v in cpu.items()},
            })  # fmt: skip
    finally:
        child.terminate()
        child.wait(timeout=30)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, nargs="+", default=[16, 48], help="one per level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--step-ms", type=float, nargs="+", default=[5.0],
                   help="the stand-in engine's step (one child each)")  # fmt: skip
    p.add_argument("--model", default=None, help="tokenizer source (default: the served model)")
    p.add_argument("--port", type=int, default=8311)
    p.add_argument("--app", nargs="+", choices=["tandem", "raw"], default=["tandem"],
                   help="Tandem's app, and/or the bare ASGI floor (one child each)")  # fmt: skip
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        if args.app[0] == "raw":
            serve_raw(args.port, args.step_ms[0])
        else:
            serve(args.port, args.step_ms[0], args.model)
        return
    check_loopback(f"http://127.0.0.1:{args.port}")
    print(
        "| app | engine step | c | requests | chunks | wall | CPU per chunk: event loop | "
        "engine thread | other threads |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for step_ms, app in itertools.product(args.step_ms, args.app):
        for r in measure(args, step_ms, app):
            print(
                f"| {r['app']} | {r['step_ms']:g} ms | {r['level']} | {r['requests']} | "
                f"{r['chunks']} | "
                f"{r['wall_s']:.2f} s | {r['loop_ms']:.3f} ms | {r['engine_ms']:.3f} ms | "
                f"{r['other_ms']:.3f} ms |",
                flush=True,
            )


if __name__ == "__main__":
    main()
