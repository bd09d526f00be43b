"""The harness's index of its built-in tasks, kept on disk between runs.

Before it builds the tasks a command names, the harness (lm_eval 0.4.13's TaskManager) reads
every YAML file of its own tasks directory, about 14,000 of them, into an index of every task,
group and tag: about 3 s on a 2-core CPU, every run, whatever the tasks. The files of an
installed release do not change, so `python -m jaxgpt.harness` keeps that directory's index in
the user's cache directory ($XDG_CACHE_HOME/jaxgpt, ~/.cache/jaxgpt) and reads it back (about
0.3 s), as long as the directory's YAML files are the ones it was made from: the same release,
the same paths, the same sizes and modification times. Any other directory (--include_path) is
indexed by the harness as always, and wins over the built-in tasks as it does there. A cache
that cannot be read or written is made again or skipped: the harness's own index, never an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
from pathlib import Path

CACHE_NAME = "lm_eval_task_index.pickle"
log = logging.getLogger(__name__)


def cache_path(environ=os.environ) -> Path:
    """Where the built-in tasks' index is kept: $XDG_CACHE_HOME/jaxgpt/ (~/.cache/jaxgpt/)."""
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxgpt" / CACHE_NAME


def fingerprint(root: Path, files: list[Path]) -> str:
    """What a directory's index depends on: the harness's release and each YAML file's path, size
    and modification time."""
    import lm_eval

    digest = hashlib.sha256(f"{getattr(lm_eval, '__version__', '?')}\0{root}".encode())
    for path in files:
        stat = path.stat()
        digest.update(f"\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def builtin_root() -> Path:
    """The harness's own tasks directory."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def cached_index(build, root: Path, path: Path) -> dict:
    """build([root]), the harness's index of `root`, read from `path` when it was made from the
    same files, else built and written there."""
    from lm_eval.tasks._index import TaskIndex

    key = fingerprint(root, list(TaskIndex._iter_yaml_files(root)))
    with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError,
                             TypeError):
        kept = pickle.loads(path.read_bytes())
        if isinstance(kept, dict) and kept.get("key") == key and isinstance(kept.get("index"), dict):
            return kept["index"]
    index = build([root])
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(pickle.dumps({"key": key, "index": index}, protocol=pickle.HIGHEST_PROTOCOL))
        partial.replace(path)  # whole or not at all, however many processes write it
    except (OSError, pickle.PicklingError, TypeError, AttributeError):  # not kept: built again next time
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    return index


@contextlib.contextmanager
def kept_builtin_index(path: Path | None = None):
    """While open, the harness indexes its built-in tasks from `path` (cache_path()) when it can;
    every other directory as always, merged in the harness's order (later directories win)."""
    from lm_eval.tasks._index import TaskIndex

    build, root, path = TaskIndex.build, builtin_root(), Path(path or cache_path())

    def indexed(paths, *args, **kwargs):
        if args or kwargs:  # a way of indexing this module does not know: the harness's own
            return build(paths, *args, **kwargs)
        index: dict = {}
        for each in map(Path, paths):
            part = cached_index(build, each, path) if each.resolve() == root.resolve() else build([each])
            for name, entry in part.items():
                if name in index:
                    log.warning("task %r from %s overrides the one from %s", name, entry.yaml_path,
                                index[name].yaml_path)
                index[name] = entry
        return index

    TaskIndex.build = staticmethod(indexed)
    try:
        yield
    finally:
        TaskIndex.build = staticmethod(build)
