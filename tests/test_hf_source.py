"""The hf: source (jaxgpt.data.sources.hf): local parquet, JSON lines and save_to_disk datasets read
through `data.prepare` give back the rows written; bad input and an unreachable Hub fail in one
line, at once. The rows are written here with pyarrow, json and `datasets` itself."""

import http.server
import json
import threading
import time

import pytest

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from conftest import corpus_documents  # noqa: E402

from jaxgpt import data  # noqa: E402
from jaxgpt.config import DataConfig, HfConfig  # noqa: E402
from jaxgpt.data import DataError  # noqa: E402
from jaxgpt.data.sources.hf import hf_source, parse_spec  # noqa: E402

ROWS = ["The first row.\nTwo lines.", "Unicode: café, 東京, 🙂", "", "tabs\tand  spaces ", "last"]
KEPT = [row for row in ROWS if row]  # an empty row is no document


@pytest.fixture(autouse=True)
def own_datasets_cache(tmp_path, monkeypatch):
    """Whatever the library caches goes to tmp_path, never to the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def config(tmp_path, **overrides):
    return {"cache_dir": str(tmp_path / "cache"), "val_fraction": 0.0, "tokenizer": "bpe", "vocab_size": 300,
            **overrides}  # byte-level: lossless on any text, seen in training or not


def documents(corpus, split="train"):
    return corpus_documents(corpus, split)


def write_parquet(path, rows, **columns):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": rows, **columns}), path)
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps({"id": i, "text": row}) + "\n" for i, row in enumerate(rows)), encoding="utf-8")
    return path


def test_a_parquet_file_gives_its_rows(tmp_path):
    path = write_parquet(tmp_path / "rows.parquet", ROWS, id=list(range(len(ROWS))))
    assert documents(data.prepare(config(tmp_path, source=f"hf:{path}"))) == KEPT


def test_a_jsonl_file_gives_its_rows(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    assert documents(data.prepare(config(tmp_path, source=f"hf:{path}"))) == KEPT


def test_a_save_to_disk_directory_gives_its_rows_and_a_dataset_dict_its_split(tmp_path):
    datasets.Dataset.from_dict({"text": ROWS}).save_to_disk(tmp_path / "one")
    assert documents(data.prepare(config(tmp_path, source=f"hf:{tmp_path / 'one'}"))) == KEPT
    splits = datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": ROWS[:2]}),
                                  validation=datasets.Dataset.from_dict({"text": ROWS[3:]}))
    splits.save_to_disk(tmp_path / "two")
    corpus = data.prepare(config(tmp_path, source=f"hf:{tmp_path / 'two'}",
                                 val_source=f"hf:{tmp_path / 'two'}:validation"))
    assert documents(corpus) == ROWS[:2]
    assert documents(corpus, "val") == ROWS[3:]


def test_a_directory_of_parquet_files_takes_its_splits_from_the_file_names(tmp_path):
    write_parquet(tmp_path / "repo" / "data" / "train-00000-of-00001.parquet", ROWS[:2])
    write_parquet(tmp_path / "repo" / "data" / "test-00000-of-00001.parquet", ROWS[3:])
    assert documents(data.prepare(config(tmp_path, source=f"hf:{tmp_path / 'repo'}"))) == ROWS[:2]
    assert documents(data.prepare(config(tmp_path, source=f"hf:{tmp_path / 'repo'}::test"))) == ROWS[3:]


def test_a_missing_text_field_names_the_field_and_the_columns(tmp_path):
    path = write_parquet(tmp_path / "rows.parquet", ROWS, body=ROWS)
    with pytest.raises(DataError, match=r"no field 'content' \(its columns: text, body\)") as err:
        data.prepare(config(tmp_path, source=f"hf:{path}", hf={"text_field": "content"}))
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match="no field 'content'"):
        data.prepare(config(tmp_path, source=f"hf:{write_jsonl(tmp_path / 'rows.jsonl', ROWS)}",
                            hf={"text_field": "content"}))


def test_a_field_that_holds_no_text_is_an_error(tmp_path):
    path = write_parquet(tmp_path / "rows.parquet", ROWS, number=list(range(len(ROWS))))
    with pytest.raises(DataError, match="field 'number' holds int, not text"):
        data.prepare(config(tmp_path, source=f"hf:{path}", hf={"text_field": "number"}))


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9", "https://hub.invalid"])  # refused; no such host
def test_an_unreachable_hub_fails_at_once_in_one_line(tmp_path, monkeypatch, endpoint):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    start = time.monotonic()
    with pytest.raises(DataError, match="cannot be reached.*HF_DATASETS_OFFLINE.*local path") as err:
        data.prepare(config(tmp_path, source="hf:someone/thing"))
    assert time.monotonic() - start < 6
    assert "\n" not in str(err.value)


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The two Hub answers an hf: source asks for before reading: that the Hub is there, and a
    dataset's current revision (someone/thing is at commit 0123abc; nothing else exists)."""

    def do_HEAD(self):
        self.send_response(200)
        self.end_headers()

    def do_GET(self):
        if self.path.split("?")[0] == "/api/datasets/someone/thing":
            body = json.dumps({"id": "someone/thing", "sha": "0123abc"}).encode()
            self.send_response(200)
        else:
            body = b'{"error": "Repository not found"}'
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub(monkeypatch):
    from huggingface_hub import constants

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    yield
    server.shutdown()
    server.server_close()


