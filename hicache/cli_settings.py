"""A subcommand's settings from three places: its flags, over `HICACHE_<COMMAND>_*`
variables, over a TOML file given with `--config`; what none of them gives keeps the flag's
default (which comes from the component's dataclass: there is no second table of defaults).

The keys are the flags themselves, read off the subcommand's argparse parser: a key is the
flag's destination, its name with `_` for `-` (`--spill-dir` is `spill_dir` in the file and
HICACHE_SERVE_SPILL_DIR in the environment; `--no-compare` is `compare = false`). A value is
converted as the flag's own text would be (the same type function, the same choices), so
the file and the variables cannot accept what the flag refuses. An unknown key or a value
of the wrong type is a ValueError naming the key and where it came from.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from hicache.config import command_environment, read_config_file

# Not settings: what the parser does rather than what the command runs with.
NOT_KEYS = ("help", "version", "config")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def setting_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The subcommand's settings: destination -> its flag's action."""
    # argparse has no public list of a parser's actions; `_actions` is the one it keeps.
    return {
        action.dest: action
        for action in parser._actions
        if action.option_strings and action.dest not in NOT_KEYS
    }


def layered_settings(
    parser: argparse.ArgumentParser,
    config_path: str | os.PathLike | None,
    env_prefix: str,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """{destination: value} from the file, then the variables over it (flags go on top of
    these, in `apply`)."""
    actions = setting_actions(parser)
    values: dict[str, Any] = {}
    if config_path is not None:
        for key, value in read_config_file(config_path).items():
            if key not in actions:
                raise _unknown(f"{config_path}: unknown key", repr(key), list(actions), parser.prog)
            values[key] = _from_toml(actions[key], value, f"{config_path}: {key}")
    for key, text in command_environment(env_prefix, environ).items():
        variable = f"{env_prefix}{key.upper()}"
        if key not in actions:
            known = [f"{env_prefix}{k.upper()}" for k in actions]
            raise _unknown("unknown variable", variable, known, parser.prog)
        values[key] = _from_text(actions[key], text, f"{variable}={text!r}")
    return values


def apply(args: argparse.Namespace, layered: Mapping[str, Any], given: Sequence[str]) -> None:
    """Put the file's and the variables' values into `args`, except where a flag was given."""
    for dest, value in layered.items():
        if dest not in given:
            setattr(args, dest, value)


def given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations that `argv` sets itself: `parser` (built anew, it is changed) parsed
    with every default suppressed."""
    for each in _parsers(parser):
        for action in each._actions:
            if action.option_strings:
                action.default = argparse.SUPPRESS
        each._defaults.clear()
    return set(vars(parser.parse_args(argv)))


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _unknown(what: str, name: str, known: Sequence[str], prog: str) -> ValueError:
    close = difflib.get_close_matches(name.strip("'"), known, 1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ValueError(
        f"{what} {name}{hint}: a setting is a flag's name with _ for -, as `{prog} --help` "
        "lists them"
    )


def _is_bool(action: argparse.Action) -> bool:
    return isinstance(
        action,
        argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction,
    )


def _from_toml(action: argparse.Action, value: Any, where: str) -> Any:
    """A TOML value for `action`'s flag: the type TOML gives must be the flag's."""
    if _is_bool(action):
        return _expect(value, bool, "true or false", where)
    if isinstance(action, argparse._AppendAction):
        items = _expect(value, list, "a list of strings", where)
        return [
            _convert(action, _expect(item, str, "a list of strings", where), where)
            for item in items
        ]
    if action.type is int:
        return _checked(action, _expect(value, int, "an integer", where), where)
    if action.type is float:
        return _checked(action, float(_expect(value, (int, float), "a number", where)), where)
    if action.type is not None and isinstance(value, int) and not isinstance(value, bool):
        return _convert(action, str(value), where)  # a size in bytes, say
    return _convert(action, _expect(value, str, "a string", where), where)


def _from_text(action: argparse.Action, text: str, where: str) -> Any:
    """A variable's text for `action`'s flag, read as the flag's text would be."""
    if _is_bool(action):
        lowered = text.strip().lower()
        if lowered not in _TRUE + _FALSE:
            raise ValueError(f"{where}: expected true or false")
        return lowered in _TRUE
    if isinstance(action, argparse._AppendAction):
        return [_convert(action, item.strip(), where) for item in text.split(",") if item.strip()]
    return _convert(action, text, where)


def _expect(value: Any, kind, expected: str, where: str) -> Any:
    if isinstance(value, bool) and kind is not bool and bool not in _tuple(kind):
        raise ValueError(f"{where}: expected {expected}, got {value!r} (a boolean)")
    if not isinstance(value, kind):
        raise ValueError(f"{where}: expected {expected}, got {value!r} ({_toml_type(value)})")
    return value


def _tuple(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def _toml_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names.update({list: "a list", dict: "a table"})
    return next((name for kind, name in names.items() if isinstance(value, kind)), "a date")


def _convert(action: argparse.Action, text: str, where: str) -> Any:
    try:
        value = action.type(text) if action.type is not None else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as error:
        plain = {int: "expected an integer", float: "expected a number"}.get(action.type)
        raise ValueError(f"{where}: {plain or error}") from None
    return _checked(action, value, where)


def _checked(action: argparse.Action, value: Any, where: str) -> Any:
    if action.choices is not None and value not in action.choices:
        allowed = ", ".join(map(str, action.choices))
        raise ValueError(f"{where}: expected one of {allowed}, got {value!r}")
    return value
