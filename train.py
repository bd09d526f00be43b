"""Train a GPT: `python train.py [--config=configs/NAME.py] [--config.train.lr=3e-4 ...]`.

Every key of the config (jaxgpt.config.default_config() lists them, docs/CONFIG.md explains
them) is set as --config.SECTION.KEY=VALUE (or --config.SECTION.KEY VALUE); a key whose default
is None takes =None.

With no --config, configs/default.py: a small GPT on the Python standard library's source,
then a short sample. The run directory (default runs/<config name>) holds everything:
config, tokenizer, checkpoints, metrics.jsonl, loss.png, sample.txt. Running the same
command again resumes from the last checkpoint.
"""

import os
import signal
import sys
import warnings
from pathlib import Path

STOPPED = "train.py: stopped before training began; run the same command to start again"


def stop_while_starting(signum, frame) -> None:
    """Ctrl-C before training takes the signals over (jaxgpt.train.run.StopRequested): there is
    nothing to save yet, and an interrupted preparation resumes where it stopped, so the
    process ends here and now. (A KeyboardInterrupt could be swallowed by a library that is
    importing or starting up, and the run would go on.)"""
    print(STOPPED, file=sys.stderr, flush=True)
    os._exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, stop_while_starting)

from jaxgpt.cli import overridden_keys, parse_config  # noqa: E402  (JAX's import takes seconds: Ctrl-C is ours first)
from jaxgpt.errors import ConfigError, exit_without_a_last_collection, one_line, tidy_cli_output  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.py"


def fail(message: str) -> None:
    print(f"train.py: {message}", file=sys.stderr)
    sys.exit(2)


def parse(argv):
    """The config file and its command-line overrides; a bad one is a one-line error."""
    try:
        return parse_config(argv, DEFAULT_CONFIG)
    except ConfigError as error:
        fail(str(error))


def main(argv) -> int:
    if {"-h", "--help"} & set(argv[1:]):
        print(__doc__.strip())
        return 0
    config = parse(argv)
    tidy_cli_output()
    exit_without_a_last_collection()
    from absl import logging as absl_logging

    # orbax logs its notes, and its failures twice over (they reach jaxgpt as exceptions, reported in one line)
    absl_logging.set_verbosity(absl_logging.FATAL)
    import jax

    from jaxgpt import sharding, viz
    from jaxgpt.checkpoint import CheckpointError
    from jaxgpt.train import run

    try:
        sharding.start_jax(config)  # before JAX's first operation: CPU devices, hosts
        if config.compile_only:  # compile the steps for these devices and report, nothing allocated
            from jaxgpt import compile as ahead

            return ahead.print_and_check(ahead.report(config))
        result = run.train(config, explicit=overridden_keys(argv), keep_programs=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the run is saved: Ctrl-C now only stops the sample
    except (ValueError, OSError, run.TrainingError, CheckpointError) as error:
        fail(one_line(error, limit=2000))
    except KeyboardInterrupt:  # a second signal before training began: nothing to save
        print("train.py: stopped before the first step; run the same command to start again", file=sys.stderr)
        return 130
    if jax.process_index() != 0:
        return 130 if result["interrupted"] else 0
    viz.plot_loss(config.run_dir)
    if result["interrupted"]:
        return 130
    if config.sample.max_new_tokens > 0:
        print_sample(config)
    return 0


def print_sample(config) -> None:
    """The sample the run ends with; the run finished and stands, so a failure here is a warning."""
    from jaxgpt.train import run

    try:
        sample = run.write_sample(config)
    except Exception as error:  # whatever it is, the trained run is saved: exit 0
        warnings.warn(f"no sample ({one_line(error, with_type=True)}); the run is saved: sample.py --run_dir "
                      f"{config.run_dir} samples it", stacklevel=1)
        return
    if sample is not None:
        print(f"--- sample (run directory {config.run_dir}) ---")
        print(sample)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except KeyboardInterrupt:  # Ctrl-C while sampling after the run, which stands
        print("train.py: the sample was stopped; the run is saved", file=sys.stderr)
        sys.exit(130)
