"""Compiled programs kept with what they were lowered from, so that a repeated run does not trace.

JAX's persistent compilation cache (jaxgpt.sharding.use_compilation_cache) spares a repeated
run the compiling, but JAX finds a program there by the text it lowered to, so every run still
traces the model and lowers it first: 1.4 s of a warm 1-step run of the CPU recipe on a 2-core
CPU. A program kept here is found instead by a fingerprint of everything its lowering reads:

    the settings it was lowered with     the caller's description (configs, shapes, shardings)
    the code                             jaxgpt's files, a user's own imported modules and the files
                                         the command names (path, size, modification time), and the
                                         releases of JAX, Flax, optax…
    how XLA and JAX were started         their environment variables when jaxgpt was imported
                                         (jaxgpt.platforms.STARTED_WITH), and jax.config's values
    the machine                          the devices (platform, kind, id, process) and the CPU model

A change to any of them lowers and compiles again. The program is then named with its key
(renamed), so XLA compiles it in the process rather than JAX's cache answering for it: only such
a program can be kept. Programs are kept beside JAX's cache (in its directory, under programs/),
only where that cache is on, only by a single-process run, and only within `keeping`: the
commands whose process runs what their files say (train.py's init, train step, eval step and
checkpoint checksums, eval.py's eval step and checksums; a notebook may change a function in memory,
which no file shows). A description names each leaf's devices: a program is read back only for
arrays on the devices it was compiled for. A value a trace finds (the params' declarations) is
kept the same way (kept_value). A kept program that cannot be read back is compiled again: never an error.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import pickle
import sys
import sysconfig
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

from jaxgpt import platforms

FOLDER = "programs"


# The libraries a train step's lowering runs through: their releases are part of the key.
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "chex", "numpy", "ml_dtypes")


def code_state() -> list:
    """The code a lowering reads: jaxgpt's files, the files of every imported module that is not
    installed (a user's own) and the files the command line names (train.py's config file), each
    as (path, size, modification time), and the libraries' releases."""
    own = Path(__file__).resolve().parent  # jaxgpt/
    installed = tuple({sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
                      | {sys.prefix, sys.base_prefix})
    users = {module.__file__ for module in list(sys.modules.values()) if isinstance(getattr(module, "__file__", None),
                                                                                    str)}
    users = [name for name in users if not name.startswith(installed) and not name.startswith(str(own))]
    state = [(name, getattr(sys.modules.get(name), "__version__", None)) for name in LIBRARIES]
    named = [arg for arg in (arg.split("=", 1)[-1] for arg in sys.argv) if os.path.isfile(arg)]
    for name in [*sorted(map(str, own.rglob("*.py"))), *sorted(users), *named]:
        with contextlib.suppress(OSError, ValueError):
            stat = os.stat(name)
            state.append((name, stat.st_size, stat.st_mtime_ns))
    return state


def machine() -> list:
    devices = [(d.id, d.platform, d.device_kind, d.process_index) for d in jax.devices()]
    return [devices, jax.process_count(), platforms.cpu_model(), sys.version]


def fingerprint(description: str) -> str:
    """The key of a program lowered as `description` says, with this code, start and machine."""
    config = sorted((name, repr(value)) for name, value in jax.config.values.items())
    parts = [description, code_state(), sorted(platforms.STARTED_WITH.items()), config, machine()]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def abstract(tree) -> str:
    """A description of arrays (or jax.ShapeDtypeStructs): their tree, shapes, dtypes and shardings."""
    leaves, treedef = jax.tree.flatten(tree)
    return repr((str(treedef), [(a.shape, str(a.dtype), str(getattr(a, "sharding", None)), _devices(a))
                                for a in leaves]))


def _devices(leaf) -> list[int] | None:
    """The ids of the devices `leaf` lives on (a sharding's text need not name them: GSPMDSharding's)."""
    where = getattr(leaf, "sharding", None)
    return None if where is None else sorted(d.id for d in where.device_set)


def folder() -> Path | None:
    """Where programs are kept: JAX's compilation cache directory's programs/, when it is on."""
    directory = jax.config.jax_compilation_cache_dir
    if not directory or not jax.config.jax_enable_compilation_cache or jax.process_count() > 1:
        return None
    return Path(directory) / FOLDER


def renamed(fn: Callable, name: str | None) -> Callable:
    """`fn` under another name, which names the program JAX lowers it to (None: fn as it is).
    A kept program's name ends with its key, so that JAX's cache, which finds a program by what
    it lowers to, never answers for it: XLA compiles it in the process, and such a program can be
    kept (compile_and_keep)."""
    if name is None:
        return fn

    def program(*args, **kwargs):
        return fn(*args, **kwargs)

    program.__name__ = program.__qualname__ = name
    return program


class Pending:
    """A compiled program on its way: `result()` waits for it. Read back or compiled in a
    thread; lowered and compiled now if a kept one could not be read."""

    def __init__(self, future: Future | None, fallback: Callable[[], jax.stages.Compiled]):
        self._future, self._fallback, self._compiled = future, fallback, None

    def result(self) -> jax.stages.Compiled:
        if self._compiled is None:
            compiled = self._future.result() if self._future is not None else None
            self._compiled = compiled if compiled is not None else self._fallback()
        return self._compiled


_KEEPING: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxgpt_keeping_programs", default=False)


@contextlib.contextmanager
def keeping(on: bool = True):
    """Within it, `compiled` keeps programs and reads kept ones back (a command whose process runs
    what its files say: train.py, eval.py); outside it, it only lowers and compiles."""
    token = _KEEPING.set(on)
    try:
        yield
    finally:
        _KEEPING.reset(token)


def compiled(description: str, name: str, lower: Callable[[str | None], jax.stages.Lowered],
             compiler: ThreadPoolExecutor | None = None) -> Pending:
    """The program `lower(name)` lowers (`description` says everything it was lowered with):
    within `keeping`, the one kept for the same fingerprint, read back on `compiler`'s thread
    without tracing; else lowered here (by `lower`, under `name` and the key: renamed) and
    compiled on `compiler`'s thread (None: now), then kept."""
    where = folder() if _KEEPING.get() else None
    key = fingerprint(description) if where is not None else None
    run = (lambda fn, *a: _done(fn(*a))) if compiler is None else compiler.submit
    if key is not None and (where / f"{key}.pickle").exists():
        return Pending(run(_read, where / f"{key}.pickle"),
                       lambda: compile_and_keep(key, lower(f"{name}_{key[:16]}")))
    lowered = lower(None if key is None else f"{name}_{key[:16]}")
    return Pending(run(compile_and_keep, key, lowered), lambda: None)


def _done(value) -> Future:
    done = Future()
    done.set_result(value)
    return done


def _read(path: Path) -> jax.stages.Compiled | None:
    """The program kept at `path`, or None: unreadable, truncated, from another jaxlib. It runs on
    the devices it was compiled for, in their order (loaded without them, it would expect every
    device of the process: a program of one device's leaves, or of a mesh of some, would not run)."""
    with contextlib.suppress(Exception):
        payload, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
        by_id = {device.id: device for device in jax.devices()}
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                         execution_devices=[by_id[i] for i in device_ids])
    return None


