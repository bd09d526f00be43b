"""Other Python processes for tests: one with N CPU devices running a snippet, its result, and
a free port for several processes on 127.0.0.1 to meet at."""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The suite's own programs (its process, and the snippets it runs with N devices) compile with
# LLVM's optimisations off and XLA's elemental emitters: four times as fast (conftest.py). The
# README's and docs' commands are run with the flags the suite was started with.
SUITE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a snippet of the suite's own with `devices` CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {SUITE_XLA_FLAGS}"


def with_devices(code: str, *args, devices: int = 8) -> subprocess.Popen:
    """`python -c code args…` with `devices` CPU devices and jaxgpt importable."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(devices), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finished(process: subprocess.Popen, timeout: float = 180) -> str:
    """Its standard output, stripped, once it has exited 0 (else its error's tail)."""
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return out.strip()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
