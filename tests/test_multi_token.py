"""Multi-token prediction (jaxgpt.loss.multi_token; train.mtp_tokens, mtp_weight, mtp_fraction): the loss
against a float64 loop over packed rows (mask and segments), whole logits and compute.loss_chunk
alike, gradient accumulation, the weights' schedule, bad input; and one short run with every
switch of this branch on (smear, bigram, multi-token prediction, scan_layers, the chunked loss)
that resumes as it would have gone on."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref
from runs import tiny_config, write_corpus
from test_model import random_params, tiny
from test_run import assert_trees_close, final_params

from jaxgpt import ComputeConfig
from jaxgpt.config import TrainConfig, default_config
from jaxgpt.errors import ConfigError
from jaxgpt.loss.multi_token import weights_at
from jaxgpt.model import GPT
from jaxgpt.train.step import TrainState, loss_fn, make_train_step

CFG = tiny()
WEIGHTS = jnp.array([1.0, 0.5, 0.25])


def packed_batch(seed=0):
    """Two rows of 8: row 0 three examples (the last padding), row 1 one example, with a loss mask."""
    rng = np.random.default_rng(seed)
    inputs, targets = (rng.integers(0, CFG.vocab_size, (2, 8)) for _ in range(2))
    positions = np.array([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6, 7]])
    segments = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    mask = np.array([[1, 1, 1, 1, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1, 1]], bool)
    return inputs, targets, mask, positions, segments


def loss(chunk, params, batch, ahead=WEIGHTS):
    inputs, targets, mask, positions, segments = (jnp.asarray(a) for a in batch)
    model = GPT(CFG, ComputeConfig(loss_chunk=chunk))
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(model, p, inputs, targets, mask, positions=positions,
                                                        segments=segments, ahead=ahead)))(params)


def test_loss_matches_float64_reference_whole_and_chunked():
    """Never across an example's end nor past the row, only on masked targets, over the next-token count;
    the chunked loss (5 tokens a chunk: 16 tokens padded to 20) gives the same loss and gradient."""
    params, batch = random_params(CFG), packed_batch()
    inputs, targets, mask, positions, segments = batch
    logits = GPT(CFG).apply({"params": params}, jnp.asarray(inputs), positions=jnp.asarray(positions),
                            segments=jnp.asarray(segments))
    want = ref.multi_token_loss(np.asarray(logits, np.float64), targets, mask, segments, [1.0, 0.5, 0.25], mask.sum())
    (whole, whole_grad), (chunked, chunked_grad) = loss(0, params, batch), loss(5, params, batch)
    assert float(whole) == pytest.approx(want, rel=1e-5) and float(chunked) == pytest.approx(want, rel=1e-5)
    for got, expected in zip(jax.tree.leaves(chunked_grad), jax.tree.leaves(whole_grad), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-6)
    plain = ref.multi_token_loss(np.asarray(logits, np.float64), targets, mask, segments, [1.0], mask.sum())
    assert want > plain  # the targets ahead add to it


def test_gradient_accumulation_equals_one_batch():
    """Four rows in two micro-batches give the step of the four at once, with the chunked loss."""
    params = random_params(CFG)
    rows = [packed_batch(seed) for seed in (1, 2)]
    batch = tuple(jnp.asarray(np.concatenate(parts)) for parts in zip(*rows, strict=True))
    optimizer = optax.sgd(0.1)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
    model = GPT(CFG, ComputeConfig(loss_chunk=6))
    results = [jax.jit(make_train_step(model, optimizer, lambda s: 0.1, k, ahead=lambda step: WEIGHTS))(
        state, batch, jax.random.key(0)) for k in (1, 2)]
    (one, m1), (two, m2) = results
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_weights_fade_linearly_to_zero():
    """A worked example: K = 3, mtp_weight 0.5, gone by step 10."""
    for step, want in ((0, [1, 0.5, 0.25]), (5, [1, 0.25, 0.125]), (10, [1, 0, 0]), (30, [1, 0, 0])):
        np.testing.assert_allclose(np.asarray(weights_at(step, 3, 0.5, 10.0)), want, rtol=1e-6)


@pytest.mark.parametrize("changes, message", [
    ({"mtp_tokens": 0}, "train.mtp_tokens=0: must be a positive integer"),
    ({"mtp_weight": -1.0}, "train.mtp_weight=-1.0: must be a number ≥ 0"),
    ({"mtp_fraction": 0.0}, r"train.mtp_fraction=0.0: must be a number in \(0, 1\]"),
])
def test_bad_settings_are_one_line(changes, message):
    with pytest.raises(ConfigError, match=message) as error:
        TrainConfig(**changes)
    assert "\n" not in str(error.value)


def test_predicting_past_the_block_is_refused_before_anything_compiles():
    from jaxgpt.train.preflight import check_sections

    config = default_config()
    config.model.block_size, config.train.mtp_tokens, config.mesh.cpu_devices = 4, 5, 0
    with pytest.raises(ConfigError, match="train.mtp_tokens=5 predicts past the block of model.block_size=4 "
                                          "tokens: choose at most 4") as error:
        check_sections(config, TrainConfig.from_mapping(config.train))
    assert "\n" not in str(error.value)


def test_weights_without_targets_ahead_are_said_to_be_unused():
    from jaxgpt.train.preflight import unused_settings

    config = default_config()
    notes = unused_settings(config, TrainConfig(mtp_weight=0.3))
    assert notes == ["train.mtp_weight=0.3 is unused: train.mtp_tokens=1 predicts the next token only; set "
                     "train.mtp_tokens > 1 for the targets ahead"]
    assert unused_settings(config, TrainConfig(mtp_tokens=2, mtp_weight=0.3)) == []


def test_a_run_with_every_switch_resumes_as_it_would_have_gone_on(tmp_path):
    """smear, the bigram and trigram tables, the attention gate, dense skips (two layers), the key offset and
    paired heads (layer 1 of 2: the scan's nn.cond), multi-token prediction, the embedding and unembedding
    untied at step 5 (0.4 of the schedule's 12), scan_layers, the chunked loss and two micro-batches: 3 steps
    then 3 more from the checkpoint equal 6 straight."""
    from jaxgpt.train.run import train

    corpus = write_corpus(tmp_path / "corpus.txt")
    switches = {"model.smear": True, "model.bigram_table": 97, "model.trigram_table": 89, "model.attn_gate": 4,
                "model.dense_skips": 4, "model.key_offset": True, "model.paired_heads": (1,), "model.n_layer": 2,
                "train.mtp_tokens": 3, "train.mtp_fraction": 1.0,
                "compute.scan_layers": True, "compute.loss_chunk": 24, "train.grad_accum": 2, "train.batch_size": 2,
                "model.tie_embeddings": False, "train.untie_at": 0.4}
    first = train(tiny_config(tmp_path, corpus, "split", **switches, **{"train.steps": 3}))
    assert first["step"] == 3
    resumed = train(tiny_config(tmp_path, corpus, "split", **switches))
    whole = train(tiny_config(tmp_path, corpus, "whole", **switches))
    assert resumed["step"] == whole["step"] == 6
    assert resumed["val_loss"] == pytest.approx(whole["val_loss"], abs=1e-6)
    assert_trees_close(final_params(tmp_path / "split"), final_params(tmp_path / "whole"), atol=1e-6)
