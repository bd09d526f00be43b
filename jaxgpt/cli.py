r"""The command line of a run: a configs/*.py file and `--config.section.key=value` overrides,
parsed into the run's ConfigDict (train.py, jaxgpt.sweep). Each call parses afresh, so a
process can read several configs. `--config.KEY=None` sets a key whose default is None
(config.none_keys) back to None, whatever the config file chose. Both of absl's forms are read
alike (`--config FILE`, `--config.KEY VALUE`: equals_form), in any order (an override may stand
before the file), and any other argument is refused. A text given on the command line reads its
backslash escapes as a Python string does for three of them (unescape): `\n` a newline, `\t` a
tab, `\\` one backslash."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from absl import flags
from ml_collections import config_flags

from jaxgpt.config import MOVED_KEYS, load_config, none_keys, unknown_key
from jaxgpt.errors import ConfigError, one_line


def parse_config(argv: list[str], default_file: str | os.PathLike):
    """The config of `argv` (argv[0] is the program): `--config=FILE` (default `default_file`)
    with its overrides, run_dir defaulting to runs/<config file name>. ConfigError (one line)
    for a config file that does not load, an unknown key, a value of the wrong type or an
    argument that is none of those flags (absl would ignore it)."""
    argv = file_first(equals_form(argv))
    base = load_config(_config_file(argv, default_file))  # a file that does not load: one line naming it
    _refuse_strays(argv[1:], base)
    argv, cleared = _none_overrides(argv)
    flag_values = flags.FlagValues()
    try:
        holder = config_flags.DEFINE_config_file("config", str(default_file), "a configs/*.py file",
                                                 flag_values=flag_values, sys_argv=argv)
        flag_values(argv)
        config = holder.value
        config.to_dict()  # a config file that failed to load raises here
    except (AttributeError, KeyError) as error:  # an override naming a key the config does not have
        raise ConfigError(next(filter(None, (unknown_key(base, key) for key in overridden_keys(argv))), None)
                          or one_line(error)) from None
    except (flags.Error, ValueError, TypeError, ImportError, OSError) as error:
        # e.g. --config.data.ocr=never: data.ocr is a section now, its old value data.ocr.mode
        moved = [f"{key} is a section now: the old {key} is {MOVED_KEYS[key]}" for key in overridden_keys(argv)
                 if key in MOVED_KEYS]
        raise ConfigError(next(iter(moved), None) or " ".join(line.strip() for line in str(error).strip().splitlines())
                          or type(error).__name__) from None
    for dotted in cleared:
        _set(config, dotted, None)
    for dotted in dict.fromkeys(overridden_keys(argv)):  # each key once: its final value, unescaped once
        if isinstance(value := _get(config, dotted), str):
            _set(config, dotted, unescape(value))
    if config.run_dir is None:
        config.run_dir = str(Path("runs") / Path(_config_file(argv, default_file)).stem)
    return config


ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
    r"""A text as typed on a command line, its escapes read: `\n` a newline, `\t` a tab, `\\` a
    backslash (so `\\n` stays a backslash and an n); any other backslash is kept as typed. Shells
    pass `'Q: {question}\nA: '` with a backslash and an n: the user means a newline."""
    return re.sub(r"\\([nt\\])", lambda match: ESCAPES[match[1]], text)


def _get(config, dotted: str):
    return functools.reduce(lambda node, name: node[name], dotted.split("."), config)


def _set(config, dotted: str, value) -> None:
    *sections, key = dotted.split(".")
    functools.reduce(lambda node, name: node[name], sections, config)[key] = value


def file_first(argv: list[str]) -> list[str]:
    """argv (in the `=` form) with its `--config=FILE` arguments first: absl reads an override
    only after the file it overrides, and where a user puts it on the line should not matter."""
    files = [arg for arg in argv[1:] if arg.startswith("--config=")]
    return [argv[0], *files, *(arg for arg in argv[1:] if not arg.startswith("--config="))]


def overridden_keys(argv: list[str]) -> list[str]:
    """The dotted keys of argv's --config.KEY=VALUE overrides (either form, and the boolean
    --noconfig.KEY), in order (the keys a user set)."""
    return [arg.split("=", 1)[0].removeprefix("--no").removeprefix("--")[len("config."):]
            for arg in equals_form(argv) if arg.startswith(("--config.", "--noconfig."))]


def equals_form(argv: list[str]) -> list[str]:
    """argv with `--config FILE` and `--config.KEY VALUE` joined into the `=` form. The next
    argument is the value unless it starts with `--` (a value may be `-1`): a `--config.KEY`
    followed by another flag, or last, is a boolean key set to True, as absl reads it."""
    joined, rest = [], list(argv)
    while rest:
        arg = rest.pop(0)
        takes_value = arg == "--config" or (arg.startswith("--config.") and "=" not in arg)
        if takes_value and rest and not rest[0].startswith("--"):
            arg = f"{arg}={rest.pop(0)}"
        joined.append(arg)
    return joined


def _refuse_strays(args: list[str], base) -> None:
    """ConfigError for an argument (in the `=` form) that is not a --config flag: absl would
    leave a positional word unread, and a typo'd override with it."""
    for arg in args:
        if arg == "--config":
            raise ConfigError("--config needs a value: --config=FILE (a configs/*.py file)")
        if not arg.startswith(("--config=", "--config.", "--noconfig.")):
            guess = _meant(arg, base)
            raise ConfigError(f"the command line takes --config=FILE and --config.KEY=VALUE overrides; {arg!r} is "
                              f"neither{f': did you mean {guess}?' if guess else ''}")


def _meant(arg: str, base) -> str | None:
    """The flag a stray argument was likely meant as: `--config=x.py` for a file name,
    `--config.train.steps=10` for `steps=10` (or `train.steps=10`, `-config.train.steps=10`)."""
    word = arg.lstrip("-")
    if word.endswith(".py") and "=" not in word:
        return f"--config={word}"
    key, sep, value = word.partition("=")
    key = key.removeprefix("config.")
    if not key:
        return None
    leaves = _leaf_keys(base)
    matches = [key] if key in leaves else [leaf for leaf in leaves if leaf.endswith(f".{key}")]
    return f"--config.{matches[0]}={value if sep else 'VALUE'}" if len(matches) == 1 else None


def _leaf_keys(section, prefix: str = "") -> list[str]:
    """The dotted keys of a config's values (not its sections)."""
    keys = []
    for name, value in section.items():
        keys += _leaf_keys(value, f"{prefix}{name}.") if hasattr(value, "items") else [prefix + name]
    return keys


def _none_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without its `--config.KEY=None` overrides of the keys whose default is None, the
    keys among those whose last override is None). ml_collections would read the word None
    as a string, or refuse it for a number."""
    nullable = set(none_keys())

    def clears(arg: str) -> bool:
        key, _, value = arg.removeprefix("--config.").partition("=")
        return arg.startswith("--config.") and key in nullable and value in ("None", "none")

    last = {arg.split("=", 1)[0]: clears(arg) for arg in argv if arg.startswith("--config.")}
    return [arg for arg in argv if not clears(arg)], [key.removeprefix("--config.") for key, none in last.items()
                                                      if none]


def _config_file(argv: list[str], default_file: str | os.PathLike) -> str:
    files = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
    return files[-1] if files else str(default_file)
