"""The run setting xla_flags (jaxgpt.platforms.xla_flags): a named preset's flags reach XLA_FLAGS
before JAX starts, the user's own flags keep their values, and every preset's flags are flags the
installed XLA knows (an unknown one ends the process that starts JAX)."""

import os
import subprocess
import sys

import pytest

from jaxgpt.errors import ConfigError
from jaxgpt.platforms.xla_flags import PRESETS, flags_for, use_xla_flags


def test_default_adds_nothing_and_keeps_the_users_flags():
    environ = {"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=false"}
    assert use_xla_flags("default", environ) == "--xla_cpu_use_thunk_runtime=false"
    empty = {}
    assert use_xla_flags("default", empty) == "" and "XLA_FLAGS" not in empty


def test_a_preset_adds_its_flags_after_the_users_and_a_flag_the_user_set_stays_the_users():
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert use_xla_flags("cudnn_norms", environ).split() == ["--xla_dump_to=/tmp/x",
                                                             "--xla_gpu_enable_cudnn_layer_norm=true"]
    mine = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
    assert use_xla_flags("cublas", mine) == "--xla_gpu_enable_triton_gemm=true"


def test_an_unknown_preset_is_a_one_line_error_naming_the_presets():
    with pytest.raises(ConfigError) as refused:
        flags_for("fastest")
    message = str(refused.value)
    assert "\n" not in message and "'fastest' is no flag preset" in message
    assert all(name in message for name in PRESETS)


def test_every_presets_flags_are_known_to_the_installed_xla():
    """One process starts JAX with the flags of every preset together (XLA reads them once, and ends
    a process at a flag it does not know: a bogus one is shown to do so)."""
    every = " ".join(flag for flags in PRESETS.values() for flag in flags)
    start = [sys.executable, "-c", "import jax; print(int(jax.numpy.ones(3).sum()))"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    known = subprocess.run(start, env=env | {"XLA_FLAGS": every}, capture_output=True, text=True, timeout=120)
    assert known.returncode == 0 and known.stdout.strip() == "3", known.stderr[-2000:]
    bogus = subprocess.run(start, env=env | {"XLA_FLAGS": "--xla_gpu_no_such_flag=true"}, capture_output=True,
                           text=True, timeout=120)
    assert bogus.returncode != 0 and "xla_gpu_no_such_flag" in bogus.stderr


def test_the_flags_set_are_what_this_processes_kept_programs_are_keyed_by(monkeypatch):
    """The programs a process keeps (jaxgpt.programs) are told the XLA_FLAGS JAX starts with."""
    from jaxgpt import platforms

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    monkeypatch.setitem(platforms.STARTED_WITH, "XLA_FLAGS", "--xla_dump_to=/tmp/x")
    use_xla_flags("cublaslt")
    assert os.environ["XLA_FLAGS"] == platforms.STARTED_WITH["XLA_FLAGS"] == (
        "--xla_dump_to=/tmp/x --xla_gpu_enable_cublaslt=true")
