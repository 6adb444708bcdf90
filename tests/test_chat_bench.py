"""bench.chat_bench: llama-server's command lines (plain and with its draft-model
speculation), the counters read from a server's /metrics, the interleaved rounds, and the
lean client (bench/serving.py) against a real server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import chat_bench

pytestmark = pytest.mark.bench

TANDEM_METRICS = """\
# HELP tandem_step_seconds_total Engine step time by part
# TYPE tandem_step_seconds_total counter
tandem_step_seconds_total{part="target_forward"} 2.5
tandem_step_seconds_total{part="draft"} 0.25
"""

# As llama-server (with --metrics) writes them.
LLAMA_METRICS = """\
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 23
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 9
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 7
"""


def test_counters_read_tandems_step_parts_and_llama_servers_drafts():
    assert chat_bench.read_counters(TANDEM_METRICS) == {"target_forward": 2.5, "draft": 0.25}
    assert chat_bench.read_counters(LLAMA_METRICS) == {"drafted": 9, "accepted": 7}
    assert chat_bench.read_counters("") == {}


def test_llama_server_draft_configurations_add_the_draft_and_its_settings(monkeypatch):
    import engine.model.files

    monkeypatch.setattr(engine.model.files, "locate", lambda spec: Path("/m/target.gguf"))
    plain = chat_bench.llama_server_case("llama-server-np16", Path("/bin/ls"), 2)
    assert plain.argv[plain.argv.index("-np") + 1] == "16"
    assert "-md" not in plain.argv and "--metrics" in plain.argv
    spec = chat_bench.llama_server_case(
        "llama-server-draft-np1", Path("/bin/ls"), 2, Path("/d/draft.gguf")
    )
    assert spec.argv[spec.argv.index("-np") + 1] == "1"
    assert spec.argv[spec.argv.index("-md") + 1] == "/d/draft.gguf"
    assert spec.argv[-len(chat_bench.LLAMA_DRAFT_FLAGS) :] == chat_bench.LLAMA_DRAFT_FLAGS
    with pytest.raises(ValueError, match="--llama-draft"):
        chat_bench.llama_server_case("llama-server-draft-np16", Path("/bin/ls"), 2)


def test_llama_draft_needs_the_server(capsys):
    with pytest.raises(SystemExit):
        chat_bench.main(["--llama-draft", "/d/draft.gguf", "--configs", "off"])
    assert "--llama-draft needs --llama-server" in capsys.readouterr().err


def test_interleave_starts_every_system_once_and_reverses_the_order_every_other_round(
    monkeypatch, tmp_path
):
    started, ran, stopped = [], [], []

    class Server(chat_bench.RunningServer):
        def __init__(self, name):  # no process: a stand-in the loop can call and stop
            self.name, self.url = name, f"http://127.0.0.1/{name}"

        def stop(self):
            stopped.append(self.name)

    def start(name, args):
        started.append(name)
        return Server(name), 1.0

    async def run_level(url, prompts, level, count, args, temperature, families=None):
        if len(prompts) > 1:  # not the warm-up
            ran.append(url.rsplit("/", 1)[1])
        tps = {"off": 100.0, "draft-adaptive": 150.0}.get(url.rsplit("/", 1)[1], 50.0 + len(ran))
        return {"tokens_per_s": tps, "itl_p50_ms": 1.0, "acceptance": None, "errors": [],
                "time_split": {}, "client_cpu_ms_per_token": 0.1, "concurrency": level,
                "temperature": temperature}  # fmt: skip

    monkeypatch.setattr(chat_bench, "start", start)
    monkeypatch.setattr(chat_bench, "run_level", run_level)
    out = tmp_path / "chat.json"
    chat_bench.main(
        ["--configs", "off", "draft-adaptive", "--llama-server", "/bin/ls", "--interleave",
         "--rounds", "3", "--levels", "1", "--requests", "2", "--temperatures", "0",
         "--out", str(out)]
    )  # fmt: skip
    names = ["off", "draft-adaptive", "llama-server-np1", "llama-server-np16"]
    assert started == names and sorted(stopped) == sorted(names)
    assert ran == names + names[::-1] + names
    data = json.loads(out.read_text())
    assert data["interleaved"] is True and len(data["rows"]) == len(names)
    assert all(len(row["tokens_per_s_runs"]) == 3 for row in data["rows"])


def test_the_lean_client_reads_what_httpx_reads_from_a_real_server(tiny_dirs):
    """The lean client against a real uvicorn server: the streamed chat's deltas, usage and
    events (chunked SSE) as the unstreamed answer has them, and a 400's error body."""
    import asyncio

    import httpx

    from bench.serving import post_events
    from tests.server_helpers import serve

    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    server = serve(tiny_dirs, server__api_key=None)
    served = next(server)
    try:

        async def read():
            lean = await chat_bench.chat_one(served.url, body)
            events = [e async for e in post_events(served.url, "/v1/chat/completions", body)]
            bad = [
                e async for e in post_events(served.url, "/v1/chat/completions", body | {"n": 0})
            ]
            return lean, events, bad

        (lean, lean_usage), events, bad = asyncio.run(read())
        unstreamed = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        reference = httpx.post(served.url + "/v1/chat/completions", json=unstreamed).json()
        reference = reference["choices"][0]["message"]["content"]
    finally:
        next(server, None)
    assert lean.error is None and lean_usage["completion_tokens"] == 12
    assert lean.output_tokens == 12 and len(lean.chunks) > 0
    assert [status for status, _ in events] == [200] * len(events)
    assert events[-1][1] == "[DONE]"
    streamed = "".join(
        c["delta"].get("content") or ""
        for _, data in events[:-1]
        for c in json.loads(data)["choices"]
    )
    assert streamed == reference
    ((status, error),) = bad
    assert status == 400 and json.loads(error)["error"]["param"] == "n"
