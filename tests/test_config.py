"""Impossible settings raise ValueError naming the field, the value and what would be valid."""

import jax
import pytest

from jaxgpt import ComputeConfig, GPTConfig
from jaxgpt.config import default_config
from jaxgpt.errors import ConfigError
from jaxgpt.model import GPT
from jaxgpt.model_config import split_model
from jaxgpt.registries import check_model, open_compute
from jaxgpt.train.run import compute_config


def test_defaults_are_gpt2():
    cfg = GPTConfig()
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.d_model) == (50257, 1024, 12, 12, 768)
    assert cfg.d_ff == 4 * 768 and cfg.head_dim == 64
    assert (cfg.positions, cfg.norm, cfg.norm_position, cfg.activation) == ("learned", "layernorm", "pre", "gelu")
    assert cfg.bias and cfg.tie_embeddings and not cfg.parallel_block


@pytest.mark.parametrize(
    "changes, expected",
    [
        (dict(d_model=100, n_head=3), r"d_model=100 is not divisible by n_head=3"),
        (dict(d_model=12, n_head=4, positions="rope"), r"positions='rope' needs an even head size.*= 3"),
        (dict(positions="rotary"), r"positions='rotary': must be one of learned, sinusoidal, rope, alibi, none"),
        (dict(norm="batchnorm"), r"norm='batchnorm': must be one of layernorm, rmsnorm"),
        (dict(norm_position="middle"), r"norm_position='middle': must be one of pre, post"),
        (dict(activation="tanh"), r"activation='tanh': must be one of gelu, gelu_exact, relu, relu2, silu, swiglu"),
        (dict(attention="ring"), r"attention='ring': must be one of softmax, linear, local"),
        (dict(attention="xla"), r"attention='xla' is a kernel.*set compute.kernel='xla'"),
        (dict(attention="local"), r"window=None with attention='local'"),
        (dict(window=8), r"window=8 with attention='softmax'"),
        (dict(attention="local", window=0), r"window=0: must be a positive integer"),
        (dict(n_layer=0), r"n_layer=0: must be a positive integer"),
        (dict(d_model=-8), r"d_model=-8: must be a positive integer"),
        (dict(vocab_size=3.5), r"vocab_size=3.5: must be a positive integer"),
        (dict(d_ff=0), r"d_ff=0: must be a positive integer"),
        (dict(dropout=1.0), r"dropout=1.0: must be in \[0, 1\)"),
        (dict(dropout=-0.1), r"dropout=-0.1: must be in \[0, 1\)"),
        (dict(bias="yes"), r"bias='yes': must be True or False"),
        (dict(parallel_block=True, norm_position="post"), r"parallel_block=True with norm_position='post'"),
    ],
)
def test_impossible_settings_raise(changes, expected):
    """As a config is opened (registries.check_model): the schema's checks, then the names against the
    registries where their entries are defined."""
    with pytest.raises(ValueError, match=expected):
        check_model(GPTConfig(**{**dict(vocab_size=16, block_size=8, n_layer=1, n_head=2, d_model=8), **changes}))


@pytest.mark.parametrize("changes, expected", [
    (dict(positions="rotary"), r"^GPTConfig.positions='rotary': must be one of learned, sinusoidal, rope, alibi, "
                               r"none$"),
    (dict(attention="local"), r"^GPTConfig.window=None with attention='local'"),
])
def test_a_model_made_from_a_config_with_a_name_no_registry_holds_is_refused_in_one_line(changes, expected):
    """The schema names no implementation, so GPTConfig takes any name; the model made from it refuses
    it, before anything is traced."""
    cfg = GPTConfig(**{**dict(vocab_size=16, block_size=8, n_layer=1, n_head=2, d_model=8), **changes})
    with pytest.raises(ValueError, match=expected):
        GPT(cfg)
    with pytest.raises(ValueError, match=expected):
        GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, d_model=8)).clone(cfg=cfg)


