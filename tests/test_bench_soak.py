"""bench.soak: its verdict on a summary (each check can fail it), its exit code, and a few
seconds of its mixed load against a real server on the tiny models, where a server that
answers 503s fails it."""

from __future__ import annotations

import copy
import json
import os
from contextlib import contextmanager

import pytest

from bench import soak
from tests.server_helpers import serve

pytestmark = pytest.mark.bench

CLEAN = {
    "requests": 40, "walk_aways_drawn": 8, "outcomes": {"left": 7, "status 200": 33},
    "errors": [], "running": 0, "waiting": 0, "blocks_total": 192, "blocks_in_use": 0,
    "samples": {"start": {"rss_mib": 500.0, "fds": 20}, "warm": {"rss_mib": 600.0, "fds": 28},
                "end": {"rss_mib": 629.0, "fds": 20}},
}  # fmt: skip


def _with(path: str, value) -> dict:
    summary = copy.deepcopy(CLEAN)
    *keys, last = path.split(".")
    target = summary
    for key in keys:
        target = target[key]
    target[last] = value
    return summary


@pytest.mark.parametrize(
    ("path", "value", "failure"),
    [
        ("outcomes.status 503", 1, "1 x status 503"),
        ("outcomes.status 500", 2, "2 x status 500"),
        ("outcomes.error", 1, "1 x error"),
        ("outcomes.status 200", 0, "no request was answered"),
        ("blocks_in_use", 1, "1 KV blocks still in use at the end"),
        ("running", 1, "not idle: 1 running, 0 waiting"),
        ("samples.end.rss_mib", 631.0, "RSS 631.0 MiB at the end, over 5% above 600.0"),
        ("samples.end.fds", 21, "21 open fds at the end, 20 at the start"),
    ],
)
def test_the_verdict_fails_each_broken_promise(path, value, failure):
    assert soak.verdict(CLEAN) == []
    assert soak.verdict(_with(path, value)) == [failure]
    assert soak.verdict(_with("outcomes.status 400", 3)) == []  # a 4xx is not the server's fault


def test_the_exit_code_follows_the_verdict(monkeypatch, capsys):
    args = ["--url", "http://127.0.0.1:1", "--pid", "1"]
    monkeypatch.setattr(soak, "soak", lambda *_: CLEAN)
    assert soak.main(args) == 0 and capsys.readouterr().out.endswith("PASS\n")
    monkeypatch.setattr(soak, "soak", lambda *_: _with("blocks_in_use", 3))
    assert soak.main(args) == 1
    assert "FAIL: 3 KV blocks still in use" in capsys.readouterr().out
    with pytest.raises(ValueError, match="must point at this machine"):
        soak.main(["--url", "http://10.0.0.1:8000", "--pid", "1"])
    with pytest.raises(SystemExit):
        soak.main(["--url", "http://127.0.0.1:8000"])  # RSS and fds need the server's pid


def _run(url: str, capsys, *extra: str) -> tuple[int, dict]:
    code = soak.main(["--url", url, "--pid", str(os.getpid()), "--minutes", "0.08",
                      "--warmup-minutes", "0.02", "--every", "1", "--clients", "4",
                      "--max-tokens", "12", "--max-prompt-chars", "60", "--idle-timeout", "10",
                      "--walk-away", "0.3", *extra])  # fmt: skip
    out = capsys.readouterr().out
    return code, json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))


def test_a_short_soak_on_the_tiny_models(tiny_dirs, capsys):
    with contextmanager(serve)(tiny_dirs, server__api_key=None) as served:
        code, summary = _run(served.url, capsys)
        outcomes = summary["outcomes"]
        assert summary["requests"] >= 8 and summary["walk_aways_drawn"] >= 1
        assert outcomes["left"] >= 1 and outcomes["status 200"] >= 4, outcomes
        assert set(outcomes) <= {"left", "status 200"}, (outcomes, summary["errors"])
        assert summary["blocks_in_use"] == 0 and summary["blocks_total"] == 192
        assert {"start", "warm", "end"} <= set(summary["samples"])
        assert code == (1 if soak.verdict(summary) else 0)
        served.wait_idle()
    # Room for one request at a time: the others are refused with 503, and the soak fails.
    busy = {"scheduler__max_waiting": 1, "scheduler__max_num_seqs": 1}
    with contextmanager(serve)(tiny_dirs, server__api_key=None, **busy) as served:
        code, summary = _run(served.url, capsys, "--clients", "6")
        assert summary["outcomes"].get("status 503", 0) >= 1, summary["outcomes"]
        assert code == 1
