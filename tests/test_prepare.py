"""Streaming preparation of a text corpus: parallel encoding, token shards, resuming a stopped
build, bounded memory, the prepare command, and caches of the single-file format.

Each check compares with something independent of the path under test: another number of
workers, one concatenated array, an uninterrupted build, a cache written by hand, a baseline
process."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxgpt import data, tokenizers
from jaxgpt.data.shards import ShardedTokens, ShardWriter
from jaxgpt.tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the of and to in is that it was for on are as with his they at be this from have or by one had".split()


def write_corpus(root: Path, documents: int, words: int, seed: int = 0) -> Path:
    """`documents` text files of about `words` random words each (a few non-ASCII ones)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    vocabulary = WORDS + ["café", "naïve", "東京", "🙂"]
    for i in range(documents):
        lines = (" ".join(rng.choices(vocabulary, k=12)) for _ in range(max(1, words // 12)))
        (root / f"doc{i:05d}.txt").write_text(f"Document {i}.\n" + "\n".join(lines) + "\n", encoding="utf-8")
    return root


def config(tmp_path: Path, source: Path, cache: str = "cache", **overrides) -> dict:
    return {"source": str(source), "cache_dir": str(tmp_path / cache), "val_fraction": 0.1, "workers": 1,
            **overrides}


def shard_files(corpus) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(corpus.directory.glob("*.bin"))}


def concatenated_split(corpus, split: str) -> np.ndarray:
    """A split's tokens read straight from its shard files, in the index's order."""
    dtype = np.dtype(corpus.meta["dtype"])
    shards = corpus.meta["splits"][split]["shards"]
    return np.concatenate([np.fromfile(corpus.directory / s["file"], dtype) for s in shards] or [np.empty(0, dtype)])


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"), documents=240, words=150)  # ~190 KB




# --- parallel encoding -------------------------------------------------------------------------


def test_one_and_three_workers_write_identical_shards_and_index(tmp_path, corpus_dir, encode_calls):
    settings_ = {"tokenizer": "bpe", "vocab_size": 300, "shard_tokens": 40_000, "encode_batch_bytes": 8_000}
    one = data.prepare(config(tmp_path, corpus_dir, "one", **settings_))
    assert len(encode_calls) == 240  # every document, encoded here
    encode_calls.clear()
    three = data.prepare(config(tmp_path, corpus_dir, "three", **{**settings_, "workers": 3}))
    assert encode_calls == []  # encoded by the worker processes, not here
    assert one.directory.name == three.directory.name  # workers are not part of the fingerprint
    assert shard_files(one) == shard_files(three) and len(shard_files(one)) >= 3
    assert one.meta == three.meta


def test_a_bpe_tokenizer_counted_by_two_workers_is_the_file_one_process_trains(tmp_path, corpus_dir, monkeypatch):
    from jaxgpt.data import encode
    from jaxgpt.tokenizers import bpe_training

    splits = []  # the texts cut into pieces in this process, for counting
    original = bpe_training.split
    monkeypatch.setattr(bpe_training, "split", lambda splitter, text: splits.append(text) or original(splitter, text))
    pools = []  # each worker process is a pool of its own

    class Pool(encode.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            pools.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(encode, "ProcessPoolExecutor", Pool)
    settings_ = {"tokenizer": "bpe", "vocab_size": 400, "encode_batch_bytes": 8_000}
    one = data.prepare(config(tmp_path, corpus_dir, "one", **settings_))
    assert len(splits) > 200 and pools == []  # every train document, counted here
    splits.clear()
    two = data.prepare(config(tmp_path, corpus_dir, "two", **{**settings_, "workers": 2}))
    assert splits == []  # counted by the worker processes
    assert len(pools) == 2  # the same two processes counted the sample and encoded the corpus
    assert (one.directory / "tokenizer.json").read_bytes() == (two.directory / "tokenizer.json").read_bytes()
    assert shard_files(one) == shard_files(two)


@pytest.mark.parametrize("sample_bytes", [400_000, 60_000], ids=["corpus within the sample", "corpus beyond it"])
def test_a_sample_let_go_and_its_reading_kept_on_disk_change_no_byte(tmp_path, corpus_dir, monkeypatch,
                                                                     sample_bytes):
    """The BPE's sample is read once and not held, and what the first pass read waits in a file of
    the build (not in memory) to be encoded when it was the whole corpus: the tokenizer, shards and
    meta.json are those of a sample and a first pass held in memory, with 1 worker and with 2; a
    corpus within the sample is read from its source once, one beyond it twice."""
    from jaxgpt.data import split, stream

    class Held(split.TrainSample):  # as before: the sample and what it read held in memory
        def __init__(self, items, max_bytes, keep=True, spill=None):
            super().__init__(items, max_bytes)

    passes = []
    original = stream.corpus_items
    monkeypatch.setattr(stream, "corpus_items", lambda *args: passes.append(1) or original(*args))
    settings_ = {"tokenizer": "bpe", "vocab_size": 400, "tokenizer_sample_bytes": sample_bytes,
                 "encode_batch_bytes": 8_000, "shard_tokens": 30_000}
    let_go = {workers: data.prepare(config(tmp_path, corpus_dir, f"let-go-{workers}", **settings_, workers=workers))
              for workers in (1, 2)}
    assert len(passes) == (2 if sample_bytes == 400_000 else 4)
    monkeypatch.setattr(stream, "TrainSample", Held)
    held = data.prepare(config(tmp_path, corpus_dir, "held", **settings_, workers=2))
    for corpus in let_go.values():
        assert (corpus.directory / "tokenizer.json").read_bytes() == (held.directory / "tokenizer.json").read_bytes()
        assert shard_files(corpus) == shard_files(held) and len(shard_files(held)) >= 2
        assert (corpus.directory / "meta.json").read_bytes() == (held.directory / "meta.json").read_bytes()
        assert sorted(p.name for p in corpus.directory.iterdir()) == sorted(p.name for p in held.directory.iterdir())
    assert (held.meta["tokenizer_sample"]["bytes"] < sample_bytes) == (sample_bytes == 400_000)


def test_workers_count_apart_into_disjoint_shares_then_run_what_is_asked_meanwhile(tmp_path):
    import functools
    import tempfile

    from jaxgpt.data.encode import Workers
    from jaxgpt.tokenizers.bpe_training import PieceTally, Words
    from jaxgpt.tokenizers.pretokenize import GPT2_SPLIT_PATTERN

    documents = [f"document {i}: " + " ".join(WORDS[(i * k) % len(WORDS)] for k in range(40)) for i in range(30)]
    marks = tmp_path / "marks"
    marks.mkdir()
    tokenizer = tokenizers.CharTokenizer.train(documents)
    with Workers(2) as workers:
        shares = workers.counted(PieceTally(GPT2_SPLIT_PATTERN), documents, batch_chars=500,
                                 then=functools.partial(tempfile.mkstemp, dir=marks))
        # The same workers encode next (after `then`: each runs what it is given in order).
        encoded = list(workers.encoded([("train", d) for d in documents], tokenizer, np.uint16, batch_chars=500))
    assert [ids.tolist() for _, ids, _, _ in encoded] == [tokenizer.encode(d) for d in documents]
    here = PieceTally(GPT2_SPLIT_PATTERN)
    for document in documents:
        here.add(document)
    (alone,) = here.result()
    counts = [dict(zip(share.words(), share.counts.tolist(), strict=True)) for share in shares]
    assert len(shares) == 2 and not counts[0].keys() & counts[1].keys()  # each piece in one share
    assert counts[0] | counts[1] == dict(zip(alone.words(), alone.counts.tolist(), strict=True))
    assert Words.concatenated(shares).counts.sum() == alone.counts.sum()
    assert len(list(marks.iterdir())) == 2  # each worker ran `then` once it had joined its share


# --- shards ------------------------------------------------------------------------------------


def test_small_shards_hold_the_tokens_of_one_file_and_windows_cross_them(tmp_path, corpus_dir):
    whole = data.prepare(config(tmp_path, corpus_dir, "whole"))
    sharded = data.prepare(config(tmp_path, corpus_dir, "sharded", shard_tokens=7_000))
    assert len(whole.meta["splits"]["train"]["shards"]) == 1
    shards = sharded.meta["splits"]["train"]["shards"]
    assert len(shards) > 10 and all(s["tokens"] == 7_000 for s in shards[:-1]) and shards[-1]["tokens"] <= 7_000
    for split in ("train", "val"):
        tokens = concatenated_split(sharded, split)
        np.testing.assert_array_equal(tokens, np.asarray(getattr(whole, split)))
        assert sum(s["tokens"] for s in sharded.meta["splits"][split]["shards"]) == len(tokens)
    assert isinstance(sharded.train, ShardedTokens)
    train = concatenated_split(sharded, "train")
    for step in range(20):  # 20 × 16 windows of 129 tokens over 11+ seams: many cross one
        for a, b in zip(data.train_batch(sharded.train, seed=3, step=step, batch_size=16, block_size=128),
                        data.train_batch(train, seed=3, step=step, batch_size=16, block_size=128), strict=True):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(data.eval_batch(sharded.train, 2, batch_size=8, block_size=1000, stride=600),
                    data.eval_batch(train, 2, batch_size=8, block_size=1000, stride=600), strict=True):
        np.testing.assert_array_equal(a, b)


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6).filter(lambda ls: sum(ls) > 0), data_=st.data())
def test_sharded_tokens_index_like_their_concatenation(lengths, data_):
    parts = [np.arange(sum(lengths[:i]), sum(lengths[:i + 1]), dtype=np.uint16) for i in range(len(lengths))]
    tokens, whole = ShardedTokens(parts), np.arange(sum(lengths), dtype=np.uint16)
    n = len(whole)
    assert len(tokens) == n and tokens.shape == (n,) and tokens.dtype == whole.dtype
    np.testing.assert_array_equal(np.asarray(tokens), whole)
    start, stop, step = data_.draw(st.integers(-n - 2, n + 2)), data_.draw(st.integers(-n - 2, n + 2)), \
        data_.draw(st.sampled_from([1, 1, 2, -1]))
    np.testing.assert_array_equal(tokens[start:stop:step], whole[start:stop:step])
    index = data_.draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=12))
    np.testing.assert_array_equal(tokens[np.array(index).reshape(-1, 1)], whole[np.array(index).reshape(-1, 1)])
    assert tokens[index[0]] == whole[index[0]]
    with pytest.raises(IndexError):
        tokens[np.array([n])]


