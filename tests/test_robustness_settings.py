"""The admission limits: --max-request-tokens and --request-timeout from flags, env and YAML."""

from __future__ import annotations

import pytest
import yaml

from server.cli import build_parser
from server.settings import load_settings


def _flags(*argv: str) -> dict:
    args = vars(build_parser().parse_args(["serve", *argv]))
    return {key: value for key, value in args.items() if "." in key}


def _settings(tiny_dirs, overrides: dict | None = None, environ: dict | None = None):
    base = {"model.path": str(tiny_dirs["llama"]), "speculative.method": "off"}
    return load_settings(None, {**base, **(overrides or {})}, environ=environ or {})


def test_defaults(tiny_dirs):
    server = _settings(tiny_dirs).server
    assert server.max_request_tokens is None  # auto: 8 x max_model_len, resolved at load
    assert server.request_timeout == 600


def test_flags_and_environment(tiny_dirs):
    flags = _flags("--max-request-tokens", "4096", "--request-timeout", "off")
    server = _settings(tiny_dirs, flags).server
    assert server.max_request_tokens == 4096 and server.request_timeout is None
    flags = _flags("--max-request-tokens", "auto", "--request-timeout", "2.5")
    server = _settings(tiny_dirs, flags).server
    assert server.max_request_tokens is None and server.request_timeout == 2.5
    env = {"TANDEM_REQUEST_TIMEOUT": "30", "TANDEM_MAX_REQUEST_TOKENS": "100"}
    server = _settings(tiny_dirs, environ=env).server
    assert server.request_timeout == 30 and server.max_request_tokens == 100


def test_yaml_null_turns_the_timeout_off(tiny_dirs, tmp_path):
    config = tmp_path / "c.yaml"
    body = {
        "model": {"path": str(tiny_dirs["llama"])},
        "speculative": {"method": "off"},
        "server": {"request_timeout": None, "max_request_tokens": "auto"},
    }
    config.write_text(yaml.safe_dump(body))
    server = load_settings(str(config), environ={}).server
    assert server.request_timeout is None and server.max_request_tokens is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"server.request_timeout": 0.0}, "--request-timeout must be between 0 and 86400"),
        ({"server.request_timeout": -1.0}, "--request-timeout must be between 0 and 86400"),
        ({"server.max_request_tokens": 1}, "--max-request-tokens must be at least 2"),
    ],
)
def test_bad_values_name_the_flag(tiny_dirs, overrides, message):
    with pytest.raises(ValueError, match=message):
        _settings(tiny_dirs, overrides)
