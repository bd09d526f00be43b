"""Packed examples in the model and the train step: attention never crosses examples, the KV
cache continues a packed row's last example as if it were alone, the loss counts only the
masked targets, and gradient accumulation weighs every target alike."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference

from jaxgpt import ops
from jaxgpt.attention import init_cache
from jaxgpt.config import ComputeConfig, GPTConfig
from jaxgpt.model import GPT
from jaxgpt.train.step import TrainState, loss_fn, make_train_step

LENGTHS = (5, 9, 4)  # three examples packed in a row of 20: 2 positions of padding


def tiny(**changes) -> GPTConfig:
    return GPTConfig(**{"vocab_size": 19, "block_size": 20, "n_layer": 2, "n_head": 2, "d_model": 16, **changes})


def init(cfg: GPTConfig):
    return GPT(cfg).init(jax.random.key(0), jnp.zeros((1, cfg.block_size), jnp.int32))["params"]


def packed_row(lengths, width, rng, vocab=19):
    """tokens, positions, segments (1, width) of examples of `lengths` packed from column 0
    (segments 1, 2, …; the padding after them is segment 0), and the examples' tokens."""
    examples = [rng.integers(0, vocab, n) for n in lengths]
    pad = width - sum(lengths)
    tokens = np.concatenate([*examples, np.zeros(pad, int)])
    positions = np.concatenate([np.arange(n) for n in (*lengths, pad)])
    segments = np.concatenate([np.full(n, s) for s, n in enumerate((*lengths, pad), start=1)])
    segments[sum(lengths):] = 0
    return [jnp.asarray(a, jnp.int32)[None] for a in (tokens, positions, segments)], examples


def assert_each_example_alone(cfg, params, packed, examples):
    """Each example's logits in the packed row equal its logits computed alone."""
    start = 0
    for example in examples:
        alone = GPT(cfg).apply({"params": params}, jnp.asarray(example, jnp.int32)[None])
        np.testing.assert_allclose(packed[0, start:start + len(example)], alone[0], atol=1e-5, rtol=1e-5)
        start += len(example)


@pytest.mark.parametrize("kernel", ["explicit", "xla"])
@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "rope", "alibi", "none"])
def test_packed_logits_equal_each_example_alone(positions, kernel):
    cfg = tiny(positions=positions)
    params = init(cfg)
    (tokens, pos, seg), examples = packed_row(LENGTHS, cfg.block_size, np.random.default_rng(1))
    packed = GPT(cfg, ComputeConfig(kernel=kernel)).apply({"params": params}, tokens, positions=pos, segments=seg)
    assert_each_example_alone(cfg, params, packed, examples)


@pytest.mark.parametrize("positions", ["rope", "alibi"])
def test_blocked_attention_keeps_examples_apart(positions):
    """Rows longer than a query block (64) take the blocked path; examples straddle its blocks."""
    cfg = tiny(positions=positions, block_size=80)
    params = init(cfg)
    (tokens, pos, seg), examples = packed_row((30, 41, 6), cfg.block_size, np.random.default_rng(2))
    packed = GPT(cfg, ComputeConfig(kernel="blocked")).apply({"params": params}, tokens, positions=pos, segments=seg)
    assert_each_example_alone(cfg, params, packed, examples)


@pytest.mark.parametrize("positions", ["learned", "rope", "alibi"])
def test_cache_decode_of_a_packed_rows_last_example_equals_a_fresh_decode(positions):
    cfg = tiny(positions=positions)
    params = init(cfg)
    (tokens, pos, seg), examples = packed_row(LENGTHS, sum(LENGTHS), np.random.default_rng(3))
    model = GPT(cfg)
    _, cache = model.apply({"params": params}, tokens, init_cache(cfg, 1), positions=pos, segments=seg)
    last, next_token = examples[-1], jnp.array([[7]], jnp.int32)
    step = {"positions": jnp.array([[len(last)]]), "segments": jnp.array([[len(examples)]])}
    packed_logits, packed_cache = model.apply({"params": params}, next_token, cache, **step)

    _, fresh = model.apply({"params": params}, jnp.asarray(last, jnp.int32)[None], init_cache(cfg, 1))
    fresh_logits, fresh_cache = model.apply({"params": params}, next_token, fresh)
    np.testing.assert_allclose(packed_logits, fresh_logits, atol=1e-5, rtol=1e-5)
    first = sum(LENGTHS) - len(last)
    for layer in range(cfg.n_layer):
        np.testing.assert_allclose(packed_cache.keys[layer][0, first:first + len(last) + 1],
                                   fresh_cache.keys[layer][0, :len(last) + 1], atol=1e-5, rtol=1e-5)


# --- the loss on masked targets -------------------------------------------------------------


def _nll64(logits, targets):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]


def _masked_batch(rng, cfg, rows=2):
    inputs = rng.integers(0, cfg.vocab_size, (rows, cfg.block_size))
    targets = rng.integers(0, cfg.vocab_size, (rows, cfg.block_size))
    mask = np.zeros((rows, cfg.block_size), bool)
    mask[0, 6:15] = True  # a completion in the middle of row 0
    mask[1, 11:] = True
    return inputs, targets, mask