# --- resuming a stopped build ------------------------------------------------------------------

KILLED = """
import json, os, signal, sys
from jaxgpt import data
from jaxgpt.data import stream
original, saves = stream._Build._save, []
def save_then_die(self, *args):
    original(self, *args)
    saves.append(1)
    if len(saves) == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup runs, as after a power cut
stream._Build._save = save_then_die
data.prepare(json.loads(sys.argv[1]))
"""


def killed_build(cfg: dict, after_checkpoints: int) -> Path:
    """Run `prepare(cfg)` in a process that kills itself with SIGKILL right after writing its
    n-th checkpoint (the first is written before any token); return its build directory."""
    done = subprocess.run([sys.executable, "-c", KILLED, json.dumps(cfg), str(after_checkpoints)],
                          capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    (partial,) = Path(cfg["cache_dir"]).iterdir()
    assert partial.name.startswith(".") and partial.name.endswith(".partial")
    return partial


def test_a_killed_build_resumes_at_its_last_shard_and_equals_an_uninterrupted_one(tmp_path, corpus_dir,
                                                                                   encode_calls):
    cfg = config(tmp_path, corpus_dir, "killed", shard_tokens=5_000)
    partial = killed_build(cfg, after_checkpoints=20)
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in partial.glob("*.bin")}
    assert len(finished) == 19  # checkpoint k (from 2) follows shard k − 1
    encode_calls.clear()
    resumed = data.prepare(cfg)
    assert 0 < len(encode_calls) < 240 * 0.7  # the documents before the checkpoint were not encoded again
    for name, stamp in finished.items():  # kept as they were, never written again
        path = resumed.directory / name
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == stamp
    uninterrupted = data.prepare(config(tmp_path, corpus_dir, "straight", shard_tokens=5_000))
    assert shard_files(resumed) == shard_files(uninterrupted)
    assert resumed.meta == uninterrupted.meta
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == [resumed.directory.name]


