"""GPT-2 interop: checkpoints read and written against GPT-2's own conventions (a float64 NumPy
forward pass over the saved tensors) and, with the parity extra, against transformers' logits
and greedy decoding; starting a run from a checkpoint; exporting a run; a clear error for each
bad input."""

import copy
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from runs import write_run
from safetensors.numpy import load_file, save_file
from test_model import random_params

from jaxgpt import ComputeConfig, GPTConfig, convert, export, tokenizers
from jaxgpt.decode import sampling, text
from jaxgpt.model import GPT
from jaxgpt.train import rundir
from jaxgpt.train.run import load_run

ROOT = Path(__file__).resolve().parent.parent
TEXT = ("The king speaks to the queen. Then the lord goes there, and now the lady comes here!\n" * 12
        + "Naïve café, isn't it? 😀\n")
VOCAB = 300  # the BPE below: 256 bytes, 41 merges, <|bos|> <|eos|> <|pad|>


@pytest.fixture(scope="module")
def bpe():
    tokenizer = tokenizers.train_tokenizer("bpe", [TEXT], vocab_size=VOCAB)
    assert tokenizer.vocab_size == VOCAB
    return tokenizer


def tiny(**changes):
    base = dict(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, d_model=16, d_ff=24, norm_eps=1e-3)
    return GPTConfig(**{**base, **changes})


@functools.cache
def forward(cfg):
    return jax.jit(lambda params, tokens: GPT(cfg).apply({"params": params}, tokens))


def logits(cfg, params, tokens):
    """The model's logits, jitted: one compilation instead of one per operation."""
    return np.asarray(forward(cfg)(params, jnp.asarray(tokens)))


def tokens_for(cfg, batch=2, seed=1):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, cfg.block_size))