def test_masked_loss_equals_float64_numpy_over_the_completion_targets():
    cfg = tiny()
    params = init(cfg)
    inputs, targets, mask = _masked_batch(np.random.default_rng(4), cfg)
    loss = loss_fn(GPT(cfg), params, jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(mask))
    nll = _nll64(reference.gpt_forward(cfg, jax.device_get(params), inputs), targets)
    np.testing.assert_allclose(float(loss), nll[mask].mean(), rtol=1e-5)


def test_masked_loss_gradient_by_logits_is_softmax_minus_one_hot_over_the_count():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(3, 7, 11))
    targets = rng.integers(0, 11, (3, 7))
    mask = rng.random((3, 7)) < 0.4
    grad = jax.grad(ops.cross_entropy)(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), jnp.asarray(mask))
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = (probs - np.eye(11)[targets]) * mask[..., None] / mask.sum()
    np.testing.assert_allclose(grad, expected, atol=1e-6)


def test_masked_loss_gradient_equals_float64_finite_differences():
    cfg = tiny()
    params = init(cfg)
    inputs, targets, mask = _masked_batch(np.random.default_rng(6), cfg)
    grads = jax.grad(loss_fn, argnums=1)(GPT(cfg), params, jnp.asarray(inputs), jnp.asarray(targets),
                                         jnp.asarray(mask))
    params64 = jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(params))

    def loss64(tree):
        return _nll64(reference.gpt_forward(cfg, tree, inputs), targets)[mask].mean()

    eps = 1e-5
    for path, index in ((("h_1", "mlp", "c_fc", "kernel"), (3, 5)), (("wte", "embedding"), (4, 2)),
                        (("h_0", "attn", "c_attn", "kernel"), (1, 0, 1, 3))):
        leaf = params64
        for key in path[:-1]:
            leaf = leaf[key]
        original = leaf[path[-1]][index]
        leaf[path[-1]][index] = original + eps
        up = loss64(params64)
        leaf[path[-1]][index] = original - eps
        down = loss64(params64)
        leaf[path[-1]][index] = original
        got = grads
        for key in path:
            got = got[key]
        np.testing.assert_allclose(float(got[index]), (up - down) / (2 * eps), rtol=2e-3, atol=1e-6)


def test_changing_a_prompt_target_changes_neither_loss_nor_gradient():
    cfg = tiny()
    params = init(cfg)
    inputs, targets, mask = _masked_batch(np.random.default_rng(7), cfg)
    changed = targets.copy()
    changed[0, 2] = (changed[0, 2] + 1) % cfg.vocab_size  # a prompt target: mask is False there
    assert not mask[0, 2]
    value_and_grad = jax.value_and_grad(loss_fn, argnums=1)
    a = value_and_grad(GPT(cfg), params, jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(mask))
    b = value_and_grad(GPT(cfg), params, jnp.asarray(inputs), jnp.asarray(changed), jnp.asarray(mask))
    assert float(a[0]) == float(b[0])
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), a[1], b[1])


def test_accumulation_with_uneven_masks_gives_the_update_of_one_big_batch():
    cfg = tiny()
    params = init(cfg)
    rng = np.random.default_rng(8)
    rows, k = 6, 3
    inputs = rng.integers(0, cfg.vocab_size, (rows, cfg.block_size))
    targets = rng.integers(0, cfg.vocab_size, (rows, cfg.block_size))
    mask = np.zeros((rows, cfg.block_size), bool)
    for row, count in enumerate((1, 20, 3, 0, 12, 7)):  # row i·k + j is in micro-batch j: 1 + 0, 20 + 12, 3 + 7
        mask[row, :count] = True
    positions = np.broadcast_to(np.arange(cfg.block_size), (rows, cfg.block_size))
    segments = np.ones((rows, cfg.block_size), int)
    batch = tuple(jnp.asarray(a) for a in (inputs, targets, mask, positions, segments))
    optimizer = optax.sgd(1.0)  # params' = params − grads

    def step(accum):
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
        train_step = jax.jit(make_train_step(cfg, optimizer, lambda s: 1.0, grad_accum=accum))
        return train_step(state, batch, jax.random.key(0))

    (one, one_metrics), (many, many_metrics) = step(1), step(k)
    np.testing.assert_allclose(many_metrics["loss"], one_metrics["loss"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), many.params, one.params)

    # The loss of one batch over all its masked targets, in float64:
    nll = _nll64(reference.gpt_forward(cfg, jax.device_get(params), inputs), targets)
    np.testing.assert_allclose(float(one_metrics["loss"]), nll[mask].mean(), rtol=1e-5)
    # Averaging the micro-batches' own means would weigh their targets unequally:
    micro_means = [nll[j::k][mask[j::k]].mean() for j in range(k)]
    assert abs(np.mean(micro_means) - nll[mask].mean()) > 1e-3
