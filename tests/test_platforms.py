"""jaxgpt.platforms: with libtpu installed on a machine without a TPU, a jaxgpt process starts
no TPU backend (no libtpu complaints, no lock file taken); elsewhere it changes nothing."""

import os
import subprocess
import sys

import pytest
from processes import ROOT

from jaxgpt import platforms


def test_a_google_pci_device_or_a_tpu_device_file_is_a_tpu(tmp_path):
    pci, dev = tmp_path / "pci", tmp_path / "dev"
    (pci / "0000:00:04.0").mkdir(parents=True)
    (pci / "0000:00:04.0" / "vendor").write_text("0x1af4\n")  # a virtio device
    dev.mkdir()
    assert not platforms.tpu_present(str(pci), str(dev))
    (pci / "0000:00:05.0").mkdir()
    (pci / "0000:00:05.0" / "vendor").write_text("0x1ae0\n")
    assert platforms.tpu_present(str(pci), str(dev))
    (pci / "0000:00:05.0" / "vendor").unlink()
    (dev / "accel0").touch()
    assert platforms.tpu_present(str(pci), str(dev))


def test_the_users_choice_is_kept():
    environ = {"JAX_PLATFORMS": "cpu,tpu"}
    assert platforms.skip_absent_tpu(environ) is None and environ == {"JAX_PLATFORMS": "cpu,tpu"}


@pytest.mark.skipif(platforms.tpu_present(), reason="a TPU is here")
def test_a_process_without_a_tpu_starts_no_tpu_backend():
    pytest.importorskip("libtpu")
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    code = "import jaxgpt, jax; print(jax.default_backend(), jax.config.jax_platforms)"
    done = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    backend, chosen = done.stdout.split()
    assert backend != "tpu" and "tpu" not in chosen and chosen.endswith("cpu")
    assert done.stderr == ""  # libtpu's start-up complaints (TPU_WORKER_HOSTNAMES, …) never printed