def test_a_truncated_shard_of_a_stopped_build_is_detected_and_written_again(tmp_path, corpus_dir):
    cfg = config(tmp_path, corpus_dir, "killed", shard_tokens=5_000, tokenizer="bpe", vocab_size=280)
    partial = killed_build(cfg, after_checkpoints=8)
    damaged = partial / "train-00002.bin"
    damaged.write_bytes(damaged.read_bytes()[:-10])  # a disk that lost the end of a file
    resumed = data.prepare(cfg)
    uninterrupted = data.prepare(config(tmp_path, corpus_dir, "straight", shard_tokens=5_000, tokenizer="bpe",
                                        vocab_size=280))
    assert shard_files(resumed) == shard_files(uninterrupted)
    assert resumed.meta == uninterrupted.meta


KILLED_AT_PHASE = """
import json, os, signal, sys
from jaxgpt import data
from jaxgpt.data import cache, stream

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup runs, as after a power cut

def then_die(function, after=1):
    calls = []
    def wrapped(*args, **kwargs):
        function(*args, **kwargs)
        calls.append(1)
        if len(calls) == after:
            die()
    return wrapped

phase = sys.argv[2]
if phase == "tokenizer written":
    stream._tokenizer = then_die(stream._tokenizer)
elif phase == "train shards written":
    stream._Build._save = then_die(stream._Build._save, after=4)
elif phase == "every document written":  # the last shards still open
    stream._Build.finish = die
elif phase == "shards finished":
    stream._Build.finish = then_die(stream._Build.finish)
elif phase == "meta written":
    cache._write = then_die(cache._write)
data.prepare(json.loads(sys.argv[1]))
"""