def gpt2_forward_from_files(directory, tokens):
    """GPT-2's forward pass in float64, read straight from a checkpoint directory with GPT-2's
    conventions: Conv1D computes x W + b with W stored (in, out); c_attn's outputs are
    [q | k | v], each the heads side by side; lm_head is a Linear, x Wᵀ, or wte when tied."""
    hf = json.loads((Path(directory) / "config.json").read_text())
    tensors = {name.removeprefix("transformer."): value.astype(np.float64)
               for name, value in load_file(Path(directory) / "model.safetensors").items()}
    B, T = tokens.shape
    d, H, eps = hf["n_embd"], hf["n_head"], hf["layer_norm_epsilon"]
    act = {"gelu_new": ref.gelu_tanh, "gelu": ref.gelu_exact, "relu": lambda h: np.maximum(h, 0),
           "relu2": lambda h: np.maximum(h, 0) ** 2}
    act = act[hf["activation_function"]]
    causal = np.tril(np.ones((T, T), bool))
    x = tensors["wte.weight"][tokens] + tensors["wpe.weight"][:T]
    for i in range(hf["n_layer"]):
        w = {name[len(f"h.{i}."):]: value for name, value in tensors.items() if name.startswith(f"h.{i}.")}
        h = ref.layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps)
        qkv = h @ w["attn.c_attn.weight"] + w["attn.c_attn.bias"]
        q, k, v = (part.reshape(B, T, H, d // H) for part in np.split(qkv, 3, axis=-1))
        context = ref.attention(q, k, v, causal).reshape(B, T, d)
        x = x + context @ w["attn.c_proj.weight"] + w["attn.c_proj.bias"]
        h = ref.layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps)
        x = x + act(h @ w["mlp.c_fc.weight"] + w["mlp.c_fc.bias"]) @ w["mlp.c_proj.weight"] + w["mlp.c_proj.bias"]
    x = ref.layer_norm(x, tensors["ln_f.weight"], tensors["ln_f.bias"], eps)
    head = tensors["wte.weight"] if hf["tie_word_embeddings"] else tensors["lm_head.weight"]
    return x @ head.T


def set_leaf(tree, path, value):
    """A copy of the nested dict `tree` with the leaf at a jax key path replaced."""
    key, rest = path[0].key, path[1:]
    return {**tree, key: set_leaf(tree[key], rest, value) if rest else value}


def architecture(cfg):
    """The fields that make the function (dropout is a training choice)."""
    return {k: v for k, v in cfg.to_dict().items() if k != "dropout"}


# --- saving and loading, checked against GPT-2's conventions ----------------------------------------

SAVABLE = {
    "tied, tanh gelu": {},
    "untied, exact gelu": dict(tie_embeddings=False, activation="gelu_exact"),
    "relu, d_ff = 4 d": dict(activation="relu", d_ff=None),
    "relu², untied": dict(activation="relu2", tie_embeddings=False),
}


@pytest.mark.parametrize("changes", SAVABLE.values(), ids=SAVABLE.keys())
def test_saved_checkpoint_is_gpt2_and_loads_back_exactly(tmp_path, bpe, changes):
    cfg = tiny(**changes)
    params = random_params(cfg)
    convert.save_hf_gpt2(tmp_path, cfg, params, tokenizer=bpe)
    tokens = tokens_for(cfg)
    expected = gpt2_forward_from_files(tmp_path, tokens)
    np.testing.assert_allclose(logits(cfg, params, tokens), expected, atol=1e-4, rtol=1e-4)
    assert np.abs(expected).max() > 1  # the logits are large enough for a wrong term to show

    loaded_cfg, loaded = convert.load_hf_gpt2(tmp_path)
    assert architecture(loaded_cfg) == architecture(cfg)
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    assert convert.load_hf_tokenizer(tmp_path) == bpe
    hf = json.loads((tmp_path / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (bpe.bos_id, bpe.eos_id)


def test_a_model_without_biases_is_saved_with_zero_biases(tmp_path):
    cfg = tiny(bias=False, tie_embeddings=False)
    params = random_params(cfg)
    convert.save_hf_gpt2(tmp_path, cfg, params)
    tokens = tokens_for(cfg)
    np.testing.assert_allclose(logits(cfg, params, tokens), gpt2_forward_from_files(tmp_path, tokens),
                               atol=1e-4, rtol=1e-4)
    saved = load_file(tmp_path / "model.safetensors")
    assert not any(value.any() for name, value in saved.items() if name.endswith(".bias"))
    loaded_cfg, loaded = convert.load_hf_gpt2(tmp_path)
    assert loaded_cfg == cfg.replace(bias=True)  # GPT-2 always has biases: here they are zero
    with_zero_biases = jax.tree.map(np.zeros_like, random_params(loaded_cfg))
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        with_zero_biases = set_leaf(with_zero_biases, path, leaf)
    jax.tree.map(np.testing.assert_array_equal, loaded, with_zero_biases)


def test_reads_unprefixed_names_half_precision_shards_and_old_extras(tmp_path):
    """Checkpoints as the hub holds them: names without 'transformer.', float16 weights,
    shards listed by an index, and what old exports add: the causal-mask buffers, and a
    copy of the tied lm_head."""
    cfg = tiny()
    params = random_params(cfg)
    convert.save_hf_gpt2(tmp_path / "original", cfg, params)
    tensors = {name.removeprefix("transformer."): value.astype(np.float16)
               for name, value in load_file(tmp_path / "original" / "model.safetensors").items()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 16, 16), np.float16))
    tensors["lm_head.weight"] = tensors["wte.weight"]
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    hub = tmp_path / "hub"
    hub.mkdir()
    shutil.copy(tmp_path / "original" / "config.json", hub)
    for file, shard in shards.items():
        save_file({name: tensors[name] for name in shard}, hub / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {name: file for file, shard in shards.items() for name in shard}}
    (hub / "model.safetensors.index.json").write_text(json.dumps(index))

    _, loaded = convert.load_hf_gpt2(hub)
    expected = jax.tree.map(lambda x: np.asarray(x).astype(np.float16).astype(np.float32), params)
    jax.tree.map(np.testing.assert_array_equal, loaded, expected)


SAVE_REFUSED = {
    "rope": (dict(positions="rope"), "positions='rope'"),
    "sinusoidal": (dict(positions="sinusoidal"), "positions='sinusoidal'"),
    "rmsnorm": (dict(norm="rmsnorm"), "norm='rmsnorm'"),
    "post-norm": (dict(norm_position="post"), "norm_position='post'"),
    "parallel": (dict(parallel_block=True), "parallel_block=True"),
    "swiglu": (dict(activation="swiglu"), "activation='swiglu'"),
    "gqa": (dict(n_kv_head=1), "n_kv_head, head_dim, logits_bias, ffn_layers"),
    "logits bias": (dict(logits_bias=True), "n_kv_head, head_dim, logits_bias, ffn_layers"),
    "qk-norm": (dict(qk_norm=True), "qk_norm=True"),
    "soft-capped logits": (dict(logit_softcap=30.0), "logit_softcap=30.0"),
    "attention gate": (dict(attn_gate=4), "attn_gate=4: GPT-2's heads are not gated"),
    "key offset": (dict(key_offset=True), "key_offset=True: GPT-2's keys are each token's own"),
    "paired heads": (dict(paired_heads=(0,)), r"paired_heads=\(0,\): GPT-2's heads attend apart"),
    "trigram table": (dict(trigram_table=8), "trigram_table=8: GPT-2 has no trigram hash embedding"),
    "dense skips": (dict(dense_skips=4), "dense_skips=4: GPT-2's blocks read only the block before"),
}


@pytest.mark.parametrize("changes, message", SAVE_REFUSED.values(), ids=SAVE_REFUSED.keys())
def test_save_refuses_what_gpt2_cannot_express(tmp_path, changes, message):
    cfg = tiny(**changes)
    with pytest.raises(ValueError, match="cannot be written as GPT-2: " + message) as err:
        convert.save_hf_gpt2(tmp_path / "out", cfg, random_params(cfg))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_save_refuses_params_of_another_config_and_tokenizers_without_a_gpt2_form(tmp_path, bpe):
    with pytest.raises(ValueError, match=r"h_0/attn/c_attn/kernel has shape \(16, 3, 4, 4\).*not those of this config"):
        convert.save_hf_gpt2(tmp_path, tiny(), random_params(tiny(n_head=4)))
    with pytest.raises(ValueError, match="params have no h_2: they are not those of this config"):
        convert.save_hf_gpt2(tmp_path, tiny(n_layer=3), random_params(tiny()))
    char = tokenizers.train_tokenizer("char", [TEXT])
    with pytest.raises(ValueError, match="char tokenizer has no GPT-2 form"):
        convert.save_hf_gpt2(tmp_path, tiny(), random_params(tiny()), tokenizer=char)
    other_split = tokenizers.train_tokenizer("bpe", [TEXT], vocab_size=VOCAB, pattern=r"\S+|\s+")
    with pytest.raises(ValueError, match="another pattern than GPT-2's"):
        convert.save_hf_gpt2(tmp_path, tiny(), random_params(tiny()), tokenizer=other_split)
    assert not list(tmp_path.iterdir())


# --- bad checkpoints: each gets its own one-line error ---------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, bpe):
    """A valid GPT-2 directory (tied, with tokenizer) that each bad-input case copies and damages."""
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    convert.save_hf_gpt2(path, tiny(), random_params(tiny()), tokenizer=bpe)
    return path


def edit_config(**changes):
    def edit(path):
        hf = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**hf, **changes}))
    return edit


