"""Command lines as vLLM's ``FlexibleArgumentParser`` reads them, so that a copied vLLM manifest
or config file works: flag names with underscores (``--max_model_len``) and ``--config FILE``,
a YAML mapping of flag names to values that the command line's own flags override; and the
argparse types of vLLM's JSON-object flags and of the flags kvpilot takes only as 1."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from typing import Any

CONFIG_FLAG = "--config"


def json_object(text: str) -> dict[str, Any]:
    """A JSON object, as vLLM's JSON flags take it (an argparse type).

    Raises:
        argparse.ArgumentTypeError: the text is not JSON, or not a JSON object.
    """
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'expected a JSON object, e.g. {{"key": 1}}: {text!r}')
    return value


def only_one(what: str) -> Callable[[str], int]:
    """An argparse type that takes only 1, for vLLM's scale-out flags that kvpilot answers
    with replicas instead; ``what`` says what kvpilot runs one of.

    Raises (from the type): argparse.ArgumentTypeError naming the value and how to scale.
    """

    def parse(text: str) -> int:
        if text.strip() != "1":
            raise argparse.ArgumentTypeError(
                f"{text!r}: kvpilot runs {what}; serve more copies with replicas (an "
                "LLMDeployment's spec.replicas, or autoscaling), so only 1 is accepted"
            )
        return 1

    return parse


def dash_flag_names(argv: Iterable[str]) -> list[str]:
    """``argv`` with the name of every long flag spelled with dashes (``--max_model_len=8``:
    ``--max-model-len=8``); values and everything after a bare ``--`` are left alone."""
    out: list[str] = []
    rest = False
    for arg in argv:
        if rest or not arg.startswith("--") or arg == "--":
            rest = rest or arg == "--"
            out.append(arg)
            continue
        name, sep, value = arg.partition("=")
        out.append(name.replace("_", "-") + sep + value)
    return out


def flag_name(arg: str) -> str:
    """The long flag ``arg`` sets, spelled with dashes and without its ``=value``
    (``--max_loras=4``: ``--max-loras``); any other argument as it is."""
    return dash_flag_names([arg])[0].split("=", 1)[0]


def config_file_args(config: Any, parser: argparse.ArgumentParser, source: str) -> list[str]:
    """The flags a vLLM config file stands for: ``{name: value}`` (names as the long flags
    without ``--``, dashes or underscores) becomes ``--name value`` (a mapping as its JSON);
    a list, ``--name v1 v2``;
    ``true``, ``--name``; ``false``, ``--no-name`` where the flag has that form, else nothing
    (the flag is off by default).

    Raises:
        ValueError: the file is not a mapping, or names a flag ``parser`` does not know.
    """
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FLAG} {source}: expected a mapping of flag names to values")
    known = parser._option_string_actions  # noqa: SLF001 - argparse has no public lookup
    args: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in known:
            raise ValueError(f"{CONFIG_FLAG} {source}: unknown flag {key!r}")
        if value is True:
            args.append(flag)
        elif value is False:
            negative = "--no-" + flag[2:]
            args += [negative] if negative in known else []
        elif isinstance(value, list):
            args += [flag, *map(_flag_value, value)]
        elif value is not None:
            args += [flag, _flag_value(value)]
    return args


def _flag_value(value: Any) -> str:
    """A config file's value as the command line spells it: a mapping as JSON (the
    ``--hf-overrides`` kind of flag), anything else as its text."""
    return json.dumps(value) if isinstance(value, dict) else str(value)


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with ``--config FILE`` (or ``--config=FILE``) replaced by the file's flags,
    put first so that the command line's own flags win (as in vLLM).

    Raises:
        ValueError: the file cannot be read or parsed, or holds an unknown flag.
    """
    import yaml

    for i, arg in enumerate(argv):
        if arg == CONFIG_FLAG and i + 1 < len(argv):
            path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
        elif arg.startswith(CONFIG_FLAG + "="):
            path, rest = arg.split("=", 1)[1], argv[:i] + argv[i + 1 :]
        else:
            continue
        try:
            with open(path, encoding="utf-8") as file:
                config = yaml.safe_load(file)
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"{CONFIG_FLAG} {path}: {exc}") from None
        return config_file_args(config, parser, path) + rest
    return argv