def file_hashes(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


@pytest.mark.parametrize("phase", ["tokenizer written", "train shards written", "every document written",
                                   "shards finished", "meta written"])
def test_a_build_killed_at_each_phase_resumes_to_the_files_of_an_uninterrupted_one(tmp_path, corpus_dir, phase):
    uninterrupted = data.prepare(config(tmp_path, corpus_dir, "straight", shard_tokens=5_000))
    cfg = config(tmp_path, corpus_dir, "killed", shard_tokens=5_000)
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_PHASE, json.dumps(cfg), phase], capture_output=True,
                            timeout=120)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    (partial,) = (tmp_path / "killed").iterdir()
    if phase == "every document written":  # the validation split's last shard was open and gets no more tokens
        last = json.loads((partial / "progress.json").read_text())["checkpoints"][-1]
        assert last["writers"]["val"]["open_tokens"] > 0
        assert last["counts"]["val"]["documents"] == uninterrupted.meta["splits"]["val"]["documents"]
    resumed = data.prepare(cfg)
    assert file_hashes(resumed.directory) == file_hashes(uninterrupted.directory)
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == [resumed.directory.name]


def test_a_full_disk_names_where_and_that_a_rerun_resumes_and_the_rerun_does(tmp_path, corpus_dir, monkeypatch):
    cfg = config(tmp_path, corpus_dir, "full", shard_tokens=5_000)
    real_write, writes = ShardWriter.write, []

    def write_until_full(self, tokens):
        writes.append(1)
        if len(writes) == 100:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, tokens)

    monkeypatch.setattr(ShardWriter, "write", write_until_full)
    with pytest.raises(data.DataError) as raised:
        data.prepare(cfg)
    (partial,) = (tmp_path / "full").iterdir()
    message = str(raised.value)
    assert f"no space left on the device that holds {partial}" in message and "\n" not in message
    assert "run the same command again, and the preparation resumes where it stopped" in message
    assert (partial / "progress.json").is_file()  # nothing lost
    monkeypatch.setattr(ShardWriter, "write", real_write)
    resumed = data.prepare(cfg)
    uninterrupted = data.prepare(config(tmp_path, corpus_dir, "straight", shard_tokens=5_000))
    assert file_hashes(resumed.directory) == file_hashes(uninterrupted.directory)


def test_damaged_shards_of_a_cache_are_rebuilt_alone_and_the_others_kept(tmp_path, corpus_dir, encode_calls):
    cfg = config(tmp_path, corpus_dir, shard_tokens=5_000, tokenizer="bpe", vocab_size=280, encode_batch_bytes=4_000)
    first = data.prepare(cfg)
    shards = {split: first.meta["splits"][split]["shards"] for split in ("train", "val")}
    assert len(shards["train"]) >= 10 and len(shards["val"]) >= 2
    intact = file_hashes(first.directory)
    damaged = np.fromfile(first.directory / "train-00003.bin", np.uint16)
    damaged[7] = (damaged[7] + 1) % first.tokenizer.vocab_size  # another valid id: only the checksum sees it
    damaged.tofile(first.directory / "train-00003.bin")
    (first.directory / "val-00001.bin").unlink()
    kept = {path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in first.directory.glob("*.bin")
            if path.name != "train-00003.bin"}
    encode_calls.clear()
    with pytest.warns(UserWarning, match=r"\(train-00003.bin does not match its checksum, val-00001.bin is missing or "
                                         r"has the wrong size for \d+ tokens\): rebuilding only the damaged shard"):
        mended = data.prepare(cfg)
    assert mended.directory == first.directory and file_hashes(mended.directory) == intact
    assert {name: (first.directory / name).stat().st_ino for name in kept} == {n: s[0] for n, s in kept.items()}
    encoded = sum(len(text) for text in encode_calls)
    assert 0 < encoded < 0.3 * sum(counts["bytes"] for counts in first.meta["splits"].values())  # not the corpus
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [first.directory.name]


