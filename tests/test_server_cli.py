"""`tandem serve` as a user runs it: help, bad values, and a real start and stop."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from tests.deploy_helpers import free_port
from tests.server_helpers import wait_healthy

REQUIRED_FLAGS = (
    "--config --model --draft-model --speculative-method --max-draft-tokens --draft-length "
    "--host --port --device --dtype --block-size --kv-cache-blocks --max-num-seqs "
    "--max-num-batched-tokens --max-model-len --max-waiting --served-model-name --api-key "
    "--log-level --seed --gpu-memory-utilization"
).split()


def _tandem(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "server", *args], capture_output=True, text=True, timeout=60
    )


def test_help_lists_every_flag():
    result = _tandem("serve", "--help")
    assert result.returncode == 0
    for flag in REQUIRED_FLAGS:
        assert f"{flag} " in result.stdout or f"{flag}\n" in result.stdout, flag
    assert "TANDEM_API_KEY" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--block-size", "big"], "argument --block-size: invalid int value: 'big'"),
        (["--block-size", "0"], "--block-size must be between 1 and 256 (got 0)"),
        (["--max-draft-tokens", "40"], "--max-draft-tokens must be between 0 and 16 (got 40)"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--port", "70000"], "--port must be between 0 and 65535"),
        (["--model", "/no/such/dir"], "--model: no model directory or GGUF file at /no/such/dir"),
    ],
)
def test_bad_flag_values_exit_with_a_clear_message(tiny_dirs, args, message):
    base = ["serve", "--model", str(tiny_dirs["llama"]), "--speculative-method", "off"]
    result = _tandem(*base, *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_starts_answers_and_stops_cleanly(tiny_dirs):
    port = free_port()
    args = [
        "serve", "--model", str(tiny_dirs["llama"]), "--speculative-method", "ngram",
        "--block-size", "4", "--kv-cache-blocks", "64", "--port", str(port),
        "--served-model-name", "cli", "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def alive() -> None:
            assert proc.poll() is None, proc.stdout.read().decode()

        wait_healthy(url, 60, alive, interval=0.1)
        body = {"model": "cli", "prompt": "def", "max_tokens": 3, "ignore_eos": True}
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
        assert out["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    assert "Traceback" not in proc.stdout.read().decode()
