"""bench.chat_bench's peers: llama-server's command lines (plain and with its draft-model
speculation), the counters read from a server's /metrics, and the report's peer rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import chat_bench
from bench.report import CHAT_CONFIGS, chat_section

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


def _row(config, level, tps, drafted=0, accepted=0):
    return {
        "config": config, "concurrency": level, "temperature": 0.0, "tokens_per_s": tps,
        "itl_p50_ms": 5.0, "drafted_tokens": drafted, "accepted_tokens": accepted,
        "acceptance": accepted / drafted if drafted else None,
    }  # fmt: skip


def test_report_takes_the_new_peers_as_peers_and_says_how_they_ran(tmp_path):
    assert set(chat_bench.LLAMA_DRAFT_SLOTS) <= set(CHAT_CONFIGS)
    rows = [
        _row("off", 1, 100.0),
        _row("draft-adaptive", 1, 120.0, 50, 25),
        _row("llama-server-np1", 1, 80.0),
        _row("llama-server-draft-np1", 1, 90.0, 40, 10),
        _row("hf-generate", 1, 40.0),
    ]
    data = {"rows": rows, "max_tokens": 128, "command": "python -m bench.chat_bench",
            "machine": {"date": "2026-11-27", "cpu": "test cpu", "cores": 2}}  # fmt: skip
    text = "\n".join(chat_section(data, tmp_path / "p.png"))
    assert "- c=1, T=0: 120.0 against 90.0 tok/s (**1.33x**)" in text  # the fastest peer
    assert "draft-model speculation (`models/draft`" in text
    label = "peer: llama.cpp `llama-server`, draft-model speculation, 1 slot"
    assert f"| {label} | 90.0 | 0.90x | 0.25 |" in text
    assert "transformers' `generate()` on that float32 directory" in text
    assert f"| {CHAT_CONFIGS['hf-generate']} | 40.0 | 0.40x |" in text


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

    async def run_level(url, prompts, level, count, args, temperature):
        if len(prompts) > 1:  # not the warm-up
            ran.append(url.rsplit("/", 1)[1])
        tps = {"off": 100.0, "draft-adaptive": 150.0}.get(url.rsplit("/", 1)[1], 50.0 + len(ran))
        return {"tokens_per_s": tps, "itl_p50_ms": 1.0, "acceptance": None, "errors": [],
                "time_split": {}, "client_cpu_ms_per_token": 0.1, "concurrency": level,
                "temperature": temperature, "client": args.client}  # fmt: skip

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
    assert data["interleaved"] is True
    for row in data["rows"]:  # the probe's readings around each level (None on one core)
        assert len(row["core_round_trip_ns"]) == 2
    text = "\n".join(chat_section(data, tmp_path / "p.png"))
    # A peer makes 50 + its place in the run: the fastest peer of each round is the one that
    # ran last in it (np16 at 54, np1 at 56, np16 at 62), against the default's 150.
    assert "round by round 2.78x, 2.68x, 2.42x (median 2.68x)" in text
    assert "every system started at once" in text and "bench/sse_client.py" in text


def test_hf_generate_runs_the_chat_prompts_to_their_natural_stops(tiny_dirs):
    import argparse

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    greedy = chat_bench.hf_settings(tokenizer, 6, 0.0)
    assert greedy["do_sample"] is False and "min_new_tokens" not in greedy  # stops at EOS
    sampled = chat_bench.hf_settings(tokenizer, 6, 0.7)
    assert sampled["temperature"] == 0.7 and sampled["top_k"] == 0 and sampled["top_p"] == 1.0
    prompts = [[{"role": "user", "content": "hello there"}], [{"role": "user", "content": "hi"}]]
    args = argparse.Namespace(max_tokens=6)
    for level, count in ((1, 3), (2, 4)):
        row = chat_bench.hf_level((model, tokenizer), prompts, level, count, args, 0.7)
        assert row["requests"] == count and row["failed"] == 0
        assert 0 < row["output_tokens"] <= 6 * count and row["tokens_per_s"] > 0
        assert row["concurrency"] == level and row["acceptance"] is None


def test_a_stream_without_usage_is_counted_by_the_models_tokenizer(tiny_dirs, monkeypatch):
    import asyncio
    import json

    import httpx

    import engine.model.files

    def sse(*events):
        return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def delta(text):
        return {"choices": [{"delta": {"content": text}}]}

    bodies = {
        "/a/v1/chat/completions": sse(delta("hello"), delta(" there")),  # llama-cpp-python
        "/b/v1/chat/completions": sse(
            delta("hi"), {"choices": [], "usage": {"completion_tokens": 7}}
        ),
    }

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=bodies[request.url.path])

    async def both():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return [await chat_bench.chat_one(client, f"http://x/{k}", {}) for k in "ab"]

    results = asyncio.run(both())
    (plain, plain_usage), (served, served_usage) = results
    assert plain_usage == {"streamed_text": "hello there"} and len(plain.chunks) == 2
    assert served_usage == {"completion_tokens": 7} and served.output_tokens == 7
    monkeypatch.setattr(engine.model.files, "prepare", lambda spec: str(tiny_dirs["llama"]))
    assert chat_bench.count_streamed_tokens(results)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    assert plain.output_tokens == len(
        tokenizer("hello there", add_special_tokens=False)["input_ids"]
    )
    assert served.output_tokens == 7  # the server's own count stands
    assert not chat_bench.count_streamed_tokens([(served, served_usage)])


def test_llama_cpp_python_serves_the_gguf_under_the_benchmarks_model_name(monkeypatch):
    import engine.model.files

    monkeypatch.setattr(engine.model.files, "locate", lambda spec: Path("/m/target.gguf"))
    case = chat_bench.llama_cpp_python_case(2)
    assert case.argv[case.argv.index("--model") + 1] == "/m/target.gguf"
    assert case.argv[case.argv.index("--model_alias") + 1] == chat_bench.MODEL
    assert case.argv[case.argv.index("--n_threads") + 1] == "2"
    # by default a new request ends the one streaming: under load, answers would be cut short
    assert case.argv[case.argv.index("--interrupt_requests") + 1] == "False"
    assert case.config in CHAT_CONFIGS


def test_the_lean_client_reads_what_httpx_reads_from_a_real_server(tiny_dirs):
    """bench/sse_client.py against a real uvicorn server: the same deltas, usage and events
    as httpx for a streamed chat (chunked SSE), and a 400's error body (Content-Length)."""
    import asyncio

    import httpx

    from bench.sse_client import post_events
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
            lean = await chat_bench.chat_one(None, served.url, body)
            async with httpx.AsyncClient(timeout=30) as client:
                plain = await chat_bench.chat_one(client, served.url, body)
            events = [e async for e in post_events(served.url, "/v1/chat/completions", body)]
            bad = [
                e async for e in post_events(served.url, "/v1/chat/completions", body | {"n": 0})
            ]
            return lean, plain, events, bad

        (lean, lean_usage), (plain, plain_usage), events, bad = asyncio.run(read())
        unstreamed = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        reference = httpx.post(served.url + "/v1/chat/completions", json=unstreamed).json()
        reference = reference["choices"][0]["message"]["content"]
    finally:
        next(server, None)
    assert lean.error is None and plain.error is None
    for key in ("completion_tokens", "prompt_tokens", "speculative"):
        assert lean_usage[key] == plain_usage[key]
    assert lean.output_tokens == plain.output_tokens == 12
    assert len(lean.chunks) == len(plain.chunks) > 0
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
