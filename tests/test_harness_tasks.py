"""The harness's index of its built-in tasks kept on disk (jaxgpt.harness.tasks): the index read
back is the one the harness builds from the files, and any change to the files builds it again.
A small directory of YAML tasks stands for the built-in one."""

import os
import pickle

import pytest

pytest.importorskip("lm_eval")

from lm_eval.tasks._index import TaskIndex  # noqa: E402

from jaxgpt.harness import tasks  # noqa: E402


def write_task(directory, name, tag=None, text="x"):
    lines = [f"task: {name}", "dataset_path: json", "output_type: multiple_choice", f"doc_to_text: '{text}'"]
    (directory / f"{name}.yaml").write_text("\n".join(lines + ([f"tag: {tag}"] if tag else [])) + "\n")


@pytest.fixture
def builtin(tmp_path, monkeypatch):
    """A stand-in for the harness's tasks directory (three tasks, one group, a tag), and a spy on
    what the harness's own index builder is asked to read."""
    root = tmp_path / "builtin"
    (root / "sub").mkdir(parents=True)
    write_task(root, "alpha", tag="letters")
    write_task(root, "beta", tag="letters")
    write_task(root / "sub", "gamma")
    (root / "sub" / "_group.yaml").write_text("group: greek\ntask: [alpha, gamma]\n")
    monkeypatch.setattr(tasks, "builtin_root", lambda: root)
    built = []
    original = TaskIndex.build
    monkeypatch.setattr(TaskIndex, "build", staticmethod(lambda paths, **kw: built.append(list(paths)) or original(
        paths, **kw)))
    return root, original, built


def summary(index):
    return {name: (entry.kind, entry.yaml_path, sorted(entry.tags), entry.cfg) for name, entry in index.items()}


def test_the_kept_index_is_the_harness_own_and_is_read_back_without_reading_the_files(builtin, tmp_path):
    root, original, built = builtin
    local = tmp_path / "local"
    local.mkdir()
    write_task(local, "beta", text="mine")  # a local task of a built-in's name wins, as in the harness
    write_task(local, "delta")
    want = summary(original([root, local]))
    cache = tmp_path / "cache" / tasks.CACHE_NAME
    for _ in range(2):
        with tasks.kept_builtin_index(cache):
            got = summary(TaskIndex.build([root, local]))
        assert got == want
    assert got["beta"][3]["doc_to_text"] == "mine" and got["letters"][2] == ["alpha", "beta"]
    assert built == [[root], [local], [local]]  # the built-in directory read once; the local one each time
    assert TaskIndex.build([root]) is not None and built[-1] == [root]  # the harness's own builder again after


def test_any_change_to_the_files_builds_the_index_again(builtin, tmp_path):
    root, original, built = builtin
    cache = tmp_path / tasks.CACHE_NAME
    with tasks.kept_builtin_index(cache):
        TaskIndex.build([root])
        write_task(root, "alpha", tag="letters", text="longer than before")
        assert summary(TaskIndex.build([root])) == summary(original([root]))
        write_task(root / "sub", "epsilon")
        assert "epsilon" in TaskIndex.build([root])
        os.utime(root / "beta.yaml", ns=(1, 1))  # the same bytes, another time
        TaskIndex.build([root])
    assert built == [[root]] * 4


@pytest.mark.parametrize("damage", ["garbage", "another_key", "not_a_dict", "directory"])
def test_a_cache_that_cannot_be_read_or_written_is_built_again_without_an_error(builtin, tmp_path, damage):
    root, original, built = builtin
    cache = tmp_path / tasks.CACHE_NAME
    if damage == "garbage":
        cache.write_bytes(b"\0not a pickle")
    elif damage == "another_key":
        cache.write_bytes(pickle.dumps({"key": "0" * 64, "index": {"stale": None}}))
    elif damage == "not_a_dict":
        cache.write_bytes(pickle.dumps([1, 2, 3]))
    else:
        cache.mkdir()  # neither readable nor writable as a file
    with tasks.kept_builtin_index(cache):
        assert summary(TaskIndex.build([root])) == summary(original([root]))
        assert summary(TaskIndex.build([root])) == summary(original([root]))
    assert len(built) == (2 if damage == "directory" else 1)  # rebuilt once and kept, or each time
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(tasks.CACHE_NAME)] == [tasks.CACHE_NAME]


def test_the_cache_lives_in_the_users_cache_directory(monkeypatch, tmp_path):
    assert tasks.cache_path({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "jaxgpt" / tasks.CACHE_NAME
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tasks.cache_path({}) == tmp_path / ".cache" / "jaxgpt" / tasks.CACHE_NAME