_CACHE_HITS = threading.local()  # JAX's persistent-cache hits of each thread's compiles


def _count_cache_hits(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _CACHE_HITS.count = getattr(_CACHE_HITS, "count", 0) + 1


jax.monitoring.register_event_listener(_count_cache_hits)


def compile_and_keep(key: str | None, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """lowered.compile(), kept under `key` when XLA compiled it here: a program JAX read back
    from its own cache holds no code of its kernels on a CPU (jaxlib 0.10: loaded in another
    process it fails, "Function … not found"), so it is not kept. (A kept program's name makes
    that rare: only one lowered again after its keeping failed.)"""
    hits = getattr(_CACHE_HITS, "count", 0)
    compiled = lowered.compile()
    return keep(key, compiled) if getattr(_CACHE_HITS, "count", 0) == hits else compiled


def keep(key: str | None, compiled: jax.stages.Compiled) -> jax.stages.Compiled:
    """Keep `compiled` (which XLA compiled in this process) under `key`, with the ids of the devices
    it runs on (a single-process program: its local devices); returns it. A program that cannot be
    written is simply not kept."""
    where = folder()
    if key is not None and where is not None:
        with contextlib.suppress(Exception):  # not serialisable here: the run goes on without it
            devices = [device.id for device in compiled.runtime_executable().local_devices()]
            _write_whole(where / f"{key}.pickle", pickle.dumps((*serialize_executable.serialize(compiled), devices),
                                                               protocol=pickle.HIGHEST_PROTOCOL))
    return compiled


def kept_value(description: str, make: Callable[[], Any]) -> Any:
    """make()'s value (picklable: what a trace finds, e.g. the params' declarations), within
    `keeping` read back from the one kept for the same fingerprint (`description` says what else
    it depends on), else made and kept; outside `keeping`, made."""
    where = folder() if _KEEPING.get() else None
    if where is None:
        return make()
    path = where / f"{fingerprint(description)}.value"
    with contextlib.suppress(Exception):  # none yet, or unreadable: made again
        return pickle.loads(path.read_bytes())
    value = make()
    with contextlib.suppress(Exception):
        _write_whole(path, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    return value


def _write_whole(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all (a full disk, an unwritable folder: OSError, nothing left)."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(data)
        partial.replace(path)
    except Exception:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise
