"""What a run is checked against before its first step (jaxgpt.train.preflight, through opening.open_run
and train.py): every section of the config, the settings init_from fixes (an explicit one is
refused, and config.json says what the run really uses), and the share of <|unk|> that a
tokenizer not trained on the data makes."""

import json

import numpy as np
import pytest
from runs import cli_args, tiny_config, trained_run, write_corpus
from test_run import run_train_py

from jaxgpt import tokenizers
from jaxgpt.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.mark.parametrize("key, value, message", [
    ("temperature", -1.0, "sample.temperature=-1.0: must be a finite number ≥ 0"),
    ("top_k", -5, "sample.top_k=-5: must be an integer ≥ 0"),
    ("max_new_tokens", -1, "sample.max_new_tokens=-1: must be an integer ≥ 0"),
    ("prompt", "", "sample.prompt='': must be a non-empty string"),
])
def test_an_impossible_sample_setting_stops_the_run_before_the_data_is_read(tmp_path, corpus, key, value, message):
    from jaxgpt.train.run import train

    config = tiny_config(tmp_path, corpus)
    config.sample[key] = value
    with pytest.raises(ConfigError, match=f"^{message}"):
        train(config)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_mesh_that_does_not_fit_stops_the_run_before_the_data_is_read(tmp_path, corpus):
    from jaxgpt.train.run import train

    config = tiny_config(tmp_path, corpus)
    config.mesh.data = 3  # one CPU device in this process
    with pytest.raises(ValueError, match=r"^mesh data=3, fsdp=1, tensor=1 does not fit 1 device \(CPU\): the product "
                                         r"of its sizes, 3, must divide 1; on a CPU, --config.mesh.cpu_devices=3 makes "
                                         r"3 devices \(this machine has \d+ cores\)"):
        train(config)
    assert not (tmp_path / "cache").exists()


# --- init_from: the source fixes the model and the tokenizer ------------------------------------


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A finished char-level run on the corpus's text (its 42-odd characters only), shared."""
    return trained_run(tmp_path_factory)[0]


def started_from(tmp_path, corpus, source, run="tuned", **changes):
    """A config that starts from `source`, with a preset's own choices for what the source fixes."""
    config = tiny_config(tmp_path, corpus, run, **{"data.tokenizer": "bpe", "data.vocab_size": 300,
                                                    "model.n_layer": 3, "model.d_model": 32, **changes})
    config.init_from = str(source)
    return config


def opened(config, explicit=()):
    from jaxgpt.train.run import open_run

    run = open_run(config, explicit)
    run.checkpoints.close()
    run.lock.release()
    return run


def test_a_preset_gives_way_to_the_source_and_config_json_says_what_the_run_uses(tmp_path, corpus, source):
    from jaxgpt.train.rundir import load_run

    _, source_cfg, source_tokenizer = load_run(source)
    run = opened(started_from(tmp_path, corpus, source))
    saved = json.loads((tmp_path / "tuned" / "config.json").read_text())
    assert tokenizers.load(saved["data"]["tokenizer"]) == source_tokenizer == run.corpus.tokenizer
    assert saved["data"]["vocab_size"] == source_tokenizer.vocab_size
    assert (saved["model"]["n_layer"], saved["model"]["d_model"]) == (source_cfg.n_layer, source_cfg.d_model)


@pytest.mark.parametrize("explicit, named", [
    (["data.tokenizer", "data.vocab_size"], ["data.tokenizer='bpe' (the source has its char tokenizer of",
                                             "data.vocab_size=300"]),
    (["model.n_layer"], ["model.n_layer=3 (the source has 1)"]),
])
def test_an_explicit_setting_the_source_fixes_is_refused_naming_it(tmp_path, corpus, source, explicit, named):
    with pytest.raises(ConfigError, match="^init_from=.* fixes what you set: ") as refused:
        opened(started_from(tmp_path, corpus, source), explicit=["train.steps", *explicit])
    assert all(name in str(refused.value) for name in named) and "train.steps" not in str(refused.value)
    assert not (tmp_path / "tuned" / "config.json").exists()


def test_explicit_settings_the_source_agrees_with_or_leaves_to_the_run_are_kept(tmp_path, corpus, source):
    config = started_from(tmp_path, corpus, source, **{"model.n_layer": 1, "model.block_size": 8})
    run = opened(config, explicit=["model.n_layer", "model.block_size"])
    assert (run.model.n_layer, run.model.block_size) == (1, 8)


def test_train_py_refuses_an_explicit_model_setting_of_init_from_in_one_line(tmp_path, corpus, source):
    args = [arg for arg in cli_args(tmp_path, corpus) if not arg.startswith(("--config.model.n_", "--config.model.d_",
                                                                              "--config.data.tok"))]
    out = run_train_py([*args, f"--config.init_from={source}", "--config.model.n_layer=5"])
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.n_layer=5 (the source has 1)" in lines[0] and "Leave it out" in lines[0]


def test_text_the_source_tokenizer_cannot_encode_is_refused_above_data_max_unknown(tmp_path, corpus, source):
    """Digits are not among the source's characters: their share of the train tokens is known
    from the text itself (one token per character, one <|eos|> per document)."""
    rng = np.random.default_rng(0)
    lines = [f"{rng.integers(10**5, 10**6)} the king." for _ in range(200)]  # 6 digits of 16 characters
    digits = tmp_path / "digits.txt"
    digits.write_text("\n".join(lines) + "\n")
    config = started_from(tmp_path, corpus, source, **{"model.n_layer": 1, "model.d_model": 16})
    config.data.source = str(digits)
    with pytest.raises(DataError, match=r"^3\d\.\d% of the train tokens are <\|unk\|>.*data.max_unknown=0.01"):
        opened(config)
    config.data.max_unknown = 0.5
    assert opened(config).corpus.tokenizer.unk_id is not None  # accepted when asked


def test_a_head_learning_rate_with_tied_embeddings_is_said_to_be_unused(capsys):
    """train.head_lr has no parameter to act on when the unembedding is the token embedding."""
    from jaxgpt.config import TrainConfig, default_config
    from jaxgpt.train.preflight import check_sections

    config = default_config()
    config.train.head_lr = 0.006
    check_sections(config, TrainConfig.from_mapping(config.train))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxgpt: train.head_lr=0.006 is unused: the embeddings are tied")
    config.model.tie_embeddings = False
    check_sections(config, TrainConfig.from_mapping(config.train))
    assert capsys.readouterr().err == ""