def test_the_schema_imports_no_implementation():
    """model_config, data_config and config import only the schema's own modules and errors."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "jaxgpt"
    allowed = {"jaxgpt.errors", "jaxgpt.model_config", "jaxgpt.data_config", "jaxgpt.batch_schedule"}
    for name in ("model_config", "data_config", "config", "batch_schedule"):
        found = set()
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "jaxgpt":
                found |= {f"jaxgpt.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        assert {module for module in found if module.startswith("jaxgpt")} <= allowed, name


@pytest.mark.parametrize("changes, expected", [
    (dict(kernel="ring"), r"ComputeConfig.kernel='ring': must be one of explicit, blocked, xla, cudnn, flash"),
    (dict(dtype="int8"), r"ComputeConfig.dtype='int8': must be one of"),
    (dict(remat="yes"), r"ComputeConfig.remat='yes': must be True or False"),
])
def test_impossible_compute_settings_raise(changes, expected):
    with pytest.raises(ValueError, match=expected):
        open_compute(changes)


def test_a_cudnn_compute_config_is_valid_anywhere_and_the_model_it_runs_is_softmax():
    """The kernel is how a model runs, not what it is: nothing asks which devices exist."""
    assert ComputeConfig(kernel="cudnn").kernel == "cudnn"
    old = {"attention": "cudnn", "dtype": "bfloat16", "remat": True, "scan_layers": True, "n_layer": 2}
    assert GPTConfig.from_dict(old) == GPTConfig(attention="softmax", n_layer=2)
    assert split_model(old)[1] == {"kernel": "cudnn", "dtype": "bfloat16", "remat": True, "scan_layers": True}


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cudnn is valid where a GPU is present")
def test_a_run_with_the_cudnn_kernel_without_a_gpu_says_what_to_use():
    config = default_config()
    config.compute.kernel = "cudnn"
    with pytest.raises(ConfigError, match=r"compute.kernel=cudnn needs a CUDA GPU.*use explicit or blocked or xla"):
        compute_config(config)


def test_round_trip_through_dict_and_unknown_field():
    cfg = GPTConfig(vocab_size=99, n_layer=2, positions="rope")
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"no field\(s\) n_layers"):
        GPTConfig.from_dict({**cfg.to_dict(), "n_layers": 3})


@pytest.mark.parametrize("changes, expected", [
    (dict(eval_every=0), r"train.eval_every=0: must be a positive integer"),
    (dict(ckpt_every=0), r"train.ckpt_every=0: must be a positive integer"),
    (dict(log_every=0), r"train.log_every=0: must be a positive integer"),
    (dict(steps=0), r"train.steps=0: must be a positive integer"),
    (dict(steps=-5), r"train.steps=-5: must be a positive integer"),
    (dict(grad_accum=0), r"train.grad_accum=0 \(chosen to fit\) needs train.rows_per_step"),
    (dict(batch_size=0), r"train.batch_size=0 \(chosen to fit\) needs train.rows_per_step"),
    (dict(grad_accum=-1), r"train.grad_accum=-1: must be a positive integer, or 0"),
    (dict(lr=-1e-3), r"train.lr=-0.001: must be a number ≥ 0"),
    (dict(b2=1.0), r"train.b2=1.0: must be a number in \[0, 1\)"),
    (dict(warmup_steps=100, decay_steps=50), r"train.decay_steps=50 must exceed train.warmup_steps=100"),
    (dict(memory_limit_gib=0), r"train.memory_limit_gib=0: must be None or a positive number"),
])
def test_impossible_train_settings_raise(changes, expected):
    from jaxgpt.config import TrainConfig

    with pytest.raises(ValueError, match=expected):
        TrainConfig(**changes)


def test_unknown_keys_are_named_with_the_nearest_one():
    from jaxgpt.config import default_config, unknown_key

    config = default_config()
    assert unknown_key(config, "train.lr") is None
    assert unknown_key(config, "train.lrr") == "no key 'train.lrr'; did you mean 'train.lr'?"
    assert unknown_key(config, "modle.n_layer") == "no key 'modle'; did you mean 'model'?"
    assert unknown_key(config, "train.zzz") == "no key 'train.zzz'"


def test_replace_derives_the_derived_fields_again():
    """d_ff, head_dim and n_kv_head left to their defaults follow d_model and n_head; set ones stay."""
    base = GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=4, d_model=32)
    wider = base.replace(d_model=64, n_head=8)
    assert (wider.d_ff, wider.head_dim, wider.n_kv_head) == (4 * 64, 64 // 8, 8)
    chosen = GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=4, d_model=32, d_ff=48, head_dim=6, n_kv_head=2)
    kept = chosen.replace(n_head=8)
    assert (kept.d_ff, kept.head_dim, kept.n_kv_head) == (48, 6, 2)


# --- the data section: shared keys, and a section per source kind -------------------------------


def test_each_source_section_is_overridable_and_checked_from_the_command_line():
    from jaxgpt.cli import parse_config
    from jaxgpt.config import DataConfig
    from jaxgpt.errors import ConfigError, DataError

    config = parse_config(["train.py", "--config.data.ocr.lang=deu", "--config.data.tfds.data_dir=/data/tfds",
                           "--config.data.records.template=qa", "--config.data.ocr.min_confidence=60"],
                          "configs/default.py")
    settings = DataConfig.from_mapping(config.data)
    assert (settings.ocr.lang, settings.ocr.min_confidence) == ("deu", 60.0)
    assert (settings.tfds.data_dir, settings.records.template) == ("/data/tfds", "qa")
    bad = parse_config(["train.py", "--config.data.ocr.workers=0"], "configs/default.py")
    with pytest.raises(DataError, match=r"^data.ocr.workers=0: must be None or a positive integer$"):
        DataConfig.from_mapping(bad.data)
    with pytest.raises(ConfigError, match=r"^no key 'data.ocr_lang'; it is now 'data.ocr.lang'$"):
        parse_config(["train.py", "--config.data.ocr_lang=deu"], "configs/default.py")
    with pytest.raises(ConfigError, match=r"^data.ocr is a section now: the old data.ocr is 'data.ocr.mode'$"):
        parse_config(["train.py", "--config.data.ocr=never"], "configs/default.py")
    with pytest.raises(ConfigError, match=r"data.ocr has no key\(s\) language; its keys: drop_low_confidence"):
        DataConfig.from_mapping({"ocr": {"language": "deu"}})


def test_a_data_section_saved_with_the_flat_keys_of_before_reads_as_the_sections():
    """A run directory's config.json written before the sections (data.ocr_lang, data.template,
    …) is read by eval.py and sample.py as it was meant."""
    from jaxgpt.config import FLAT_DATA_KEYS, DataConfig, HfConfig, OcrConfig, RecordsConfig, default_config

    saved = {"source": "notes.jsonl", "text_field": "body", "tfds_text_feature": "content", "tfds_data_dir": None,
             "ocr": "never", "ocr_lang": "deu", "ocr_workers": 2, "ocr_min_confidence": None,
             "ocr_drop_low_confidence": False, "on_bad_file": "error", "template": "qa", "prompt_template": None,
             "completion_template": None, "loss_on": "all", "truncate": "error", "packing": "pad"}
    settings = DataConfig.from_mapping(saved)
    assert settings.ocr == OcrConfig(mode="never", lang="deu", workers=2)
    assert (settings.files.text_field, settings.files.on_bad_file, settings.hf) == ("body", "error",
                                                                                  HfConfig(text_field="body"))
    assert settings.tfds.text_feature == "content"
    assert settings.records == RecordsConfig(template="qa", loss_on="all", truncate="error", packing="pad")
    assert set(saved) - {"source"} == set(FLAT_DATA_KEYS)  # every flat key of before is read
    assert DataConfig.from_mapping(default_config().data) == DataConfig.from_mapping(dict(default_config().data)) \
        == DataConfig()


# --- the command line: None for the keys whose default is None, config files that do not load -------


def keys_whose_default_is_none(section, prefix=""):
    for key, value in section.items():
        if isinstance(value, dict):
            yield from keys_whose_default_is_none(value, f"{prefix}{key}.")
        elif value is None:
            yield prefix + key


NONE_KEYS = sorted(keys_whose_default_is_none(default_config().to_dict()))


def value_of(config, dotted):
    for part in dotted.split("."):
        config = config[part]
    return config


def test_the_keys_whose_default_is_none_include_the_records_templates_and_numbers():
    expected = {"data.records.template", "data.vocab_size", "train.decay_steps", "model.d_ff", "init_from"}
    assert expected <= set(NONE_KEYS)


@pytest.mark.parametrize("key", NONE_KEYS)
def test_every_key_whose_default_is_none_takes_none_on_the_command_line(key):
    """Over a preset that sets it, where it does (data.records.template='qa', data.vocab_size=512)."""
    from jaxgpt.cli import parse_config

    config = parse_config(["train.py", "--config=configs/finetune_records.py", f"--config.{key}=None"],
                          "configs/default.py")
    expected = "runs/finetune_records" if key == "run_dir" else None  # run_dir None: runs/<config name>
    assert value_of(config, key) == expected


def test_the_last_of_several_overrides_of_a_key_wins_none_or_not():
    from jaxgpt.cli import parse_config

    args = ["train.py", "--config=configs/finetune_records.py"]
    last_none = parse_config([*args, "--config.data.records.template=alpaca", "--config.data.records.template=None"],
                             "configs/default.py")
    last_value = parse_config([*args, "--config.data.records.template=None", "--config.data.records.template=chat"],
                              "configs/default.py")
    assert (last_none.data.records.template, last_value.data.records.template) == (None, "chat")


def test_the_records_preset_takes_your_own_templates_from_the_command_line():
    from jaxgpt.cli import parse_config
    from jaxgpt.config import DataConfig
    from jaxgpt.data import records

    config = parse_config(["train.py", "--config=configs/finetune_records.py", "--config.data.records.template=None",
                           "--config.data.records.prompt_template=Q: {q}\nA: ",
                           "--config.data.records.completion_template={a}"], "configs/default.py")
    forms = records.templates(DataConfig.from_mapping(config.data).records)
    assert records.example_turns(records.Record({"q": "2+2", "a": "4"}, 0, 1, "r.jsonl:1"), forms) == [
        ("Q: 2+2\nA: ", "4")]


@pytest.mark.parametrize("source, message", [
    ("x = 1\n", r"^{file} defines no get_config\(\): .*configs/default.py"),
    ("def get_config():\n    pass\n", r"^{file}: get_config\(\) returned NoneType, not a ConfigDict"),
    ("def get_config():\n    return 1 / 0\n", r"^{file}:2: ZeroDivisionError: division by zero \(raised by"),
    (None, r"^--config={file}: no such file"),
])
def test_a_config_file_that_does_not_load_is_a_one_line_error_naming_it(tmp_path, source, message):
    from jaxgpt.cli import parse_config

    path = tmp_path / "mine.py"
    if source is not None:
        path.write_text(source)
    with pytest.raises(ConfigError, match=message.format(file=path)) as refused:
        parse_config(["train.py", f"--config={path}"], "configs/default.py")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("changes, expected", [
    (dict(temperature=float("inf")), r"^sample.temperature=inf: must be a finite number ≥ 0"),
    (dict(top_k=2.5), r"^sample.top_k=2.5: must be an integer ≥ 0"),
    (dict(record="[1, 2]"), r"^sample.record='\[1, 2\]': must be a JSON object of a record's fields"),
    (dict(record="{question: 1}"), r"^sample.record='\{question: 1\}': must be a JSON object"),
    (dict(prompt=None), r"^sample.prompt=None: must be a non-empty string"),
])
def test_impossible_sample_settings_raise(changes, expected):
    from jaxgpt.config import SampleConfig

    with pytest.raises(ConfigError, match=expected):
        SampleConfig(**changes)
    assert SampleConfig.from_mapping(default_config().sample) == SampleConfig()


@pytest.mark.parametrize("changes, key", [
    ({"steps": 2}, "train.steps=2"),  # decay_steps unset: the run's steps end the schedule
    ({"steps": 100, "decay_steps": 30}, "train.decay_steps=30"),
])
def test_a_schedule_too_short_for_its_warmup_names_the_key_that_set_it(changes, key):
    from jaxgpt.config import TrainConfig

    with pytest.raises(ConfigError, match=rf"^{key} must exceed train.warmup_steps=50: .* \(raise {key.split('=')[0]} "
                                          r"or lower train.warmup_steps\)$"):
        TrainConfig(warmup_steps=50, **changes)
