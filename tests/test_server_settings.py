"""Settings: YAML < environment < flags, resolved paths, errors that name the key."""

from __future__ import annotations

import sys

import pytest
import yaml

from server.cli import build_parser
from server.options import OPTIONS
from server.settings import DEFAULT_CONFIG, load_settings, read_yaml, shipped_config


def test_default_config_documents_every_key():
    lines = DEFAULT_CONFIG.read_text().splitlines()
    keyed = [ln for ln in lines if ln.startswith("  ") and ":" in ln]
    assert keyed and all("#" in ln for ln in keyed)
    assert set(read_yaml(DEFAULT_CONFIG)) == {option.key for option in OPTIONS}


def test_the_shipped_config_is_the_checkouts_else_the_installed_wheels(tmp_path, monkeypatch):
    checkout = tmp_path / "checkout"
    (checkout / "configs").mkdir(parents=True)
    (checkout / "configs" / "default.yaml").write_text("{}\n")
    (checkout / "pyproject.toml").write_text("")
    assert shipped_config(checkout) == checkout / "configs" / "default.yaml"
    # An installed wheel: server/ in site-packages beside tandem_data/, no pyproject.toml; a
    # configs/ that another distribution left there is not Tandem's.
    site = tmp_path / "site"
    packaged = site / "tandem_data" / "configs"
    packaged.mkdir(parents=True)
    (packaged / "default.yaml").write_text("{}\n")
    (site / "configs").mkdir()
    (site / "configs" / "default.yaml").write_text("{}\n")
    for name in [m for m in sys.modules if m.split(".")[0] == "tandem_data"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(site))
    assert shipped_config(site) == packaged / "default.yaml"


def test_config_paths_resolve_against_the_repo_and_package_paths_stay(tmp_path, monkeypatch):
    (tmp_path / "models" / "target").mkdir(parents=True)
    (tmp_path / "models" / "draft").mkdir()
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "preset.yaml"
    config.write_text(DEFAULT_CONFIG.read_text())
    monkeypatch.chdir("/")
    raw = read_yaml(config)
    assert raw["model.path"].startswith("pkg://")  # the shipped default: a wheel's GGUF file
    text = DEFAULT_CONFIG.read_text().replace(raw["model.path"], "models/target", 1)
    config.write_text(text)
    settings = load_settings(str(config), environ={})
    assert settings.model_path == str(tmp_path / "models" / "target")
    assert settings.engine.spec.draft_model == str(tmp_path / "models" / "draft")
    assert settings.served_model_name == "models/target"  # as written
    assert settings.engine.spec.method == "ngram" and settings.engine.spec.max_draft_tokens == 4
    assert settings.engine.cache.block_size == 16


def test_flags_override_yaml_and_env_supplies_the_api_key(tiny_dirs, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(tiny_dirs["llama"]), "max_model_len": 128},
                "speculative": {"method": "ngram", "max_draft_tokens": 3},
                "cache": {"block_size": 8},
                "server": {"api_key": "from-yaml", "port": 9000},
            }
        )
    )
    args = vars(build_parser().parse_args(["serve", "--block-size", "4", "--port", "9100"]))
    overrides = {k: v for k, v in args.items() if "." in k}
    settings = load_settings(str(config), overrides, environ={"TANDEM_API_KEY": "from-env"})
    assert settings.engine.cache.block_size == 4
    assert settings.server.port == 9100
    assert settings.engine.model.max_model_len == 128
    assert settings.engine.spec.method == "ngram" and settings.engine.spec.max_draft_tokens == 3
    assert settings.server.api_key == "from-env"
    env = {"TANDEM_API_KEY": "from-env"}
    flagged = load_settings(str(config), {"server.api_key": "flag"}, environ=env)
    assert flagged.server.api_key == "flag"


def test_the_api_key_may_come_from_a_file(tiny_dirs, tmp_path):
    """--api-key-file keeps the key off the command line (ps shows argv): its content,
    stripped; with --api-key too, or unreadable, or empty, the server refuses to start."""
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    model = {"model.path": str(tiny_dirs["llama"])}
    settings = load_settings(None, {**model, "server.api_key_file": str(key_file)}, {})
    assert settings.server.api_key == "s3cret"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for extra, message in [
        ({"server.api_key_file": str(key_file), "server.api_key": "k"}, "not both"),
        ({"server.api_key_file": str(tmp_path / "missing")}, "cannot read"),
        ({"server.api_key_file": str(empty)}, "is empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_settings(None, {**model, **extra}, {})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"cache": {"blok_size": 4}}, "unknown key 'cache.blok_size'"),
        ({"cache": {"block_size": "big"}}, "cache.block_size has the wrong type"),
        ({"model": {"dtype": "int3"}}, "model.dtype must be one of"),
        ({"cache": {"block_size": 0}}, "--block-size must be between 1 and 256"),
    ],
)
def test_bad_yaml_values_name_the_key(tiny_dirs, tmp_path, body, message):
    body.setdefault("model", {})["path"] = str(tiny_dirs["llama"])
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(body))
    with pytest.raises(ValueError, match=message):
        load_settings(str(config), environ={})
