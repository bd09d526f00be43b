"""Shared test settings.

XLA's compiled programs are cached on disk for the session, so the many small training runs
of the suite compile each distinct program once (subprocesses inherit the cache through
JAX_COMPILATION_CACHE_DIR)."""

# isort: off
import os

from processes import SUITE_XLA_FLAGS

# The suite's XLA flags (below) are in the environment when jaxgpt and JAX start
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SUITE_XLA_FLAGS}".strip()
import jaxgpt  # noqa: F401,E402  (before JAX: keeps an accelerator's plugin this machine cannot use out, jaxgpt.platforms)
# isort: on
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # ours for this session: removed at its end
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxgpt-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
# One CPU device in this process whichever test starts JAX first (training would otherwise
# make one per core); subprocesses choose their own.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    jax.config.update("jax_num_cpu_devices", 1)
# This process compiles thousands of small programs and runs each a few times: at XLA's defaults
# two thirds of its time is XLA's backend compiling. With LLVM at -O0 and XLA's elemental
# emitters instead of its MLIR fusion emitters (processes.SUITE_XLA_FLAGS), a tiny model's train
# step compiles in 0.35 s instead of 1.65 s on a 2-core Xeon (the suite: 884 s to 620 s), and
# runs slower, which tiny programs do not feel. Values differ from the defaults' by rounding:
# every test compares programs compiled alike, or holds a tolerance. XLA reads its flags when the
# backend starts, here; the suite's subprocesses (train.py killed and resumed, several processes
# training together) inherit them. The README's and docs' commands compile as a user's do, with
# the flags the suite was started with (tests/test_user_commands.py, tests/test_docs_commands.py
# take the suite's out). (jaxgpt.platforms.STARTED_WITH holds the suite's, which the programs kept
# by jaxgpt.programs are found by.)
jax.devices()


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def encode_calls(monkeypatch):
    """Every text given to a tokenizer's encode, in this process."""
    from jaxgpt.tokenizers import Tokenizer

    calls = []
    original = Tokenizer.encode

    def spy(self, text, *args, **kwargs):
        calls.append(text)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", spy)
    return calls


def corpus_documents(corpus, split="train"):
    """A prepared text corpus's documents of `split`: the runs of ids between <|eos|>, decoded."""
    ids = np.asarray(getattr(corpus, split)).tolist()
    pieces = [[]]
    for i in ids:
        if i == corpus.tokenizer.eos_id:
            pieces.append([])
        else:
            pieces[-1].append(i)
    return [corpus.tokenizer.decode(piece) for piece in pieces] if ids else []
