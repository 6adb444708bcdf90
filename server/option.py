"""A setting's description (`Option`) and the converters its flags use (server/options.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "TANDEM_"


def optional(
    convert: Callable[[str], Any], words: tuple[str, ...] = ("none", "null")
) -> Callable[[str], Any]:
    """A converter that also accepts `words` for None (the YAML null of a flag)."""

    def parse(text: str) -> Any:
        return None if text.lower() in words else convert(text)

    parse.__name__ = convert.__name__  # argparse names the type in its error message
    return parse


def parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


@dataclass(frozen=True)
class Option:
    key: str
    """section.name in the YAML file."""
    flag: str | None
    """None = YAML only."""
    convert: Callable[[str], Any]
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    is_path: bool = False

    @property
    def env(self) -> str | None:
        """The environment variable for this flag: --draft-model -> TANDEM_DRAFT_MODEL."""
        if self.flag is None:
            return None
        return ENV_PREFIX + self.flag.removeprefix("--").upper().replace("-", "_")