def replace_weights(path):
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"torch pickle")


def truncate_weights(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def add_a_different_lm_head(path):
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 1
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def index_without_shard(path):
    (path / "model.safetensors").unlink()
    index = {"weight_map": {"wte.weight": "model-00001-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


BAD_CHECKPOINTS = {
    "missing": (lambda p: shutil.rmtree(p), "does not exist: give the directory of a Hugging Face GPT-2"),
    "a file": (lambda p: (shutil.rmtree(p), p.write_text("x")), "is a file: give the directory"),
    "no config": (lambda p: (p / "config.json").unlink(), "has no config.json, so it is not a Hugging Face"),
    "config not JSON": (lambda p: (p / "config.json").write_text("{"), "config.json is not valid JSON"),
    "not gpt2": (edit_config(model_type="llama"), "model of type 'llama', not GPT-2"),
    "no model type": (edit_config(model_type=None), "config.json has no model_type, so it is not the config of a "
                                                    "Hugging Face model"),
    "layer-scaled attention": (edit_config(scale_attn_by_inverse_layer_idx=True),
                               "scale_attn_by_inverse_layer_idx=True; jaxgpt computes GPT-2 with "
                               "scale_attn_by_inverse_layer_idx=False only"),
    "unscaled attention": (edit_config(scale_attn_weights=False), "scale_attn_weights=False"),
    "cross attention": (edit_config(add_cross_attention=True), "add_cross_attention=True"),
    "activation": (edit_config(activation_function="silu"), "activation_function='silu'; jaxgpt computes gelu_new"),
    "impossible heads": (edit_config(n_head=3), "not describe a valid GPT-2: GPTConfig.d_model=16 is not divisible"),
    "no weights": (lambda p: (p / "model.safetensors").unlink(), "has no model.safetensors; jaxgpt reads safetensors"),
    "torch weights only": (replace_weights, r"has no model.safetensors \(it has pytorch_model.bin: load it in "
                                            r"transformers and save_pretrained"),
    "damaged weights": (truncate_weights, "model.safetensors is not a readable safetensors file"),
    "missing shard": (index_without_shard, "lists model-00001-of-00002.safetensors, which is missing"),
    "wider than its weights": (edit_config(n_embd=24), r"'wte.weight' in model.safetensors has shape \(300, 16\), "
                                                       r"but config.json .* needs \(300, 24\)"),
    "longer context than its weights": (edit_config(n_positions=32), r"'wpe.weight' .* has shape \(16, 16\)"),
    "fewer layers than its weights": (edit_config(n_layer=1), r"holds tensors that GPT-2 of config.json does not "
                                                              r"have \('h.1.attn.c_attn.bias'"),
    "more layers than its weights": (edit_config(n_layer=3), "has no tensor 'h.2.ln_1.weight'"),
    "untied without lm_head": (edit_config(tie_word_embeddings=False), "has no tensor 'lm_head.weight'"),
    "tied with another lm_head": (add_a_different_lm_head, "config.json ties lm_head to wte .* but the weights hold "
                                                           "a different lm_head.weight"),
}


@pytest.mark.parametrize("damage, message", BAD_CHECKPOINTS.values(), ids=BAD_CHECKPOINTS.keys())
def test_bad_checkpoint_is_a_one_line_error(tmp_path, checkpoint, damage, message):
    path = tmp_path / "gpt2"
    shutil.copytree(checkpoint, path)
    damage(path)
    with pytest.raises(ValueError, match=message) as err:
        convert.load_hf_gpt2(path)
    assert "\n" not in str(err.value)


def test_bad_tokenizer_files_are_one_line_errors(tmp_path, checkpoint):
    path = tmp_path / "gpt2"
    shutil.copytree(checkpoint, path)
    (path / "merges.txt").unlink()
    with pytest.raises(ValueError, match="has vocab.json but no merges.txt"):
        convert.load_hf_run(path)
    (path / "vocab.json").unlink()
    assert convert.load_hf_tokenizer(path) is None
    with pytest.raises(ValueError, match="has no vocab.json \\+ merges.txt, so its text cannot be tokenized"):
        convert.load_hf_run(path)


# --- starting a run from a checkpoint ------------------------------------------------------------


def test_init_params_from_crops_the_context_and_keeps_the_function(checkpoint):
    cfg, params = convert.load_hf_gpt2(checkpoint)
    short = cfg.replace(block_size=8, dropout=0.1)
    cropped = rundir.init_params_from(f"hf:{checkpoint}", short)
    assert cropped["wpe"]["embedding"].shape == (8, cfg.d_model)
    tokens = tokens_for(cfg)
    # Causal: the first 8 positions of a 16-token sequence see only its first 8 tokens.
    np.testing.assert_allclose(logits(short, cropped, tokens[:, :8]), logits(cfg, params, tokens)[:, :8], atol=1e-5)
    in_bfloat16 = rundir.init_params_from(f"hf:{checkpoint}", short, ComputeConfig(param_dtype="bfloat16"))
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(in_bfloat16))


def test_init_params_from_places_params_with_the_given_shardings(checkpoint):
    cfg, params = convert.load_hf_gpt2(checkpoint)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = rundir.init_params_from(f"hf:{checkpoint}", cfg, shardings=jax.tree.map(lambda _: device, params))
    assert all(leaf.sharding == device for leaf in jax.tree.leaves(placed))
    jax.tree.map(np.testing.assert_array_equal, placed, params)


@pytest.mark.parametrize("spec, cfg_changes, message", [
    ("gpt2", {}, r"init_from='gpt2' is neither hf:PATH nor a jaxgpt run directory"),
    ("hf:", {}, r"init_from='hf:': give hf:PATH"),
    ("hf:{checkpoint}", dict(n_layer=3), r"does not match the checkpoint .*: n_layer=3 \(checkpoint: 2\)"),
    ("hf:{checkpoint}", dict(tie_embeddings=False), r"tie_embeddings=False \(checkpoint: True\)"),
    ("hf:{checkpoint}", dict(block_size=32), r"block_size=32: must be an integer in 1…16"),
])
def test_init_params_from_bad_input(checkpoint, spec, cfg_changes, message):
    with pytest.raises(ValueError, match=message):
        rundir.init_params_from(spec.format(checkpoint=checkpoint), tiny(**cfg_changes))


def test_resolve_init_from_takes_the_architecture_and_tokenizer_of_the_checkpoint(tmp_path, checkpoint, bpe):
    from jaxgpt.config import default_config

    config = default_config()
    config.init_from = f"hf:{checkpoint}"
    config.run_dir = str(tmp_path / "run")
    config.model.update(n_layer=6, d_model=128, block_size=8, dropout=0.1)
    config.compute.dtype = "bfloat16"  # how it runs is the caller's own
    before = config.to_dict()
    resolved_config, tokenizer = rundir.resolve_init_from(config)
    resolved = GPTConfig.from_dict(dict(resolved_config.model))
    assert resolved == tiny(block_size=8, dropout=0.1)
    assert resolved_config.compute.dtype == "bfloat16"
    assert tokenizer == bpe
    assert config.to_dict() == before  # the caller's config is left as it was

    config.model.block_size = 17
    with pytest.raises(ValueError, match=r"model.block_size=17 is longer than the context of .* \(n_positions=16\)"):
        rundir.resolve_init_from(config)


def test_resolve_init_from_needs_a_tokenizer(tmp_path, checkpoint):
    from jaxgpt.config import default_config

    path = tmp_path / "gpt2"
    shutil.copytree(checkpoint, path)
    (path / "vocab.json").unlink()
    (path / "merges.txt").unlink()
    config = default_config()
    config.init_from, config.run_dir = f"hf:{path}", str(tmp_path / "run")
    config.model.block_size = 16
    with pytest.raises(ValueError, match="has no vocab.json \\+ merges.txt: set data.tokenizer to the path"):
        rundir.resolve_init_from(config)
    config.data.tokenizer = "my-tokenizer.json"  # given by path: kept as it is
    resolved, tokenizer = rundir.resolve_init_from(config)
    assert resolved.data.tokenizer == "my-tokenizer.json" and tokenizer is None


def test_fine_tuning_from_a_checkpoint_runs_end_to_end(tmp_path, checkpoint):
    """train(config) with init_from = hf:PATH starts from the checkpoint's params (cropped to
    the run's block size) and lowers the held-out loss from there."""
    from jaxgpt import data
    from jaxgpt.config import default_config
    from jaxgpt.train.run import train
    from jaxgpt.train.step import loss_fn

    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text(TEXT * 4)
    config = default_config()
    config.init_from = f"hf:{checkpoint}"
    config.run_dir = str(tmp_path / "run")
    config.data.update(source=str(corpus_file), cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
    config.model.update(block_size=8, dropout=0.0)
    config.train.update(steps=4, batch_size=4, eval_batch_size=4, warmup_steps=1, lr=1e-2, eval_every=4,
                        ckpt_every=4, log_every=1, peak_flops=1e9)
    config.sample.max_new_tokens = 0
    assert train(config)["step"] == 4

    cfg, start = convert.crop_block_size(*convert.load_hf_gpt2(checkpoint), 8)
    loss = jax.jit(lambda params, inputs, targets: loss_fn(GPT(cfg), params, inputs, targets))
    corpus = data.prepare(config.data, tokenizer=convert.load_hf_tokenizer(checkpoint))
    # Step 1's loss is that of the checkpoint's params on step 1's batch: training started from them.
    inputs, targets = data.train_batch(corpus.train, seed=config.train.seed, step=0, batch_size=4, block_size=8)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 1 and records[0]["train_loss"] == pytest.approx(float(loss(start, inputs, targets)),
                                                                                 abs=1e-5)
    val = np.asarray(corpus.val[: (len(corpus.val) - 1) // 8 * 8 + 1], np.int32)
    held_out = val[:-1].reshape(-1, 8), val[1:].reshape(-1, 8)
    trained = load_run(tmp_path / "run")[0]
    assert float(loss(trained, *held_out)) < float(loss(start, *held_out)) - 0.1


def test_sample_py_samples_from_a_checkpoint(checkpoint, capsys):
    from scripts import load_script

    cli = load_script("sample.py")
    prompt = "The king"
    status = cli.main(["--hf_dir", str(checkpoint), "--prompt", prompt, "--max_new_tokens", "8", "--temperature", "0"])
    out, err = capsys.readouterr()
    assert status == 0, err
    params, cfg, tokenizer = convert.load_hf_run(checkpoint)
    continuation = text.generate_text(params, cfg, tokenizer, prompt, max_new_tokens=8, temperature=0.0)
    assert out == prompt + continuation + "\n"


# --- export of a training run ----------------------------------------------------------------------


def run_export(capsys, *args):
    status = export.main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return status, out, err


def test_export_writes_a_checkpoint_that_loads_as_the_run(tmp_path, capsys, bpe):
    cfg = tiny(tie_embeddings=False)
    run = write_run(tmp_path / "run", cfg, bpe)
    status, out, err = run_export(capsys, "--run_dir", run, "--out", tmp_path / "hf")
    assert status == 0, err
    assert "vocab.json, merges.txt" in out
    params, loaded_cfg, tokenizer = convert.load_hf_run(tmp_path / "hf")
    assert tokenizer == bpe and architecture(loaded_cfg) == architecture(cfg)
    run_params = load_run(run)[0]
    tokens = tokens_for(cfg)
    np.testing.assert_allclose(logits(cfg, run_params, tokens), gpt2_forward_from_files(tmp_path / "hf", tokens),
                               atol=1e-4, rtol=1e-4)


def test_export_of_a_char_run_writes_the_weights_and_says_why_not_the_tokenizer(tmp_path, capsys):
    char = tokenizers.train_tokenizer("char", [TEXT])
    cfg = tiny(vocab_size=char.vocab_size)
    run = write_run(tmp_path / "run", cfg, char)
    status, out, err = run_export(capsys, "--run_dir", run, "--out", tmp_path / "hf")
    assert status == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", export.MANIFEST, "model.safetensors"]
    assert "wrote the weights without tokenizer files: the run's char tokenizer has no GPT-2 form" in err
    assert architecture(convert.load_hf_gpt2(tmp_path / "hf")[0]) == architecture(cfg)


def test_export_refuses_a_model_gpt2_cannot_express(tmp_path, capsys, bpe):
    run = write_run(tmp_path / "run", tiny(positions="rope", norm="rmsnorm"), bpe)
    status, _, err = run_export(capsys, "--run_dir", run, "--out", tmp_path / "hf")
    assert status == 2 and not (tmp_path / "hf").exists()
    assert err.strip() == ("export: error: this model cannot be written as GPT-2: positions='rope': GPT-2 learns its "
                           "position table ('learned'); norm='rmsnorm': GPT-2 uses LayerNorm ('layernorm')")
    status, _, err = run_export(capsys, "--run_dir", tmp_path / "nowhere", "--out", tmp_path / "hf")
    assert status == 2 and err.startswith("export: error: run directory") and len(err.strip().splitlines()) == 1


def test_export_to_a_file_is_a_one_line_error(tmp_path, capsys, bpe):
    run = write_run(tmp_path / "run", tiny(), bpe)
    (tmp_path / "out.txt").write_text("keep me")
    status, _, err = run_export(capsys, "--run_dir", run, "--out", tmp_path / "out.txt")
    assert status == 2 and err.strip().splitlines() == [f"export: error: --out {tmp_path / 'out.txt'} is a file: give "
                                                        "a directory to write the checkpoint into"]
    assert (tmp_path / "out.txt").read_text() == "keep me"


def test_an_export_over_an_earlier_one_leaves_one_model_and_names_what_it_removed(tmp_path, capsys, bpe):
    """A char run exported where a BPE run was: the BPE's vocab.json and merges.txt are removed
    (a 23-token model beside a 64-token tokenizer would be no model at all), and the other way
    round they are written; each time the folder is exactly one model."""
    char = tokenizers.train_tokenizer("char", [TEXT])
    char_cfg = tiny(vocab_size=char.vocab_size)
    bpe_run = write_run(tmp_path / "bpe_run", tiny(), bpe)
    char_run = write_run(tmp_path / "char_run", char_cfg, char)
    out = tmp_path / "hf"
    assert run_export(capsys, "--run_dir", bpe_run, "--out", out)[0] == 0
    status, _, err = run_export(capsys, "--run_dir", char_run, "--out", out)
    assert status == 0 and f"export: removed merges.txt, vocab.json of the earlier export in {out}" in err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", export.MANIFEST, "model.safetensors"]
    assert convert.load_hf_gpt2(out)[0].vocab_size == char.vocab_size and convert.load_hf_tokenizer(out) is None
    status, _, err = run_export(capsys, "--run_dir", bpe_run, "--out", out)
    assert status == 0 and "removed" not in err
    _, loaded_cfg, tokenizer = convert.load_hf_run(out)
    assert tokenizer == bpe and loaded_cfg.vocab_size == VOCAB


def test_an_export_refuses_files_no_export_wrote_and_writes_nothing(tmp_path, capsys, bpe):
    run = write_run(tmp_path / "run", tiny(), bpe)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}')
    status, out, err = run_export(capsys, "--run_dir", run, "--out", mine)
    assert status == 2 and out == "" and err == (
        f"export: error: --out {mine} holds config.json, which no jaxgpt export wrote (or which changed since): move "
        "them away, or choose a new or empty directory; an export replaces only an earlier export's files\n")
    assert [p.name for p in mine.iterdir()] == ["config.json"]
    assert (mine / "config.json").read_text() == '{"mine": true}'
    exported = tmp_path / "hf"
    assert run_export(capsys, "--run_dir", run, "--out", exported)[0] == 0
    (exported / "merges.txt").write_text("#version: 0.2\n")  # changed by hand since the export
    (exported / "notes.md").write_text("my notes")
    status, _, err = run_export(capsys, "--run_dir", run, "--out", exported)
    assert status == 2 and f"--out {exported} holds merges.txt, notes.md, which no jaxgpt export wrote" in err
    assert (exported / "merges.txt").read_text() == "#version: 0.2\n"


# --- parity with the reference implementation (the parity extra: torch + transformers) -------------


@pytest.fixture(scope="module")
def hf():
    reason = "parity tests need torch and transformers: pip install 'jaxgpt[parity]'"
    torch = pytest.importorskip("torch", reason=reason)
    transformers = pytest.importorskip("transformers", reason=reason)
    return torch, transformers


def reference_model(hf, path, **config):
    """A randomly initialised GPT2LMHeadModel with every parameter drawn at a scale where each
    term matters (non-zero biases, norm scales away from one), saved to `path`."""
    torch, transformers = hf
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=24, n_embd=32, n_layer=2, n_head=4,
                                        bos_token_id=None, eos_token_id=None, **config)
    model = transformers.GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            centre = 1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0
            parameter.normal_(centre, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return model


def reference_logits(hf, model, tokens):
    """transformers' logits in float64 (on a float64 copy of the model): a reference free of
    float32 rounding, which varies with the threads PyTorch happens to use."""
    torch, _ = hf
    with torch.no_grad():
        return copy.deepcopy(model).double()(torch.as_tensor(np.asarray(tokens))).logits.numpy()


# float32 logits against the float64 reference: their rounding reaches ~2e-5 here; the near
# misses (the exact GELU for the tanh one, another epsilon) are off by more than 1e-3
PARITY_ATOL = 3e-5


PARITY = {
    "tied, gelu_new": dict(activation_function="gelu_new", layer_norm_epsilon=1e-3),
    "untied, exact gelu, n_inner": dict(activation_function="gelu", tie_word_embeddings=False, n_inner=48),
    "gelu_pytorch_tanh, upcast attention": dict(activation_function="gelu_pytorch_tanh", reorder_and_upcast_attn=True),
}
PARITY_TOKENS = np.random.default_rng(2).integers(0, VOCAB, (2, 24))


@pytest.mark.parametrize("config", PARITY.values(), ids=PARITY.keys())
def test_loaded_gpt2_computes_the_reference_logits_and_saves_back(tmp_path, hf, config):
    _, transformers = hf
    model = reference_model(hf, tmp_path / "reference", **config)
    cfg, params = convert.load_hf_gpt2(tmp_path / "reference")
    expected = reference_logits(hf, model, PARITY_TOKENS)
    assert np.abs(expected).max() > 1
    np.testing.assert_allclose(logits(cfg, params, PARITY_TOKENS), expected, atol=PARITY_ATOL, rtol=0)

    convert.save_hf_gpt2(tmp_path / "saved", cfg, params)
    reloaded, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    np.testing.assert_allclose(reference_logits(hf, reloaded.eval(), PARITY_TOKENS), expected, atol=1e-12, rtol=0)


def test_loaded_gpt2_continues_greedily_as_the_reference_and_the_tolerance_can_tell(tmp_path, hf):
    torch, _ = hf
    model = reference_model(hf, tmp_path, **PARITY["tied, gelu_new"])
    cfg, params = convert.load_hf_gpt2(tmp_path)
    prompt = PARITY_TOKENS[0, :6].tolist()
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
    ours = sampling.generate(params, cfg, [prompt], jax.random.key(0), max_new_tokens=14, temperature=0.0)
    assert ours.new_tokens()[0].tolist() == greedy

    # PARITY_ATOL separates the right function from near misses: the exact GELU, GPT-2's default epsilon.
    expected = reference_logits(hf, model, PARITY_TOKENS)
    for wrong in (cfg.replace(activation="gelu_exact"), cfg.replace(norm_eps=1e-5)):
        assert np.abs(logits(wrong, params, PARITY_TOKENS) - expected).max() > 1e-3


def test_transformers_computes_a_saved_jaxgpt_model(tmp_path, hf, bpe):
    """The other direction, from a model jaxgpt made: untied, without biases, d_ff ≠ 4d."""
    _, transformers = hf
    cfg = tiny(bias=False, tie_embeddings=False, activation="gelu_exact", d_ff=40)
    params = random_params(cfg)
    convert.save_hf_gpt2(tmp_path, cfg, params, tokenizer=bpe)
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    tokens = tokens_for(cfg)
    np.testing.assert_allclose(reference_logits(hf, model, tokens), logits(cfg, params, tokens), atol=PARITY_ATOL,
                               rtol=0)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tokenizer(TEXT)["input_ids"] == bpe.encode(TEXT)
