"""The command line of `python -m jaxgpt.compile`: its usage text and its arguments, read in
both of the forms absl accepts (`--flag=value` and `--flag value`), every argument it does not
understand refused in one line.

The config's own arguments (`--config FILE`, `--config.KEY VALUE`) come out in the `=` form,
the one jaxgpt.cli.parse_config reads whole (the config file's name for run_dir and its
errors, `--config.KEY=None`)."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from jaxgpt.compile.gpus import is_gpu_topology
from jaxgpt.errors import ConfigError

OPTIONS = ("--topology", "--chips_per_host", "--json")  # the command's own, each taking a value
HELP = ("-h", "--help")
PROGRAM = "python -m jaxgpt.compile"

USAGE = f"""usage: {PROGRAM} [--config=FILE] [--config.KEY=VALUE ...] [--topology=CHIP:SHAPE]
       [--chips_per_host=AxB] [--json=PATH]

Compile a config's train step, eval step and generate without running them, and print per
device their memory, XLA's FLOPs and bytes, a roofline bound and their collectives (for a
GPU: memory and collectives, and a bound from the model's FLOP count; XLA has no cost analysis),
then a verdict: whether the train step fits the memory its micro-batch was chosen for.

options (each also written --option VALUE):
  --config=FILE            a configs/*.py file (default: configs/default.py)
  --config.KEY=VALUE       override one key of the config, e.g. --config.mesh.fsdp=8,
                           --config.model.vocab_size 50304, --config.data.cache_dir=None
  --topology=CHIP:SHAPE    compile for a TPU topology through libtpu, or a GPU one (N GPUs
                           on one host, or HOSTSxN) through JAX's CUDA plugin (the gpu extra),
                           no TPU or GPU needed, one of
{{topologies}}
                           without it: for this process's devices (on a CPU,
                           --config.mesh.cpu_devices=N of them)
  --chips_per_host=AxB     the chips of one TPU host, for a topology laid out other than
                           libtpu's default (2x2 chips per host)
  --json=PATH              also write the report to PATH as JSON
  -h, --help               print this and exit
"""


class UsageError(ConfigError):
    """An argument the command does not understand; the message says which and what to do."""


def usage(topologies: str) -> str:
    """The usage text, listing `topologies` (the known ones, 'v5e:{2x2|2x4}, …, h100:{1|8}, …'),
    a chip a line."""
    return USAGE.replace("{topologies}", "\n".join(f"{' ' * 29}{chip}" for chip in topologies.split(", ")))


def wants_help(argv: list[str]) -> bool:
    """Whether argv (argv[0] the program) asks for the usage text."""
    return any(arg in HELP for arg in argv[1:])


def parse_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """({topology, chips_per_host, json} as given, the config's arguments for
    jaxgpt.cli.parse_config: argv[0], then each in the `--name=value` form). UsageError for
    an argument it does not understand, or an option without its value."""
    options, config_argv = {}, [argv[0] if argv else PROGRAM]
    rest = list(argv[1:])
    while rest:
        arg = rest.pop(0)
        name, has_value, value = arg.partition("=")
        if name in OPTIONS or name == "--config":
            if not has_value:
                value = _next_value(rest)
            if not value:
                raise UsageError(f"{name} needs a value: {name}={_METAVAR[name]}; {PROGRAM} --help lists the options")
            if name == "--config":
                config_argv.append(f"--config={value}")
            else:
                options[name[2:]] = value
        elif name.startswith("--config.") and len(name) > len("--config."):
            # a value follows unless the next argument is another option (a bare boolean key: True)
            if not has_value and rest and not rest[0].startswith("--"):
                arg = f"{name}={rest.pop(0)}"
            config_argv.append(arg)
        elif name.startswith("--noconfig.") and not has_value:  # absl's form of a boolean key set to False
            config_argv.append(arg)
        else:
            raise UsageError(_not_understood(arg))
    if "chips_per_host" in options and "topology" not in options:
        raise UsageError("--chips_per_host lays out a TPU topology's hosts: give the topology too "
                         "(--topology=CHIP:SHAPE)")
    if "chips_per_host" in options and is_gpu_topology(options["topology"]):
        raise UsageError("--chips_per_host lays out a TPU topology's hosts; a GPU topology names its own "
                         "(--topology=h100:2x8: 2 hosts of 8 GPUs)")
    return options, config_argv


_METAVAR = {"--topology": "CHIP:SHAPE", "--chips_per_host": "AxB", "--json": "PATH", "--config": "FILE"}


def _next_value(rest: list[str]) -> str:
    """An option's value written as the next argument (taken from `rest`); '' when there is
    none (the end of the line, or another option next)."""
    return rest.pop(0) if rest and not rest[0].startswith("--") else ""


def _not_understood(arg: str) -> str:
    """The one line for an argument that is none of the command's."""
    known = [*OPTIONS, "--config", "--help"]
    if arg.startswith("-"):
        name = arg.partition("=")[0]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"unknown option {arg}{hint}: {PROGRAM} --help lists the options"
    return (f"unexpected argument {arg!r}: every argument is an option (--name=VALUE or --name VALUE); "
            f"{PROGRAM} --help lists them")


def check_writable(path: str) -> None:
    """ValueError, before anything is compiled, for a --json PATH that cannot be written
    (print_and_check still says it in one line if the write fails all the same)."""
    target = Path(path)
    if target.is_dir():
        reason = "it is a directory"
    elif not target.parent.is_dir():
        reason = f"no directory {target.parent}"
    elif not os.access(target if target.exists() else target.parent, os.W_OK):
        reason = "permission denied"
    else:
        return
    raise ValueError(f"cannot write --json {path} ({reason})")
