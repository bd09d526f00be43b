"""Runs the commands of tests/test_docs_commands.py in one process, as its module fixture starts it:

    python tests/docs_commands_driver.py PLAN RESULTS

PLAN is a JSON list of [key, argv] (argv: a command line's words, `python` first, the overrides
appended), run in order in the current directory, each through its program's `main` with its stdout
and stderr captured. RESULTS is a JSON object, key → {"status", "stdout", "stderr"}, written again
after each command (a crash leaves those that ran). The process keeps JAX's devices as the commands
choose them: the first training command makes one CPU device per core (jaxgpt.sharding.start_jax)
unless XLA_FLAGS or JAX_NUM_CPU_DEVICES chose otherwise, and the later commands run on those."""

# isort: off
import jaxgpt  # noqa: F401  (first: keeps an accelerator's plugin this machine cannot use out of JAX, jaxgpt.platforms)
# isort: on
import contextlib
import importlib
import io
import json
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path

from scripts import load_script


def program_main(argv: list[str]):
    """(main, its argument list) of the command line `argv` (`python SCRIPT …` or `python -m MODULE …`)."""
    program, args = (argv[2], argv[3:]) if argv[1] == "-m" else (argv[1], argv[2:])
    if program.endswith(".py"):
        return load_script(program).main, [program, *args] if program == "train.py" else args
    module = importlib.import_module(program)
    main = getattr(module, "main", None) or importlib.import_module(f"{program}.__main__").main
    return main, [program, *args] if program == "jaxgpt.data" else args


def run(argv: list[str]) -> dict:
    """{"status", "stdout", "stderr"} of the command line `argv` run in this process: what its main
    returned or exited with (1, the traceback at the end of stderr, when it raised)."""
    out, err = io.StringIO(), io.StringIO()
    handlers, show = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}, warnings.showwarning
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main, args = program_main(argv)
            status = main(args)
        except SystemExit as stop:
            status = stop.code
        except Exception:
            traceback.print_exc()
            status = 1
        finally:  # what a program sets for its own process
            warnings.showwarning = show
            for number, handler in handlers.items():
                signal.signal(number, handler)
    return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main(plan_path: str, results_path: str) -> None:
    results, path = {}, Path(results_path)
    for key, argv in json.loads(Path(plan_path).read_text()):
        results[key] = run(argv)
        path.with_suffix(".part").write_text(json.dumps(results))
        os.replace(path.with_suffix(".part"), path)


if __name__ == "__main__":
    main(*sys.argv[1:])