def test_a_second_process_waits_for_the_build_in_progress_and_never_reads_it(tmp_path, corpus_dir):
    name = data.prepare(config(tmp_path, corpus_dir, "elsewhere")).directory.name  # the fingerprint's name
    build = tmp_path / "cache" / f".{name}.partial"
    build.mkdir(parents=True)
    lock = open(build / ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # as a process that is building this very cache holds it
    stderr = open(tmp_path / "stderr.txt", "w+")
    script = "import json, sys\nfrom jaxgpt import data\nprint(data.prepare(json.loads(sys.argv[1])).directory)"
    waiter = subprocess.Popen([sys.executable, "-c", script, json.dumps(config(tmp_path, corpus_dir))],
                              stdout=subprocess.PIPE, stderr=stderr)
    try:
        deadline = time.monotonic() + 60
        while "waiting for another process" not in (tmp_path / "stderr.txt").read_text():
            assert waiter.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()
            time.sleep(0.1)
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [build.name]  # nothing published
    finally:
        lock.close()  # the holder ends: the waiter takes the lock and builds
    out, _ = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, (tmp_path / "stderr.txt").read_text()[-2000:]
    directory = Path(out.decode().strip())
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [name] == [directory.name]
    assert not (directory / ".lock").exists()
    assert shard_files(data.open_corpus(directory)) == shard_files(data.open_corpus(tmp_path / "elsewhere" / name))


# --- encoding workers and their parent -----------------------------------------------------------

STALLING_WORKERS = """
import faulthandler, json, os, signal, sys, time
from pathlib import Path
from jaxgpt import data
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that waits in vain asks for every thread's stack
# Ctrl-C raises KeyboardInterrupt here, as in a terminal's foreground process, whatever this process inherited:
# one forked while the test process had SIGINT ignored (for a moment, by a library) would ignore it too
signal.signal(signal.SIGINT, signal.default_int_handler)
from jaxgpt.tokenizers import CharTokenizer

class Stalling(CharTokenizer):
    \"\"\"A worker leaves its pid in a file, then stalls on its batch as on a very long document.\"\"\"
    def encode(self, text, *args, **kwargs):
        if os.environ.get("JAXGPT_ENCODING_WORKER"):
            Path(sys.argv[2], f"worker-{os.getpid()}").touch()
            time.sleep(300)
        return super().encode(text, *args, **kwargs)

if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    tokenizer = Stalling.train([p.read_text(encoding="utf-8") for p in sorted(Path(cfg["source"]).iterdir())])
    data.prepare(cfg, tokenizer=tokenizer)
"""


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie that nobody reaped has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def stalled_preparation(tmp_path: Path, corpus_dir: Path) -> tuple[subprocess.Popen, list[int]]:
    """A preparation whose two encoding workers have started on their batches and stall there."""
    script, marks = tmp_path / "stalling.py", tmp_path / "marks"
    script.write_text(STALLING_WORKERS, encoding="utf-8")
    marks.mkdir()
    cfg = config(tmp_path, corpus_dir, workers=2, encode_batch_bytes=2_000)
    process = subprocess.Popen([sys.executable, str(script), json.dumps(cfg), str(marks)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(list(marks.iterdir())) < 2:
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    return process, [int(mark.name.split("-")[1]) for mark in marks.iterdir()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signal_", [signal.SIGKILL, signal.SIGTERM])
def test_encoding_workers_end_with_their_parent_however_it_is_killed(tmp_path, corpus_dir, signal_):
    process, workers = stalled_preparation(tmp_path, corpus_dir)
    try:
        process.send_signal(signal_)  # the parent alone, not its process group
        process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(alive, workers)), "the workers outlived their parent"
    finally:
        for pid in [process.pid, *workers]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_one_ctrl_c_stops_a_preparation_at_once_with_its_workers(tmp_path, corpus_dir):
    process, workers = stalled_preparation(tmp_path, corpus_dir)
    try:
        interrupted = time.monotonic()
        process.send_signal(signal.SIGINT)  # as Ctrl-C does; the workers ignore it, their parent stops them
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGUSR1)
            time.sleep(1)
            process.kill()
            raise AssertionError("the preparation did not stop:\n" + process.stderr.read().decode()[-6000:]) from None
        assert time.monotonic() - interrupted < 3, "the workers' batches were waited for"
        assert b"KeyboardInterrupt" in process.stderr.read()
        assert not any(map(alive, workers))
        (partial,) = (tmp_path / "cache").iterdir()
        assert (partial / "progress.json").is_file()  # kept, to resume from
    finally:
        for pid in [process.pid, *workers]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# --- memory ------------------------------------------------------------------------------------

PEAK = """
import json, os, resource, sys
from jaxgpt import data
corpus = data.prepare(json.loads(sys.argv[1]))
if os.path.exists("/proc/self/status"):  # this program's own peak: Linux's ru_maxrss keeps the parent's across exec
    peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
else:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
print(corpus.meta["splits"]["train"]["bytes"], peak)
"""


def peak_memory(cfg: dict) -> tuple[int, int]:
    """(train bytes prepared, peak resident bytes) of a process that prepares `cfg` (its own, not
    the peak of this test process, which a child's ru_maxrss would report on Linux)."""
    done = subprocess.run([sys.executable, "-c", PEAK, json.dumps(cfg)], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    text_bytes, peak = done.stdout.decode().split()[-2:]
    return int(text_bytes), int(peak)


def test_peak_memory_stays_bounded_whatever_the_corpus_size(tmp_path):
    big = tmp_path / "big.jsonl"
    line = json.dumps({"text": "All work and no play makes Jack a dull boy. " * 230})  # ~10 KB
    with open(big, "w", encoding="utf-8") as file:
        for i in range(3_000):  # 30 MB, streamed one line at a time
            file.write(line.replace("Jack", f"Jack{i}", 1) + "\n")
    small = tmp_path / "small.jsonl"
    small.write_text(line + "\n" + line + "\n", encoding="utf-8")
    limits = {"tokenizer_sample_bytes": 500_000, "encode_batch_bytes": 500_000, "shard_tokens": 4_000_000}
    _, baseline = peak_memory(config(tmp_path, small, **limits))
    prepared, peak = peak_memory(config(tmp_path, big, **limits))
    assert prepared > 25e6
    # Holding the corpus would take more than its 30 MB of text; the batches and sample take a few.
    assert peak - baseline < 12e6, f"preparing {prepared / 1e6:.0f} MB grew the process by {(peak - baseline) / 1e6} MB"


def test_a_bpe_sample_as_large_as_the_corpus_is_counted_not_held(tmp_path):
    """BPE learns from counted pieces in one pass: its 30 MB sample, here the whole corpus, is not
    held in memory (nor is what the first pass read, which waits on disk to be encoded)."""
    line = json.dumps({"text": "All work and no play makes Jack a dull boy. " * 230})  # ~10 KB
    for name, lines in (("big", 3_000), ("small", 150)):  # 30 MB; 1.5 MB, which builds the same encoders
        with open(tmp_path / f"{name}.jsonl", "w", encoding="utf-8") as file:
            for i in range(lines):
                file.write(line.replace("Jack", f"{name}{i}", 1) + "\n")
    limits = {"tokenizer": "bpe", "vocab_size": 300, "tokenizer_sample_bytes": 40_000_000,
              "encode_batch_bytes": 500_000, "shard_tokens": 4_000_000}
    _, baseline = peak_memory(config(tmp_path, tmp_path / "small.jsonl", **limits))
    prepared, peak = peak_memory(config(tmp_path, tmp_path / "big.jsonl", **limits))
    assert prepared > 25e6
    assert peak - baseline < 12e6, f"preparing {prepared / 1e6:.0f} MB grew the process by {(peak - baseline) / 1e6} MB"


# --- the tokenizer's sample ---------------------------------------------------------------------


def test_the_tokenizer_learns_from_the_first_train_documents_up_to_the_sample_size(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(30):
        (root / f"{i:02d}.txt").write_text("abc " * 50 if i < 20 else "xyz " * 50, encoding="utf-8")
    corpus = data.prepare(config(tmp_path, root, tokenizer_sample_bytes=2_500, val_fraction=0.0))
    sample = corpus.meta["tokenizer_sample"]
    assert (sample["bytes"], sample["documents"], sample["limit"]) == (2_500, 13, 2_500)  # 12 × 200 bytes + 100
    assert corpus.tokenizer.encode("xyz").count(corpus.tokenizer.unk_id) == 3  # never in the sample
    assert corpus.tokenizer.decode(corpus.tokenizer.encode("cab a")) == "cab a"


# --- the prepare command -----------------------------------------------------------------------


def test_prepare_command_prepares_the_data_of_a_config_and_prints_where(tmp_path, corpus_dir):
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-m", "jaxgpt.data", f"--config={ROOT / 'configs/default.py'}",
                           f"--config.data.source={corpus_dir}", f"--config.data.cache_dir={cache}",
                           "--config.data.tokenizer=char", "--config.data.workers=1"],
                          capture_output=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    out = done.stdout.decode()
    (directory,) = cache.iterdir()
    corpus = data.open_corpus(directory)
    assert f"cache: {directory}" in out
    for split in ("train", "val"):
        assert f"{split}: {corpus.meta['splits'][split]['tokens']:,} tokens" in out
    assert "documents" in done.stderr.decode() and "B/s" in done.stderr.decode()  # the progress bar
    wrong = subprocess.run([sys.executable, "-m", "jaxgpt.data", "--config.data.sourc=x"],
                           capture_output=True, timeout=120, cwd=tmp_path)
    assert wrong.returncode == 2 and wrong.stderr.decode().strip() == "prepare: no key 'data.sourc'; did you mean " \
                                                                      "'data.source'?"


def test_the_commands_old_name_says_the_new_one_and_runs_it_with_two_workers(tmp_path, corpus_dir):
    """`python -m jaxgpt.data.prepare` (older docs and scripts) forwards to `python -m jaxgpt.data`:
    the same arguments, the same cache, a note on stderr; its spawned workers start as they do for
    the new name. Imported, the module leaves `jaxgpt.data.prepare` the function."""
    arguments = [f"--config.data.source={corpus_dir}", f"--config.data.cache_dir={tmp_path / 'cache'}",
                 "--config.data.tokenizer=char", "--config.data.workers=2", "--config.data.encode_batch_bytes=8000"]
    done = subprocess.run([sys.executable, "-m", "jaxgpt.data.prepare", *arguments], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.splitlines()[0] == ("note: `python -m jaxgpt.data.prepare` is now `python -m jaxgpt.data` "
                                           "(same arguments); running that")
    (directory,) = (tmp_path / "cache").iterdir()
    assert f"cache: {directory}" in done.stdout
    assert data.open_corpus(directory).meta["splits"]["val"]["documents"] > 0
    again = subprocess.run([sys.executable, "-m", "jaxgpt.data", *arguments], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
    assert again.returncode == 0 and f"cache: {directory}" in again.stdout  # the very cache, reused
    probe = ("import jaxgpt.data.prepare, jaxgpt.data.cache as c; from jaxgpt import data; "
             "print(data.prepare is c.prepare, jaxgpt.data.prepare is c.prepare)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def test_the_prepare_command_prints_a_warning_as_one_line_and_a_bad_cache_dir_is_named(tmp_path):
    source = tmp_path / "latin.txt"
    source.write_bytes("caf\xe9 au lait, na\xefve\n".encode("latin-1"))  # not UTF-8
    command = [sys.executable, "-m", "jaxgpt.data", f"--config.data.source={source}", "--config.data.tokenizer=char"]
    done = subprocess.run([*command, f"--config.data.cache_dir={tmp_path / 'cache'}"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.replace("\r", "\n").splitlines()
    assert [line for line in lines if "undecodable" in line] == [
        f"warning: reading the corpus: replaced 2 undecodable byte sequence(s) with U+FFFD in 1 file(s), e.g. {source}"]
    assert "UserWarning" not in done.stderr and "warnings.warn" not in done.stderr
    (tmp_path / "taken").write_text("a file where the cache's directory goes")
    with pytest.raises(data.DataError) as refused:
        data.prepare(config(tmp_path, source, cache="taken/cache"))
    assert str(refused.value) == (f"cannot make the token cache's directory {tmp_path / 'taken' / 'cache'} (Not a "
                                  f"directory: {tmp_path / 'taken' / 'cache'}); set data.cache_dir to a directory "
                                  "this user can write")


# --- caches of the single-file format -----------------------------------------------------------


def write_version_2_cache(directory: Path, train_docs: list[str], val_docs: list[str]) -> Tokenizer:
    """A cache as jaxgpt wrote it before shards: train.bin and val.bin, one checksum each."""
    directory.mkdir(parents=True)
    tokenizer = tokenizers.train_tokenizer("char", train_docs)
    tokenizer.save(directory / "tokenizer.json")
    splits = {}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        ids = [i for k, doc in enumerate(docs) for i in ([tokenizer.eos_id] if k else []) + tokenizer.encode(doc)]
        content = np.asarray(ids, np.uint16).tobytes()
        (directory / f"{split}.bin").write_bytes(content)
        splits[split] = {"tokens": len(ids), "bytes": sum(len(d.encode()) for d in docs), "documents": len(docs),
                         "blake2b": hashlib.blake2b(content, digest_size=16).hexdigest()}
    meta = {"format": "jaxgpt-tokens", "version": 2, "fingerprint": "0" * 64, "source": "old", "val_source": None,
            "val_fraction": 0.5, "max_documents": None, "max_bytes": None, "dtype": "uint16",
            "tokenizer": {"kind": "char", "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
                          "sha256": hashlib.sha256((directory / "tokenizer.json").read_bytes()).hexdigest()},
            "splits": splits}
    (directory / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    return tokenizer


def test_a_single_file_cache_of_version_2_still_opens(tmp_path):
    train_docs, val_docs = ["first document", "second one"], ["held out"]
    tokenizer = write_version_2_cache(tmp_path / "old", train_docs, val_docs)
    corpus = data.open_corpus(tmp_path / "old", tokenizer=tokenizer)
    eos = [tokenizer.eos_id]
    assert np.asarray(corpus.train).tolist() == tokenizer.encode(train_docs[0]) + eos + tokenizer.encode(train_docs[1])
    assert np.asarray(corpus.val).tolist() == tokenizer.encode(val_docs[0])
    x, y = data.train_batch(corpus.train, seed=0, step=0, batch_size=2, block_size=8)
    assert x.shape == y.shape == (2, 8)
    with open(tmp_path / "old" / "train.bin", "r+b") as file:  # its checksum is still checked
        file.seek(2)
        file.write(np.uint16(tokenizer.eos_id).tobytes())
    with pytest.raises(data.DataError, match=r"train.bin does not match its checksum"):
        data.open_corpus(tmp_path / "old")


def test_an_empty_validation_split_has_no_shard(tmp_path, corpus_dir):
    corpus = data.prepare(config(tmp_path, corpus_dir, val_fraction=0.0))
    assert corpus.meta["splits"]["val"] == {"documents": 0, "bytes": 0, "tokens": 0, "shards": []}
    assert len(corpus.val) == 0 and not list(corpus.directory.glob("val-*"))
    assert os.path.getsize(corpus.directory / "train-00000.bin") == 2 * len(corpus.train)


def test_a_directory_of_gpt2_files_is_a_tokenizer(tmp_path, corpus_dir):
    """data.tokenizer = a directory with vocab.json + merges.txt: the same tokens as that BPE given directly."""
    bpe = tokenizers.BPETokenizer.train(corpus_dir.joinpath("doc00000.txt").read_text(encoding="utf-8"), 300)
    bpe.save_gpt2(tmp_path / "gpt2")
    given = data.prepare(config(tmp_path, corpus_dir, cache="a"), tokenizer=tokenizers.BPETokenizer.from_gpt2(
        tmp_path / "gpt2" / "vocab.json", tmp_path / "gpt2" / "merges.txt"))
    named = data.prepare(config(tmp_path, corpus_dir, cache="b", tokenizer=str(tmp_path / "gpt2")))
    assert shard_files(named) == shard_files(given) and len(shard_files(named)) == 2


def test_an_encoding_worker_and_the_preparing_process_import_no_jax():
    """What a spawned worker imports (the encoder and the tokenizers, and the command's module, which
    each worker of `python -m jaxgpt.data` imports again) leaves JAX out: a worker costs the
    tokenizer's memory, not JAX's. So does `data.prepare`: its process starts in a fraction of a second."""
    probe = ("import sys, jaxgpt.data.encode, jaxgpt.data.__main__; from jaxgpt.data import prepare; "
             "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
