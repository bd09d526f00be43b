"""The NVIDIA GPUs jaxgpt.compile compiles for without one: each one's figures, once, from which
come both XLA's description of the target (a GpuTargetConfigProto in protobuf text format, what
JAX's CUDA plugin reads for a compile-only topology) and the report's memory and peak FLOP/s.

A topology is a GPU and how many of them: 'h100:8' is one host of 8, 'h100:2x8' two hosts of
8 (XLA's topology '1x2x8': one slice of 2 hosts of 8 devices). The figures are NVIDIA's
datasheets' for the SXM boards; the memory is what nvidia-smi reports (a little less than the
marketed GB); the FLOP/s are dense bfloat16 on the tensor cores (no sparsity).
"""

from __future__ import annotations

import dataclasses
import os

MiB = 2**20
DEFAULT_MEMORY_FRACTION = 0.75  # of a GPU's memory, what JAX's allocator takes for XLA unless told otherwise


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU as XLA needs it described (its field names are GpuDeviceInfoProto's where it has one)."""

    device_kind: str  # as CUDA names the device (jax.Device.device_kind)
    compute_capability: tuple[int, int]
    core_count: int  # streaming multiprocessors
    fpus_per_core: int  # FP32 lanes per SM
    clock_rate_ghz: float  # boost clock
    device_memory_size: int  # bytes, as nvidia-smi reports the board's memory
    memory_bandwidth: int  # HBM, bytes/s
    l2_cache_size: int  # bytes
    shared_memory_per_core: int  # bytes per SM
    shared_memory_per_block_optin: int  # bytes a block may ask for
    bf16_flops: float  # dense bfloat16 peak of the tensor cores, FLOP/s


HOPPER_SHARED, AMPERE_SHARED = 228 * 1024, 164 * 1024  # per SM; a block may opt in to 1 KiB less
GPUS = {
    "h100": Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, 81559 * MiB, 3_350_000_000_000, 50 * MiB,
                HOPPER_SHARED, HOPPER_SHARED - 1024, 989.4e12),
    "h200": Gpu("NVIDIA H200", (9, 0), 132, 128, 1.98, 143771 * MiB, 4_800_000_000_000, 50 * MiB,
                HOPPER_SHARED, HOPPER_SHARED - 1024, 989.4e12),
    "a100": Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, 81920 * MiB, 2_039_000_000_000, 40 * MiB,
                AMPERE_SHARED, AMPERE_SHARED - 1024, 312e12),
    "a100-40gb": Gpu("NVIDIA A100-SXM4-40GB", (8, 0), 108, 64, 1.41, 40960 * MiB, 1_555_000_000_000, 40 * MiB,
                     AMPERE_SHARED, AMPERE_SHARED - 1024, 312e12),
}
SHAPES = ("1", "2", "4", "8", "2x8", "4x8", "8x8", "16x8")  # GPUs on one host, or hosts x GPUs per host
CUDNN_OLDEST = (9, 8)  # the oldest cuDNN JAX's CUDA plugin accepts (jax-cuda12-plugin's requirement)
# the CUDA runtime the target is described with: XLA decides by it what it may call (cuBLASLt's FP8 GEMMs need 12.0;
# without one it compiles for CUDA 0 and rewrites no FP8 product); 12.9 is the gpu extra's ptxas
CUDA_RUNTIME = (12, 9)
INSTALL = "pip install -e '.[gpu]'"


def known_topologies() -> str:
    return ", ".join(f"{name}:{{{'|'.join(SHAPES)}}}" for name in GPUS)


def is_gpu_topology(name: str) -> bool:
    """Whether a topology name names one of GPUS (its shape may still be unknown)."""
    return name.partition(":")[0] in GPUS


def parse(name: str) -> tuple[Gpu, int, int]:
    """(the GPU, hosts, GPUs per host) of a topology name such as 'h100:8' or 'h100:2x8';
    ValueError listing the known ones for any other."""
    chip, _, shape = name.partition(":")
    if chip not in GPUS or shape not in SHAPES:
        raise ValueError(f"unknown GPU topology {name!r}: known are {known_topologies()}")
    hosts, _, per_host = shape.rpartition("x")
    return GPUS[chip], int(hosts or 1), int(per_host)


def memory_fraction(environ=os.environ) -> float:
    """The share of a GPU's memory JAX gives XLA: XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75."""
    try:
        fraction = float(environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEMORY_FRACTION))
    except ValueError:
        return DEFAULT_MEMORY_FRACTION
    return fraction if 0 < fraction <= 1 else DEFAULT_MEMORY_FRACTION


def target_config(gpu: Gpu) -> str:
    """XLA's GpuTargetConfigProto of `gpu`, in protobuf text format. The limits every NVIDIA GPU
    since Volta shares (threads, registers, grid) are written here; the rest are the GPU's."""
    major, minor = gpu.compute_capability
    info = {"threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 48 * 1024,
            "shared_memory_per_core": gpu.shared_memory_per_core, "threads_per_core_limit": 2048,
            "core_count": gpu.core_count, "fpus_per_core": gpu.fpus_per_core,
            "block_dim_limit_x": 2**31 - 1, "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
            "memory_bandwidth": gpu.memory_bandwidth, "l2_cache_size": gpu.l2_cache_size,
            "clock_rate_ghz": gpu.clock_rate_ghz, "device_memory_size": gpu.device_memory_size,
            "shared_memory_per_block_optin": gpu.shared_memory_per_block_optin,
            "registers_per_core_limit": 65536, "registers_per_block_limit": 65536}
    lines = ["gpu_device_info {", *(f"  {key}: {value}" for key, value in info.items()),
             f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}",
             'platform_name: "CUDA"',
             f"dnn_version_info {{ major: {CUDNN_OLDEST[0]} minor: {CUDNN_OLDEST[1]} }}",
             f"runtime_version {{ major: {CUDA_RUNTIME[0]} minor: {CUDA_RUNTIME[1]} }}",
             f'device_description_str: "{gpu.device_kind}"']
    return "\n".join(lines) + "\n"
