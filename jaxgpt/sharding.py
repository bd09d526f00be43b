"""Devices and hosts: the mesh, the batch's layout on it, and multi-host start (where each
parameter lives is its own declaration's: jaxgpt.layout).

The mesh has three axes: `data` (batch rows, parameters replicated), `fsdp` (batch rows,
and one large dimension of each matrix sharded, gathered when used) and `tensor` (attention
heads and the FFN hidden dimension split across devices). The batch is split over
('data', 'fsdp'). XLA inserts the collectives; the model code never mentions devices.
"""

from __future__ import annotations

import math
import os

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxgpt.axes import AXES, BATCH_AXES
from jaxgpt.platforms.xla_flags import use_xla_flags


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh from sizes in the config; one size may be −1 (= the rest).
    Over `devices` (default: every device of JAX's processes), e.g. a TPU topology's for
    compiling ahead of time (jaxgpt.compile)."""
    sizes = [int(mesh_cfg[axis]) for axis in AXES]
    n = jax.device_count() if devices is None else len(devices)
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh {_named(sizes)}: at most one axis may be -1 (all remaining devices)")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh {_named(sizes)}: each size must be a device count ≥ 1, or -1 (the devices the "
                         "others leave)")
    known = math.prod(s for s in sizes if s != -1)
    if n % known:
        platform = list(jax.devices() if devices is None else devices)[0].platform
        raise ValueError(_does_not_fit(sizes, known, n, platform))
    sizes = [n // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != n:
        raise ValueError(f"mesh {_named(sizes)} uses {math.prod(sizes)} of {n} devices: make the product {n}")
    return jax.make_mesh(tuple(sizes), AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES), devices=devices)


def _named(sizes) -> str:
    return ", ".join(f"{axis}={size}" for axis, size in zip(AXES, sizes, strict=True))


def _does_not_fit(sizes, known: int, n: int, platform: str) -> str:
    """The one line for a mesh whose sizes' product `known` does not divide the `n` devices."""
    what = (f"mesh {_named(sizes)} does not fit {n} device{'s' if n != 1 else ''} ({platform.upper()}): the "
            f"product of its sizes, {known}, must divide {n}")
    choose = f"choose sizes whose product divides {n} (a size of -1 takes the devices the others leave)"
    if platform == "cpu":
        return (f"{what}; on a CPU, --config.mesh.cpu_devices={known} makes {known} devices (this machine has "
                f"{os.cpu_count()} cores), or {choose}")
    return f"{what}: {choose}"


def place(tree, shardings=None):
    """`tree`'s arrays (host arrays, or device arrays anywhere) put where a run uses them, by
    one rule for every path that restores or converts parameters: onto `shardings` (each
    process makes only its own shards: any number of hosts), or without, uncommitted on the
    default device, so a program under any mesh (jax.set_mesh) may take them."""
    host = jax.device_get(tree)
    if shardings is None:
        return jax.device_put(host)
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]), host, shardings)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows of a batch split over the data and fsdp axes; the other dimensions whole."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


# XLA's options for a train step whose weights are sharded (fsdp > 1) on a TPU: no windowed
# einsum, the loop of collective permutes that gathers a weight shard by shard inside each
# matmul (and scatters its gradient likewise). The weights are all-gathered whole instead
# (asynchronously, ahead of their layer). GPT-2 small at fsdp=8 on v5e:2x4, 8 rows per chip,
# the flash kernel: XLA's peak 3.82 GiB per chip instead of 7.24, 52.5 GB accessed instead of
# 69.6 (python -m jaxgpt.compile; README "Compiled for TPU slices").
TPU_FSDP_OPTIONS = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}


def compiler_options(mesh: Mesh) -> dict:
    """The XLA options of a train step on `mesh` (TPU_FSDP_OPTIONS on a TPU with fsdp > 1)."""
    tpu = mesh.devices.flat[0].platform == "tpu"
    return dict(TPU_FSDP_OPTIONS) if tpu and mesh.shape["fsdp"] > 1 else {}


