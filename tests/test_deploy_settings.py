"""Configuring a container: TANDEM_* variables between the YAML file and the flags."""

from __future__ import annotations

import pytest
import yaml

from server.cli import build_parser
from server.options import BY_KEY, OPTIONS
from server.settings import DEFAULT_CONFIG, load_settings, read_yaml

CONTAINER_VARIABLES = {
    "TANDEM_MODEL": "model.path",
    "TANDEM_DRAFT_MODEL": "speculative.draft_model",
    "TANDEM_HOST": "server.host",
    "TANDEM_PORT": "server.port",
    "TANDEM_API_KEY": "server.api_key",
    "TANDEM_DEVICE": "model.device",
    "TANDEM_SPECULATIVE_METHOD": "speculative.method",
    "TANDEM_DRAIN_TIMEOUT": "server.drain_timeout",
}


def _flags(*argv: str) -> dict:
    args = vars(build_parser().parse_args(["serve", *argv]))
    return {key: value for key, value in args.items() if "." in key}


@pytest.fixture
def config(tiny_dirs, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(tiny_dirs["llama"]), "device": "cpu"},
                "speculative": {"method": "ngram"},
                "server": {"host": "127.0.0.1", "port": 9000, "drain_timeout": 12},
            }
        )
    )
    return path


def test_every_flag_has_a_variable_named_after_it():
    for name, key in CONTAINER_VARIABLES.items():
        assert BY_KEY[key].env == name
    for option in OPTIONS:
        if option.flag is not None:
            assert option.env == "TANDEM_" + option.flag[2:].upper().replace("-", "_")


def test_environment_overrides_yaml_and_flags_override_both(config, tiny_dirs):
    environ = {
        "TANDEM_MODEL": str(tiny_dirs["qwen2"]),
        "TANDEM_DRAFT_MODEL": str(tiny_dirs["llama_draft"]),
        "TANDEM_SPECULATIVE_METHOD": "draft",
        "TANDEM_HOST": "0.0.0.0",
        "TANDEM_PORT": "8123",
        "TANDEM_API_KEY": "from-env",
        "TANDEM_DEVICE": "auto",
        "TANDEM_DRAIN_TIMEOUT": "45",
    }
    settings = load_settings(str(config), environ=environ)
    assert settings.model_path == str(tiny_dirs["qwen2"])
    assert settings.engine.spec.method == "draft"
    assert settings.engine.spec.draft_model == str(tiny_dirs["llama_draft"])
    assert settings.engine.model.device == "auto"
    server = settings.server
    assert (server.host, server.port, server.api_key) == ("0.0.0.0", 8123, "from-env")
    assert server.drain_timeout == 45.0

    flags = _flags("--port", "8200", "--drain-timeout", "5", "--speculative-method", "off")
    flagged = load_settings(str(config), flags, environ=environ)
    assert flagged.server.port == 8200 and flagged.server.drain_timeout == 5.0
    assert flagged.engine.spec.method == "off"
    assert flagged.server.host == "0.0.0.0"  # no flag: the environment still counts


def test_tandem_config_names_the_file_unless_the_flag_does(config, tmp_path, tiny_dirs):
    assert load_settings(None, environ={"TANDEM_CONFIG": str(config)}).server.port == 9000
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"model": {"path": str(tiny_dirs["llama"])}}))
    chosen = load_settings(str(other), environ={"TANDEM_CONFIG": str(config)})
    assert chosen.server.port == 8000 and chosen.server.drain_timeout == 30.0


def test_empty_variables_count_as_unset(config):
    # compose passes `${TANDEM_X:-}` through as an empty string.
    environ = {"TANDEM_PORT": "", "TANDEM_SPECULATIVE_METHOD": "", "TANDEM_CONFIG": ""}
    settings = load_settings(str(config), environ=environ)
    assert settings.server.port == 9000 and settings.engine.spec.method == "ngram"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"TANDEM_PORT": "http"}, r"\$TANDEM_PORT: invalid value 'http' for --port"),
        ({"TANDEM_DEVICE": "tpu"}, r"\$TANDEM_DEVICE must be one of auto, cpu, cuda"),
        ({"TANDEM_DRAIN_TIMEOUT": "-1"}, "--drain-timeout must be between 0 and 86400"),
        (
            {"TANDEM_MODEL": "/no/such/dir"},
            "--model: no model directory or GGUF file at /no/such/dir",
        ),
    ],
)
def test_bad_variables_say_what_to_change(config, environ, message):
    with pytest.raises(ValueError, match=message):
        load_settings(str(config), environ=environ)


def test_default_config_sets_a_drain_timeout():
    assert read_yaml(DEFAULT_CONFIG)["server.drain_timeout"] == 30.0
