"""The `hicache` command line: one argparse subcommand per program.

Each subcommand lives in its own module and is imported only when it runs, so that
`hicache simulate` and `hicache serve` never pull in torch. A subcommand module exposes
`add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import sys

# name -> (module, one-line help). Later subcommands register here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "engine_integration.demo",
        "see what the cache buys: multi-turn chats through the embedded engine, cache on and off",
    ),
    "simulate": (
        "hicache.simulate.cli",
        "plan KV cache capacity: replay a trace through hicache's policies in virtual time",
    ),
    "serve": (
        "hicache.server.cli",
        "run the cache-server daemon: an L3 that many engine instances share over gRPC",
    ),
    "engine": (
        "engine_integration.serve_cli",
        "serve the embedded engine over HTTP, OpenAI-compatible (`hicache engine serve`)",
    ),
    "route": (
        "engine_integration.route_cli",
        "route requests across engine replicas by where their prefixes are cached",
    ),
}


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def version() -> str:
    try:
        return importlib.metadata.version("hicache")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hicache",
        description="hicache: a tiered KV cache for LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"hicache {version()}")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=LOG_LEVELS,
        help="logging level for hicache's own messages (default: %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
        # Accepted after the subcommand too; there it overrides the one before it.
        sub_parser.add_argument(
            "--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS, help=argparse.SUPPRESS
        )
        importlib.import_module(module_name).add_arguments(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
