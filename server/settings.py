"""Server settings: a YAML file, then the environment, then command-line flags, in that order.

Keys and flags come from `server.options.OPTIONS`. Values are checked by the `engine.config`
dataclasses (whose errors already name the flag) plus the few server-only checks here.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from engine import (
    PACKAGE_SCHEME,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
    check_model_path,
    default_served_name,
)
from server.options import BY_KEY, CONFIG_ENV, LOG_LEVELS, OPTIONS, Option, parse_bool

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_PACKAGE = "tandem_data"
"""The package a wheel installs configs/ and models/ into, side by side as in the checkout."""


def shipped_config(root: Path = REPO_ROOT) -> Path:
    """configs/default.yaml of the checkout `root` (when this code runs from one: it has
    pyproject.toml), else the copy the installed package `tandem_data` holds; the checkout's
    path, missing, when neither exists."""
    checkout = root / "configs" / "default.yaml"
    if checkout.exists() and (root / "pyproject.toml").exists():
        return checkout
    try:
        spec = importlib.util.find_spec(f"{DATA_PACKAGE}.configs")
    except ImportError:
        spec = None
    for place in (spec and spec.submodule_search_locations) or ():
        if (Path(place) / "default.yaml").exists():
            return Path(place) / "default.yaml"
    return checkout


DEFAULT_CONFIG = shipped_config()


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    """None = the model path as written in the config or on the command line."""
    api_key: str | None = None
    api_key_file: str | None = None
    api_key_scope: str = "v1"
    """Where the key is required: "v1" (the API) or "all" (every path but /health)."""
    log_level: str = "info"
    drain_timeout: float = 30.0
    """Seconds a SIGTERM waits for in-flight requests before the process exits."""
    max_request_tokens: int | None = None
    """Most tokens one request may ask for (prompts + max_tokens x n); None = 8 x max_model_len."""
    request_timeout: float | None = 600.0
    """Seconds from arrival to the last token before the request is aborted; None = no limit."""
    max_body_bytes: int = 8 << 20
    """A larger request body gets 413 before it is parsed."""
    max_json_number_digits: int = 24
    """Digits a number in structured JSON output may take (0: no limit)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be between 0 and 65535 (got {self.port})")
        if not 0 <= self.drain_timeout <= 86400:
            raise ValueError(
                f"--drain-timeout must be between 0 and 86400 seconds (got {self.drain_timeout})"
            )
        if self.max_request_tokens is not None and self.max_request_tokens < 2:
            raise ValueError(
                f"--max-request-tokens must be at least 2 or auto (got {self.max_request_tokens})"
            )
        if self.request_timeout is not None and not 0 < self.request_timeout <= 86400:
            raise ValueError(
                "--request-timeout must be between 0 and 86400 seconds, or off "
                f"(got {self.request_timeout})"
            )
        if self.api_key_scope not in ("v1", "all"):
            raise ValueError(f"--api-key-scope must be v1 or all (got {self.api_key_scope!r})")
        if not 0 <= self.max_json_number_digits <= 10_000:
            raise ValueError(
                "--max-json-number-digits must be between 0 and 10000 "
                f"(got {self.max_json_number_digits})"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be at least 1024 (got {self.max_body_bytes})")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"--log-level must be one of {', '.join(LOG_LEVELS)} (got {self.log_level!r})"
            )
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name must not be empty")


@dataclass(frozen=True)
class Settings:
    engine: EngineConfig
    server: ServerConfig
    model_ref: str
    """The model path as the user wrote it (the default served model name)."""

    @property
    def model_path(self) -> str:
        return self.engine.model.model

    @property
    def model_root(self) -> str:
        """The model as /v1/models shows it (`root`): its name, never its path on this host."""
        return self.model_ref.rstrip("/").rsplit("/", 1)[-1]

    @property
    def served_model_name(self) -> str:
        return self.server.served_model_name or default_served_name(self.model_ref)

    def model_names(self) -> tuple[str, ...]:
        """Names a request's `model` field may use: the served name, or the model path."""
        return (self.served_model_name, self.model_ref, self.model_path)


_FIELD_NAMES = MappingProxyType({"model.path": "model"})


def read_yaml(path: Path) -> dict[str, Any]:
    """Flatten a config file into {section.name: value}, refusing keys nobody reads."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ValueError(f"--config: cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"--config: {path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, Mapping):
        raise ValueError(f"--config: {path} must hold a mapping of sections")
    flat: dict[str, Any] = {}
    for section, body in raw.items():
        if not isinstance(body, Mapping):
            raise ValueError(f"{path}: section {section!r} must be a mapping")
        for name, value in body.items():
            key = f"{section}.{name}"
            if key not in BY_KEY:
                raise ValueError(f"{path}: unknown key {key!r}; known keys: {', '.join(BY_KEY)}")
            flat[key] = _coerce(BY_KEY[key], value, path)
    return flat


def _coerce(option: Option, value: Any, path: Path) -> Any:
    """YAML already typed the value; run it through the flag's converter so both agree."""
    if value is None or (isinstance(value, bool) and option.convert is parse_bool):
        return value
    if isinstance(value, bool) or isinstance(value, (dict, list)):
        raise ValueError(f"{path}: {option.key} has the wrong type (got {value!r})")
    try:
        converted = option.convert(str(value))
    except ValueError as exc:
        raise ValueError(f"{path}: {option.key} has the wrong type (got {value!r})") from exc
    if option.choices and converted not in option.choices:
        raise ValueError(
            f"{path}: {option.key} must be one of {', '.join(option.choices)} (got {value!r})"
        )
    return converted


