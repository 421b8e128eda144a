"""The `hicache` command line: one argparse subcommand per program.

Each subcommand lives in the package that implements it and registers itself as an entry
point of the group `hicache.commands` (pyproject.toml). Building the parser imports every
subcommand's module, so those modules are torch-free; the work they start imports the rest.
"""

from __future__ import annotations

import argparse
import atexit
import difflib
import importlib
import importlib.metadata
import logging
import os
import signal
import sys
import threading

# The subcommands: each is registered as an entry point of this group by the package that
# implements it (pyproject.toml), so this module never names a package above it.
ENTRY_POINT_GROUP = "hicache.commands"


def say(line: str) -> None:
    """`line` on stdout in one write, flushed. print() writes the text and its newline apart,
    which unbuffered (PYTHONUNBUFFERED, `python -u`) reach the file one by one: a log line
    written to stderr between them, where both go to one pipe, lands inside the line (a
    port read off "listening on HOST:PORT" took the log line's date as more digits)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def subcommands() -> dict[str, str]:
    """name -> module of every registered subcommand, in name order. A subcommand module
    exposes `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`."""
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {entry.name: entry.value for entry in sorted(found, key=lambda entry: entry.name)}


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]

# Subcommands that also take their settings from `--config FILE` and these variables (see
# hicache.cli_settings): flag > variable > file > the flag's default.
CONFIGURABLE = {"serve": "HICACHE_SERVE_", "demo": "HICACHE_DEMO_"}


class _Parser(argparse.ArgumentParser):
    """A mistake in the flags is one line (argparse's usage block would bury it), exit 2.

    No abbreviations: argparse would take `--turn 2` for `--turns 2` silently, and a flag
    added later could change what an abbreviation means. Subparsers are built with the
    parser's own class, so this holds for every subcommand."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


def version() -> str:
    try:
        return importlib.metadata.version("hicache")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
    for name, module_name in subcommands().items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        sub_parser.set_defaults(_module=module_name, _parser=sub_parser)
        # Accepted after the subcommand too; there it overrides the one before it.
        sub_parser.add_argument(
            "--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS, help=argparse.SUPPRESS
        )
        module.add_arguments(sub_parser)
        if name in CONFIGURABLE:
            sub_parser.add_argument(
                "--config",
                metavar="FILE",
                help=f"a TOML file of settings, one key per flag (spill_dir = ...); flags "
                f"and {CONFIGURABLE[name]}* variables override it. No file is read unless "
                "given",
            )
    return parser


def main(argv: list[str] | None = None) -> int:
    """`hicache ARGV...`; with no argv, the program's own command line, and the process
    exits promptly when the command ends (`exit_promptly`)."""
    code = _main(argv)
    if argv is None:
        exit_promptly(code)
    return code


def exit_promptly(code: int) -> None:
    """End the process with `code` once the command has closed what it opened: the atexit
    handlers run and the output is flushed, but the interpreter's teardown of every module
    is skipped (with torch loaded it takes seconds: a server said "stopped" and stayed up
    for 10-20 s on a busy machine). While a thread that is not a daemon still runs, the
    normal exit, which waits for it, is left to happen instead."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if any(t.is_alive() and not t.daemon for t in others):
        return
    atexit._run_exitfuncs()  # what the normal exit would run (logging's flush among them)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # named by the subcommand's parser, which knows the flags meant
        _unrecognized(getattr(args, "_parser", parser), extras)
    if args.command in CONFIGURABLE:
        try:
            _layer_settings(args, argv)
        except ValueError as error:
            print(f"hicache {args.command}: error: {error}", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(args._module)  # `_parser`: a nested command's own
    return run_command(args._parser.prog, module, args, restore=argv is not None)


# What a signal ends a command with. A server (`serve`, `engine serve`, `route`) handles
# SIGTERM and SIGINT itself once it listens: it stops gracefully, says "stopped", exits 0.
# Before that (a model loading, replicas awaited) and in every other command, the signal
# ends the work where it is: `with` blocks and `finally` close what is open (the caches
# flush what they hold), then one line and the shell's code for the signal.
EXIT_ON_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as Python raises KeyboardInterrupt for SIGINT, so
    the same unwinding runs for both (a BaseException: `except Exception` lets it pass)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def run_command(prog: str, module, args: argparse.Namespace, *, restore: bool = True) -> int:
    """`module.run(args)`, a signal turned into one line and EXIT_ON_SIGNAL's code. With
    `restore` (called in-process, as tests do), the signal handlers are put back after."""
    previous = {signum: signal.getsignal(signum) for signum in EXIT_ON_SIGNAL}
    signal.signal(signal.SIGTERM, _raise_terminated)
    # Python leaves SIGINT ignored where it started ignored (a shell's `cmd &`): ours ends.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return int(module.run(args) or 0)
    except (KeyboardInterrupt, Terminated) as stop:
        signum = signal.SIGINT if isinstance(stop, KeyboardInterrupt) else signal.SIGTERM
        for other in EXIT_ON_SIGNAL:  # a second Ctrl-C must not print a traceback over it
            signal.signal(other, signal.SIG_IGN)
        code = EXIT_ON_SIGNAL[signum]
        print(f"{prog}: stopped by {signum.name} (exit {code})", file=sys.stderr, flush=True)
        return code
    finally:
        if restore:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> None:
    flags = [flag for action in parser._actions for flag in action.option_strings]
    close = difflib.get_close_matches(extras[0].split("=")[0], flags, 1)
    hint = f" (did you mean {close[0]}?)" if close and extras[0].startswith("--") else ""
    parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def _layer_settings(args: argparse.Namespace, argv: list[str] | None) -> None:
    """Fill in what the flags did not give from HICACHE_<COMMAND>_* and the --config file."""
    from hicache.cli_settings import apply, given_on_command_line, layered_settings

    layered = layered_settings(args._parser, args.config, CONFIGURABLE[args.command])
    if layered:
        argv = sys.argv[1:] if argv is None else argv
        apply(args, layered, given_on_command_line(build_parser(), argv))


if __name__ == "__main__":
    sys.exit(main())