def test_a_hub_dataset_is_identified_by_its_revision_and_a_missing_one_is_an_error(fake_hub):
    source = hf_source("hf:someone/thing:en:validation", DataConfig())
    assert source.identity == {"kind": "hf", "dataset": "someone/thing", "revision": "0123abc", "config": "en",
                               "split": "validation", "text_field": "text"}
    with pytest.raises(DataError, match="neither a local path nor a dataset on the Hugging Face Hub"):
        hf_source("hf:someone/missing", DataConfig())


def test_offline_a_hub_dataset_comes_from_the_datasets_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"  # own_datasets_cache's
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="neither a local path nor in the datasets cache"):
        data.prepare(config(tmp_path, source="hf:someone/thing"))
    # The layout the datasets cache has after a download: <owner>___<name>/<config>/<version>/<commit>.
    prepared = cache / "someone___thing" / "default" / "0.0.0" / "abc123"
    builder = datasets.load_dataset_builder("parquet", data_files=[str(write_parquet(tmp_path / "r.parquet", ROWS))])
    builder.download_and_prepare(output_dir=str(prepared))
    (prepared / "parquet-train.arrow").rename(prepared / "thing-train.arrow")
    source = hf_source("hf:someone/thing", DataConfig())
    assert source.identity["revision"] == "abc123"
    assert documents(data.prepare(config(tmp_path, source="hf:someone/thing"))) == KEPT


def test_the_identity_changes_with_the_files_and_the_settings(tmp_path):
    path = write_parquet(tmp_path / "rows.parquet", ROWS)
    first = hf_source(f"hf:{path}", DataConfig()).identity
    assert hf_source(f"hf:{path}", DataConfig()).identity == first
    assert hf_source(f"hf:{path}", DataConfig(hf=HfConfig(text_field="body"))).identity != first
    write_parquet(path, ROWS[:2])
    assert hf_source(f"hf:{path}", DataConfig()).identity != first


def test_specs_parse_and_mistakes_are_one_line_errors(tmp_path):
    assert parse_spec("hf:owner/name") == ("owner/name", None, None)
    assert parse_spec("hf:owner/name:validation") == ("owner/name", None, "validation")
    assert parse_spec("hf:owner/name:wikitext-2") == ("owner/name", "wikitext-2", None)
    assert parse_spec("hf:owner/name::extra") == ("owner/name", None, "extra")
    assert parse_spec("hf:owner/name:en:test") == ("owner/name", "en", "test")
    for bad in ["hf:", "hf::train", "hf:a:b:c:d"]:
        with pytest.raises(DataError, match="is not hf:NAME_OR_PATH"):
            parse_spec(bad)
    path = write_parquet(tmp_path / "rows.parquet", ROWS)
    with pytest.raises(DataError, match="has no configs"):
        hf_source(f"hf:{path}:mine", DataConfig())
    with pytest.raises(DataError, match="Bad split: test"):
        data.prepare(config(tmp_path, source=f"hf:{path}::test"))
    with pytest.raises(DataError, match="is not a file the hf: source reads"):
        hf_source(f"hf:{write_jsonl(tmp_path / 'rows.txt', ROWS)}", DataConfig())
    datasets.Dataset.from_dict({"text": ROWS}).save_to_disk(tmp_path / "one")
    with pytest.raises(DataError, match="holds one dataset, not splits"):
        data.prepare(config(tmp_path, source=f"hf:{tmp_path / 'one'}:train"))
