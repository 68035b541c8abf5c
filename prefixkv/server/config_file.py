"""`prefixkv serve --config FILE`: flags from a YAML file, as vLLM's --config.

Keys are flag names as vLLM spells them (`max-model-len: 512`; `max_model_len` works too), plus
`model`. A flag also given on the command line wins over the file. Values are turned back into
command line words and parsed by the same parser, so a file value is checked exactly as the flag
would be; an unknown key is an error naming it."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any


class ConfigFileError(ValueError):
    """The --config file cannot be read or names something `serve` does not take."""


def expand_config(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` (the words after `serve`) with `--config FILE` replaced by the file's flags, placed
    first so that the command line's own flags override them."""
    argv = list(argv)
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        raise ConfigFileError("--config is given more than once")
    i = at[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv):
            raise ConfigFileError("--config needs a YAML file")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    else:
        path, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1 :]
    return config_words(load_config(path), parser, given=_given_flags(rest)) + rest


def load_config(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigFileError(f"cannot read the --config file {path!r}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ConfigFileError(f"the --config file {path!r} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"the --config file {path!r} must be a mapping of flag names to values")
    return data


def _given_flags(argv: list[str]) -> set[str]:
    """The long flags on the command line (`--x`, `--x=v` and `--no-x` all count as --x)."""
    given = set()
    for word in argv:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            given.add(flag)
            if flag.startswith("--no-"):
                given.add("--" + flag[5:])
    return given


def config_words(config: dict[str, Any], parser: argparse.ArgumentParser, given: set[str]) -> list[str]:
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    words: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config":
            raise ConfigFileError("a --config file cannot name another one (key 'config')")
        action = actions.get(flag)
        if action is None:
            raise ConfigFileError(f"unknown key {key!r} in the --config file: `prefixkv serve` has no {flag} flag")
        if flag in given or any(opt in given for opt in action.option_strings):
            continue  # the command line wins
        words += _words(flag, action, value, key)
    return words


def _words(flag: str, action: argparse.Action, value: Any, key: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigFileError(f"--config key {key!r} takes true or false, got {value!r}")
        return [flag] if value else ["--no-" + flag[2:]]
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise ConfigFileError(f"--config key {key!r} takes true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, list):
        if action.nargs in ("+", "*"):
            return [flag, *(_text(v) for v in value)]
        if isinstance(action, argparse._AppendAction):
            return [w for v in value for w in (flag, _text(v))]
        return [flag, json.dumps(value)]  # a JSON-list flag (--allowed-origins)
    return [flag, _text(value)]


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)
