"""`tandem serve`: parse flags, merge them over the YAML config, run uvicorn.

Configuration errors end the process with exit status 2 and one line that names the flag
(or YAML key) and what is allowed, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from server.options import OPTIONS
from server.settings import DEFAULT_CONFIG, Settings, load_settings, read_yaml


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: an OpenAI-compatible server with speculative decoding."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI API over HTTP",
        description="Serve the OpenAI API. Flags override the keys of the YAML config "
        "(each flag's key is shown as [section.key]).",
    )
    serve.add_argument(
        "--config",
        metavar="FILE",
        help=f"YAML config file (default: {DEFAULT_CONFIG})",
    )
    defaults = _shipped_defaults()
    for option in OPTIONS:
        if option.flag is None:
            continue
        shown = f"; default {defaults[option.key]}" if defaults.get(option.key) is not None else ""
        serve.add_argument(
            option.flag,
            dest=option.key,
            type=option.convert,
            choices=option.choices,
            metavar=option.metavar,
            default=argparse.SUPPRESS,
            help=f"{option.help} [{option.key}{shown}]",
        )
    # Errors found after parsing (engine.config checks) are reported by the subcommand's parser.
    serve.set_defaults(command_parser=serve)
    return parser


def _shipped_defaults() -> dict[str, object]:
    """The default config's values, for --help; empty when it is missing or broken."""
    try:
        return read_yaml(DEFAULT_CONFIG)
    except ValueError:
        return {}


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    args.pop("command")
    command_parser: argparse.ArgumentParser = args.pop("command_parser")
    config_file = args.pop("config", None)
    try:
        settings = load_settings(config_file, overrides=args)
    except ValueError as exc:
        command_parser.error(str(exc))
    return serve(settings)


def serve(settings: Settings) -> int:
    """Run the server until interrupted; 1 when the engine failed to load."""
    import uvicorn

    from server.app import create_app

    level = settings.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failures: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException) -> None:
        failures.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.server.log_level,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    if failures:
        print(f"tandem serve: error: {failures[0]}", file=sys.stderr)
        return 1
    return 0
