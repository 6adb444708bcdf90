"""`tandem serve`: parse flags, merge them over TANDEM_* variables and the YAML config, run
uvicorn (with the graceful drain of `server.drain`).

Configuration errors end the process with exit status 2 and one line that names the flag
(or YAML key) and what is allowed, never a traceback.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Sequence

from server.options import CONFIG_ENV, OPTIONS
from server.settings import DEFAULT_CONFIG, Settings, load_settings, read_yaml


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: an OpenAI-compatible server with speculative decoding."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI API over HTTP",
        description="Serve the OpenAI API. Flags override TANDEM_* environment variables, "
        "which override the keys of the YAML config (each flag's key and variable are shown as "
        "[section.key, $VARIABLE]). On SIGTERM or Ctrl-C the server drains: /health turns 503, "
        "new requests get 503, in-flight ones finish (up to --drain-timeout); a second signal "
        "exits at once.",
        epilog="Keys set only in the YAML config: "
        + "; ".join(f"{o.key}: {o.help}" for o in OPTIONS if o.flag is None)
        + ".",
    )
    serve.add_argument(
        "--config",
        metavar="FILE",
        help=f"YAML config file (default: ${CONFIG_ENV}, else {DEFAULT_CONFIG})",
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
            help=f"{option.help} [{option.key}, ${option.env}{shown}]",
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
    """Run the server until a signal drains it; 1 when the engine failed to load."""
    import uvicorn

    from server.app import create_app
    from server.drain import DrainingServer

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
        # The drain already waited for in-flight requests; this only bounds the wait for
        # the ones a drain timeout cut short.
        timeout_graceful_shutdown=2,
    )
    server = DrainingServer(config, app.state.tandem, settings.server.drain_timeout)
    try:
        server.run()
    except KeyboardInterrupt:  # a Ctrl-C before uvicorn took over the signal handlers
        pass
    # The interpreter's last full garbage collection walks every torch/transformers object
    # for seconds and frees nothing the OS would not; freezing them skips it, so a drained
    # replica exits promptly.
    gc.freeze()
    if failures:
        print(f"tandem serve: error: {failures[0]}", file=sys.stderr)
        return 1
    return 0
