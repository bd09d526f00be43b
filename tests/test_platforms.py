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


# --- JAX's CUDA plugin (the gpu extra) -----------------------------------------------------------


def test_an_nvidia_device_file_is_a_gpu(tmp_path):
    assert not platforms.nvidia_gpu_present(str(tmp_path))
    (tmp_path / "nvidiactl").touch()
    assert platforms.nvidia_gpu_present(str(tmp_path))


def cuda_plugin_installed() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return bool(version("jax-cuda12-plugin"))
    except PackageNotFoundError:
        return False


@pytest.mark.parametrize("environ,modules", [
    ({"JAX_PLATFORMS": "cuda,cpu"}, {}),  # the user asks for CUDA
    ({}, {"jax_cuda12_plugin": object()}),  # JAX loaded it already: too late to keep it out
])
def test_the_cuda_plugin_is_left_alone_when_asked_for_or_loaded(environ, modules):
    assert not platforms.skip_absent_gpu(environ, modules)
    assert set(modules) <= {"jax_cuda12_plugin"}


@pytest.mark.skipif(not cuda_plugin_installed() or platforms.nvidia_gpu_present(),
                    reason="needs the CUDA plugin installed and no NVIDIA GPU")
def test_kept_out_then_let_in_before_jax_is_imported():
    modules = {}
    assert platforms.skip_absent_gpu({}, modules)
    assert modules["jax_cuda12_plugin"] is None and modules["jax_cuda13_plugin"] is None
    assert isinstance(modules["jax_plugins.xla_cuda12"], platforms.LeftOut)
    assert modules["jax_plugins.xla_cuda12"].initialize() is None  # JAX's discovery: registers nothing
    assert not platforms.let_cuda_plugin_in({**modules, "jax": object()})  # JAX imported without it: too late
    assert platforms.let_cuda_plugin_in(modules) and modules == {}


@pytest.mark.skipif(not cuda_plugin_installed() or platforms.nvidia_gpu_present(),
                    reason="needs the CUDA plugin installed and no NVIDIA GPU")
def test_a_process_without_a_gpu_runs_as_without_the_cuda_plugin():
    """With the gpu extra installed, a jaxgpt process prints nothing of CUDA's (no "Could not find
    cuda drivers", no plugin traceback), loads none of the plugin's modules and runs on the CPU."""
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    code = ("import jaxgpt, jax, sys; print(jax.default_backend(), "
            "sorted(m for m in sys.modules if ('jax_cuda' in m or 'xla_cuda' in m) and sys.modules[m] is not None "
            "and not isinstance(sys.modules[m], jaxgpt.platforms.LeftOut)))")
    done = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(maxsplit=1) == ["cpu", "[]\n"] and done.stderr == ""


@pytest.mark.parametrize("cli", ["train.py", "sample.py", "eval.py", "tests/conftest.py"])
def test_the_commands_import_jaxgpt_before_jax(cli):
    """`import jax` loads the CUDA plugin's kernels, whose driver stub complains where no GPU is:
    jaxgpt must come first to keep them out (skip_absent_gpu), so it does in every command."""
    import ast

    found = [alias.name.split(".")[0] if isinstance(node, ast.Import) else (node.module or "").split(".")[0]
             for node in ast.parse((ROOT / cli).read_text()).body if isinstance(node, (ast.Import, ast.ImportFrom))
             for alias in node.names]
    ours = [name for name in found if name in ("jax", "jaxgpt")]
    assert ours and ours[0] == "jaxgpt", f"{cli} imports {ours[0] if ours else 'neither'} first"