def batch_size_divisor(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


# The rows of a batch over the devices, every parameter on each: a command that only evaluates
# (eval.py) on one CPU device per core (use_cpu_cores before JAX starts).
ROWS_MESH = {"data": -1, "fsdp": 1, "tensor": 1, "cpu_devices": -1}


def rows_mesh(batch_size: int) -> Mesh:
    """A data mesh over the first n devices, n the most of them that divides `batch_size`."""
    n = max(n for n in range(1, jax.device_count() + 1) if batch_size % n == 0)
    return make_mesh(ROWS_MESH, devices=jax.devices()[:n])


def replicated(tree, mesh: Mesh):
    """`tree`'s arrays copied whole onto every device of `mesh` (place)."""
    return place(tree, jax.tree.map(lambda _: NamedSharding(mesh, P()), tree))


def available_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def auto_cpu_devices(cores: int, batch_sizes, processes: int = 1, mesh_sizes=(-1, 1, 1)) -> int:
    """The most CPU devices, at most one per core, on which the mesh of `mesh_sizes` (data,
    fsdp, tensor; one may be −1) can be made and every batch's rows split evenly over its
    data×fsdp devices; 0 when no count up to `cores` can."""
    def fits(n: int) -> bool:
        total, known = n * processes, math.prod(s for s in mesh_sizes if s != -1)
        if total % known:
            return False
        sizes = [total // known if s == -1 else s for s in mesh_sizes]
        return math.prod(sizes) == total and all(b % (sizes[0] * sizes[1]) == 0 for b in batch_sizes)

    return max((n for n in range(1, max(cores, 1) + 1) if fits(n)), default=0)


def use_cpu_cores(mesh_cfg, batch_sizes, processes: int = 1) -> int:
    """On a CPU, run one JAX device per core: the mesh's data axis then trains the rows of a
    batch on all cores at once, each device a single stream of XLA ops on its share (small
    models leave one multi-threaded device mostly idle between ops).

    mesh.cpu_devices: N > 0 makes N CPU devices; 0 leaves JAX's default (one); −1 (the
    default) one per core, as many as the mesh's sizes fit and divide every batch evenly,
    when nothing else chose the count (XLA_FLAGS' force_host_platform_device_count or
    jax_num_cpu_devices). Takes effect only before JAX's first operation: returns the
    count set, or 0 when it left JAX as it was. Accelerators are unaffected.
    """
    requested = wanted = int(mesh_cfg["cpu_devices"])
    if wanted < -1:
        raise ValueError(f"mesh.cpu_devices={wanted}: use a device count, 0 (JAX's one device) or -1 (one per core)")
    if wanted == 0:
        return 0
    if wanted == -1:
        if (jax.config.jax_num_cpu_devices != -1
                or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")):
            return 0  # chosen elsewhere
        sizes = tuple(int(mesh_cfg[axis]) for axis in AXES)
        if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
            return 0  # no mesh: make_mesh says why
        wanted = auto_cpu_devices(available_cores(), batch_sizes, processes, sizes)
        if wanted <= 1:
            return 0
    try:
        jax.config.update("jax_num_cpu_devices", wanted)
    except RuntimeError:  # JAX already started: its devices stay as they are
        if requested > 0:
            raise ValueError(f"mesh.cpu_devices={wanted} cannot take effect: JAX was already started in this "
                             "process; set it before the first JAX operation, or leave it at -1") from None
        return 0
    return wanted


def start_jax(config) -> None:
    """Set JAX up for a run, once, before its first operation: the xla_flags preset's flags
    (jaxgpt.platforms.xla_flags), one CPU device per core (mesh.cpu_devices, see use_cpu_cores)
    and multi-host JAX (distributed.*, see initialize_distributed). train.py calls this; a
    library caller that wants any of them calls it before touching JAX. Nothing else in jaxgpt
    changes JAX's global settings."""
    use_xla_flags(config.get("xla_flags", "default"))
    dist = config.distributed
    processes = int(dist.num_processes or os.environ.get("JAX_NUM_PROCESSES") or 1)
    train = config.train  # a batch_size of 0 is chosen later (jaxgpt.train.micro_batch): the rows it comes from
    use_cpu_cores(config.mesh, [train.batch_size or train.rows_per_step // (train.grad_accum or 1),
                                train.eval_batch_size, *(rows for _, rows in train.batch_schedule)], processes)
    use_compilation_cache(config.compilation_cache)
    initialize_distributed(dist)


def compilation_cache_dir(setting: str, environ=os.environ) -> str | None:
    """Where compiled XLA programs are kept between runs: `setting` 'auto' means
    $JAX_COMPILATION_CACHE_DIR when set, else $XDG_CACHE_HOME/jaxgpt/xla (~/.cache/jaxgpt/xla);
    'off' (or '') none; anything else is the directory itself."""
    if setting in ("off", ""):
        return None
    if setting != "auto":
        return os.path.expanduser(setting)
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return environ["JAX_COMPILATION_CACHE_DIR"]
    return os.path.join(os.path.expanduser(environ.get("XDG_CACHE_HOME") or "~/.cache"), "jaxgpt", "xla")


def use_compilation_cache(setting: str) -> str | None:
    """JAX's persistent compilation cache in compilation_cache_dir(setting), every program
    kept however fast it compiled: a run repeated on this machine loads its programs instead
    of compiling them. Returns the directory, or None when the setting is off. A directory
    named that cannot be made is a one-line ValueError; where 'auto' cannot make its own (a
    read-only home), no cache."""
    directory = compilation_cache_dir(setting)
    if directory is not None:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as error:
            if setting == "auto":
                return None
            raise ValueError(f"compilation_cache={setting}: cannot keep compiled programs there ({error.strerror}): "
                             "name a writable directory, 'auto' or 'off'") from None
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


def initialize_distributed(dist_cfg) -> None:
    """Start multi-host JAX when the config or the environment names a coordinator.

    dist_cfg is config.distributed: coordinator_address, num_processes, process_id (None:
    from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), auto (let
    jax.distributed detect a cluster: SLURM, TPU pods), cpu_collectives (between CPU
    processes; GPUs and TPUs use their own) and timeout_s. The process says what it waits
    for; when not every process has joined within timeout_s seconds it says so in one line
    and exits with status 2 (JAX's own timeout would abort it with a C++ stack trace, and
    the wait cannot be interrupted from Python, so a timer thread ends the process).
    """
    import sys
    import threading

    address = dist_cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address and not dist_cfg.auto:
        return
    kwargs, timeout = {}, dist_cfg.get("timeout_s", 300)
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"distributed.timeout_s={timeout!r}: must be a positive number of seconds")
    waiting = "the processes of the cluster JAX detects"
    if address:
        kwargs["coordinator_address"] = address
        num = dist_cfg.num_processes or os.environ.get("JAX_NUM_PROCESSES")
        pid = os.environ.get("JAX_PROCESS_ID") if dist_cfg.process_id is None else dist_cfg.process_id
        if num is None or pid is None:
            raise ValueError(
                f"distributed.coordinator_address={address!r} needs num_processes and process_id "
                "(config keys or JAX_NUM_PROCESSES / JAX_PROCESS_ID)"
            )
        kwargs.update(num_processes=int(num), process_id=int(pid))
        waiting = f"all {num} processes (ids 0…{int(num) - 1}) at {address}; this is process {pid}"
    print(f"jaxgpt: waiting for {waiting} (up to distributed.timeout_s={timeout} s)", file=sys.stderr, flush=True)

    def give_up() -> None:
        print(f"jaxgpt: not every process joined within distributed.timeout_s={timeout} s (waiting for {waiting}): "
              "start the others with the same coordinator_address and num_processes and their own process_id, "
              "or raise distributed.timeout_s", file=sys.stderr, flush=True)
        os._exit(2)

    watchdog = threading.Timer(timeout, give_up)
    watchdog.daemon = True
    jax.config.update("jax_cpu_collectives_implementation", dist_cfg.cpu_collectives)
    watchdog.start()
    try:  # JAX's own limit lies beyond ours, so that ours speaks first
        jax.distributed.initialize(**kwargs, initialization_timeout=int(timeout) + 60)
    finally:
        watchdog.cancel()
