"""The harness's command line with jaxgpt's model registered:
python -m jaxgpt.harness [run] --model jaxgpt --model_args run_dir=RUN[,step=N,batch_size=B] --tasks …

Every argument is the harness's own (`lm_eval run --help`); this only imports jaxgpt.harness first,
which registers "jaxgpt" (lm_eval 0.4 finds models by name only in its own registry). Bad
model_args, and an error the harness raises for its input, are one line on stderr and status 2.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from absl import logging as absl_logging

    from jaxgpt.errors import one_line, tidy_cli_output

    tidy_cli_output()
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's notes on opening checkpoints read-only
    try:
        from lm_eval.__main__ import cli_evaluate

        import jaxgpt.harness  # noqa: F401  registers "jaxgpt"
    except ImportError as err:
        print(f"jaxgpt.harness: error: {one_line(err)}: install the harness with pip install -e '.[eval]'",
              file=sys.stderr)
        return 2
    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]  # the harness's parser reads sys.argv
    try:
        cli_evaluate()
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"jaxgpt.harness: error: {one_line(err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