def read_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    """{section.name: value} from the TANDEM_* variables that are set and not empty.

    Every flag has one (`Option.env`); an empty variable counts as unset so that compose files
    can pass `${VAR:-}` through.
    """
    values: dict[str, Any] = {}
    for option in OPTIONS:
        text = environ.get(option.env) if option.env else None
        if not text:
            continue
        try:
            value = option.convert(text)
        except ValueError as exc:
            raise ValueError(f"${option.env}: invalid value {text!r} for {option.flag}") from exc
        if option.choices and value not in option.choices:
            raise ValueError(
                f"${option.env} must be one of {', '.join(option.choices)} (got {text!r})"
            )
        values[option.key] = value
    return values


def resolve_config_path(path: str, config_dir: Path) -> str:
    """Where a relative path in a config file points.

    Tried in order: beside the config file, then the directory above it (so the presets in
    configs/ can say `models/draft` as seen from the repo root, or from tandem_data/ where a
    wheel installs both), then the working directory.
    """
    if path.startswith(PACKAGE_SCHEME):
        return path
    given = Path(path).expanduser()
    if given.is_absolute():
        return str(given)
    for base in (config_dir, config_dir.parent, Path.cwd()):
        if (base / given).exists():
            return str((base / given).resolve())
    return str((config_dir / given).resolve())


def load_settings(
    config_file: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Merge YAML < environment (TANDEM_*) < overrides ({section.name: value}, e.g. flags).

    config_file: None = $TANDEM_CONFIG, else the shipped default config (when present).
    Raises ValueError that names the flag, variable or key to change.
    """
    environ = os.environ if environ is None else environ
    overrides = {**read_environ(environ), **(overrides or {})}
    config_file = config_file or environ.get(CONFIG_ENV) or None
    if config_file is None and not DEFAULT_CONFIG.exists():
        values: dict[str, Any] = {}
        config_dir = Path.cwd()
    else:
        path = Path(config_file) if config_file is not None else DEFAULT_CONFIG
        values = read_yaml(path)
        config_dir = path.resolve().parent
    refs: dict[str, str] = {}
    for key, value in values.items():
        if BY_KEY[key].is_path and value is not None:
            refs[key] = value
            values[key] = resolve_config_path(value, config_dir)
    for key, value in overrides.items():
        if key not in BY_KEY:
            raise ValueError(f"unknown setting {key!r}")
        if BY_KEY[key].is_path and value is not None:
            refs[key] = value
            if not value.startswith(PACKAGE_SCHEME):
                value = str(Path(value).expanduser().resolve())
        values[key] = value
    return _build(values, refs)


def _section(values: Mapping[str, Any], section: str) -> dict[str, Any]:
    prefix = f"{section}."
    return {
        _FIELD_NAMES.get(key, key[len(prefix) :]): value
        for key, value in values.items()
        if key.startswith(prefix)
    }


def _check_model(flag: str, path: str, ref: str | None) -> None:
    try:
        check_model_path(path, flag)
    except ValueError as exc:
        written = f" ({ref!r} as written)" if ref and ref != path else ""
        raise ValueError(f"{exc}{written}") from None


def _with_key_file(server: ServerConfig) -> ServerConfig:
    """`server` with the key read from --api-key-file (its content, stripped), if given."""
    path = server.api_key_file
    if path is None:
        return server
    if server.api_key is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    try:
        key = Path(path).expanduser().read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file: cannot read {path}: {exc}") from exc
    if not key:
        raise ValueError(f"--api-key-file: {path} is empty")
    return replace(server, api_key=key)


def _build(values: Mapping[str, Any], refs: Mapping[str, str]) -> Settings:
    model = _section(values, "model")
    if not model.get("model"):
        raise ValueError("--model is required (a Hugging Face model directory or a GGUF file)")
    spec = _section(values, "speculative")
    spec.setdefault("method", "draft" if spec.get("draft_model") else "off")
    engine = EngineConfig(
        model=ModelConfig(**model),
        cache=CacheConfig(**_section(values, "cache")),
        scheduler=SchedulerConfig(**_section(values, "scheduler")),
        spec=SpecConfig(**spec),
    )
    server = _with_key_file(ServerConfig(**_section(values, "server")))
    _check_model("--model", engine.model.model, refs.get("model.path"))
    if engine.spec.method == "draft" and engine.spec.draft_model:
        _check_model("--draft-model", engine.spec.draft_model, refs.get("speculative.draft_model"))
    return Settings(
        engine=engine, server=server, model_ref=refs.get("model.path", engine.model.model)
    )
