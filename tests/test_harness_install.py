"""How the harness finds jaxgpt's model, with and without the eval extra: `python -m jaxgpt.harness`
where lm_eval cannot be imported says in one line what to install, and the entry point "jaxgpt" of
the group "lm_eval.models" (the harness's model plugins, EleutherAI/lm-evaluation-harness#4013) loads
the model that `python -m jaxgpt.harness --model jaxgpt` runs. These tests need no lm_eval (the
harness's own tests, tests/test_harness.py, are skipped without it)."""

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def without_harness(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m jaxgpt.harness args…` where `import lm_eval` fails as it does without the eval extra
    (a package of that name ahead on the path raises the error a missing module raises)."""
    (tmp_path / "lm_eval").mkdir()
    (tmp_path / "lm_eval" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'lm_eval'\", name='lm_eval')\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "jaxgpt.harness", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": path})


@pytest.mark.parametrize("args", [
    ["--model", "jaxgpt", "--model_args", "run_dir=runs/default", "--tasks", "hellaswag"],
    ["--help"],
    [],
])
def test_the_command_line_without_the_harness_says_what_to_install(tmp_path, args):
    out = without_harness(tmp_path, *args)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.splitlines() == [
        "jaxgpt.harness: error: No module named 'lm_eval': install the harness with pip install -e '.[eval]'"]
    if "--help" in args:  # jaxgpt's part of the usage; the harness's options need the harness
        assert out.stdout.startswith("usage: python -m jaxgpt.harness [run] --model jaxgpt --model_args run_dir=RUN")
    else:
        assert out.stdout == ""


def test_the_entry_point_jaxgpt_loads_the_model_the_command_line_runs():
    points = [point for point in entry_points(group="lm_eval.models") if point.name == "jaxgpt"]
    assert len(points) == 1, "no entry point jaxgpt in lm_eval.models: pip install -e . (it is package metadata)"
    assert points[0].value == "jaxgpt.harness.model:JaxGPT"
    pytest.importorskip("lm_eval", reason="loading the model needs the eval extra: pip install -e '.[eval]'")
    from lm_eval.api.model import LM
    from lm_eval.api.registry import get_model

    import jaxgpt.harness  # noqa: F401  registers "jaxgpt", as python -m jaxgpt.harness does

    model = points[0].load()
    assert model is get_model("jaxgpt")  # what the harness builds for --model jaxgpt
    assert issubclass(model, LM)


def test_a_failed_preload_interrupts_the_main_thread_again_until_it_is_heard(monkeypatch):
    """An interrupt that lands while the main thread runs a callback (JAX's after a garbage collection)
    is dropped by Python: the preload sends it again until the main thread waits for it, and the
    dropped one prints nothing."""
    import threading
    import types

    from jaxgpt.harness import preload

    background = preload.Background.__new__(preload.Background)
    background._lock, background._waited, background.error = threading.Lock(), False, OSError("gone")
    background._heard = threading.Event()
    sent = []

    def interrupt_main():  # the third is heard: the main thread waits for the preload then
        sent.append(1)
        if len(sent) == 3:
            background._waited = True

    monkeypatch.setattr(preload._thread, "interrupt_main", interrupt_main)
    monkeypatch.setattr(preload, "INTERRUPT_AGAIN_S", 0.0)
    background._interrupt_until_heard()
    assert len(sent) == 3

    shown = []
    monkeypatch.setattr(preload, "_started", [background])
    hook = preload._quiet_dropped_interrupts(shown.append)
    hook(types.SimpleNamespace(exc_type=KeyboardInterrupt))
    hook(types.SimpleNamespace(exc_type=ValueError))
    assert [event.exc_type for event in shown] == [ValueError]
