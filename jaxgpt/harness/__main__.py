"""The harness's command line with jaxgpt's model registered:
python -m jaxgpt.harness [run] --model jaxgpt --model_args run_dir=RUN[,step=N,batch_size=B] --tasks …

Every argument is the harness's own (`lm_eval run --help`); importing jaxgpt.harness registers
"jaxgpt" (lm_eval 0.4 finds models by name only in its own registry). For --model jaxgpt the
model_args are checked first, before the harness is imported or its tasks indexed, and the run
then loads and its scoring programs compile (`jaxgpt.harness.preload`) while the harness builds
its tasks; compiled programs are kept on disk (jaxgpt.sharding.use_compilation_cache: 'auto'),
so a second run loads them; the index of the harness's built-in tasks is kept on disk too
(jaxgpt.harness.tasks). Bad model_args, a run that cannot be loaded, and an error the harness
raises for its input, are one line on stderr and status 2; so is a missing harness (the eval
extra), --help or not.
"""

from __future__ import annotations

import sys

USAGE = ("usage: python -m jaxgpt.harness [run] --model jaxgpt --model_args run_dir=RUN[,step=N,batch_size=B] "
         "--tasks TASKS [the harness's options: lm_eval run --help]")


def main(argv: list[str] | None = None) -> int:
    from absl import logging as absl_logging

    from jaxgpt.errors import exit_without_a_last_collection, one_line, tidy_cli_output
    from jaxgpt.harness import HARNESS_MISSING, INSTALL, args

    tidy_cli_output()
    exit_without_a_last_collection()
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's notes on opening checkpoints read-only
    argv = sys.argv[1:] if argv is None else list(argv)
    if HARNESS_MISSING is not None:  # every argument, --help's too, is the harness's to read
        if {"-h", "--help"} & set(argv):
            print(USAGE)
        print(f"jaxgpt.harness: error: {one_line(HARNESS_MISSING)}: install the harness with {INSTALL}",
              file=sys.stderr)
        return 2
    try:
        return evaluate(args.from_command_line(argv), argv)
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"jaxgpt.harness: error: {one_line(err)}", file=sys.stderr)
        return 2


def evaluate(settings, argv: list[str]) -> int:
    """The harness's command line, with the run of --model jaxgpt (settings, None for another
    model) loading and compiling on its own thread meanwhile."""
    from jaxgpt.harness import preload

    background = None
    try:
        try:
            if settings is not None:
                background = preload.start(settings, compilation_cache="auto")
            return run_harness(argv)
        finally:
            if background is not None:
                preload.finish(background)
    except KeyboardInterrupt:
        if background is None or background.error is None:
            raise
        raise background.error from None  # the run failed to load: its thread interrupted the harness


def run_harness(argv: list[str]) -> int:
    """The harness's command line; its built-in tasks indexed from the index kept on disk
    (jaxgpt.harness.tasks), not from their 14,000 files."""
    from lm_eval.__main__ import cli_evaluate

    from jaxgpt.harness.tasks import kept_builtin_index

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # the harness's parser reads sys.argv
    try:
        with kept_builtin_index():
            cli_evaluate()
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
