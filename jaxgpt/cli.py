"""The command line of a run: a configs/*.py file and `--config.section.key=value` overrides,
parsed into the run's ConfigDict (train.py, jaxgpt.sweep). Each call parses afresh, so a
process can read several configs. `--config.KEY=None` sets a key whose default is None
(config.none_keys) back to None, whatever the config file chose."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from absl import flags
from ml_collections import config_flags

from jaxgpt.config import MOVED_KEYS, load_config, none_keys, unknown_key
from jaxgpt.errors import ConfigError, one_line


def parse_config(argv: list[str], default_file: str | os.PathLike):
    """The config of `argv` (argv[0] is the program): `--config=FILE` (default `default_file`)
    with its overrides, run_dir defaulting to runs/<config file name>. ConfigError (one line)
    for a config file that does not load, an unknown key or a value of the wrong type."""
    argv, cleared = _none_overrides(argv)
    base = load_config(_config_file(argv, default_file))  # a file that does not load: one line naming it
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
        *sections, key = dotted.split(".")
        functools.reduce(lambda node, name: node[name], sections, config)[key] = None
    if config.run_dir is None:
        config.run_dir = str(Path("runs") / Path(_config_file(argv, default_file)).stem)
    return config


def overridden_keys(argv: list[str]) -> list[str]:
    """The dotted keys of argv's --config.KEY=VALUE overrides, in order (the keys a user set)."""
    return [arg.split("=", 1)[0][len("--config."):] for arg in argv if arg.startswith("--config.")]


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
