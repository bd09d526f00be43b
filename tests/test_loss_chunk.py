"""compute.loss_chunk: the unembedding and the cross-entropy a chunk of tokens at a time
(chunked.chunked_cross_entropy, jaxgpt.loss) compute the whole-logits path's loss, gradients,
evaluation sums and scores, and the compiled program never holds the whole logits."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from processes import xla_flags

from jaxgpt import ops
from jaxgpt.loss import chunked, score_targets
from jaxgpt.model import GPT
from jaxgpt.model_config import ComputeConfig, GPTConfig
from jaxgpt.score.likelihood import Row, score_rows
from jaxgpt.train.step import init_state, loss_fn, make_eval_step, make_train_step

TESTS = Path(__file__).resolve().parent
B, T, V = 3, 16, 67  # 48 tokens: chunks of 7 leave a remainder, padded
VARIANTS = {  # the unembedding tied (W_U = Eᵀ), or its own matrix with a bias b_U and soft-capped logits
    "tied": dict(tie_embeddings=True),
    "untied, bias, soft cap": dict(tie_embeddings=False, logits_bias=True, logit_softcap=3.0),
}


def tiny(**changes) -> GPTConfig:
    return GPTConfig(vocab_size=V, block_size=T, n_layer=1, n_head=2, d_model=16, **changes)


def params_of(cfg: GPTConfig):
    params = GPT(cfg).init(jax.random.key(0), jnp.zeros((1, T), jnp.int32))["params"]
    if cfg.logits_bias:  # a bias that is not zero, so that its gradient and its part in the logits count
        params["logits_bias"] = jax.random.normal(jax.random.key(1), (V,))
    return params


def batch(seed=2):
    rng = np.random.default_rng(seed)
    inputs, targets = rng.integers(0, V, size=(2, B, T)).astype(np.int32)
    return inputs, targets, rng.random((B, T)) < 0.7


def max_difference(a, b) -> float:
    return max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max())
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# --- the formula itself, against float64 NumPy ---------------------------------------------------


def test_chunked_cross_entropy_and_its_gradient_are_the_float64_formula(rng):
    """L = (1/N) Σ m_i (log Σ exp z_i − z_i[y_i]) with z = c·tanh((hW + b)/c), ∂L/∂z = (m/N)(softmax − e_y),
    computed 4 tokens at a time over 15 (one chunk padded), against NumPy in float64."""
    n, d, vocab, cap, count = 15, 6, 11, 4.0, 20.0
    h, w, b = rng.normal(size=(n, d)), rng.normal(size=(d, vocab)), rng.normal(size=vocab)
    y, m = rng.integers(0, vocab, size=n), (rng.random(n) < 0.6).astype(np.float64)

    def logits_fn(weights, x):
        return ops.softcap(x @ weights["w"] + weights["b"], cap)

    def loss(weights, x):
        return chunked.chunked_cross_entropy(logits_fn, weights, x, jnp.asarray(y), jnp.asarray(m), jnp.float32(count),
                                         chunk=4)

    weights = {"w": jnp.asarray(w, jnp.float32), "b": jnp.asarray(b, jnp.float32)}
    value, (grad_w, grad_h) = jax.value_and_grad(loss, argnums=(0, 1))(weights, jnp.asarray(h, jnp.float32))

    u = h @ w + b
    z = cap * np.tanh(u / cap)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    want = (m * (lse - z[np.arange(n), y])).sum() / count
    dz = (np.exp(z - lse[:, None]) - np.eye(vocab)[y]) * (m / count)[:, None]
    du = dz * (1 - np.tanh(u / cap) ** 2)
    np.testing.assert_allclose(float(value), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_w["w"]), h.T @ du, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_w["b"]), du.sum(0), atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_h), du @ w.T, atol=1e-6)
    assert np.abs(h.T @ du).max() > 1e-3  # the gradients are not trivially zero


# --- the model's loss, evaluation and scores: chunked = whole -------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_and_gradients_equal_the_whole_logits(variant):
    """With a loss mask and a count (gradient accumulation's denominator), chunks of 7 of 48 tokens."""
    cfg = tiny(**VARIANTS[variant])
    params, (inputs, targets, mask) = params_of(cfg), batch()

    def value_and_grad(model):
        return jax.jit(jax.value_and_grad(lambda p: loss_fn(model, p, inputs, targets, mask, count=jnp.float32(50.0))))(
            params)

    (whole, whole_grads), (chunked, chunked_grads) = (value_and_grad(GPT(cfg, ComputeConfig(loss_chunk=c)))
                                                      for c in (0, 7))
    assert abs(float(whole) - float(chunked)) < 1e-5
    assert max_difference(whole_grads, chunked_grads) < 1e-5
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(whole_grads)) > 1e-3


def test_eval_step_and_scores_equal_the_whole_logits():
    """eval_step's (Σ loss, count), score_targets' (log p(y), greedy) with and without a KV
    cache, and the likelihood's row scores."""
    cfg = tiny(**VARIANTS["untied, bias, soft cap"])
    params, (inputs, targets, mask) = params_of(cfg), batch()
    whole, chunked = GPT(cfg), GPT(cfg, ComputeConfig(loss_chunk=5))
    sums = [make_eval_step(model)(params, inputs, targets, mask) for model in (whole, chunked)]
    assert max_difference(*sums) < 1e-4 and float(sums[0][1]) == mask.sum()

    scores = [score_targets(model, params, inputs, targets) for model in (whole, chunked)]
    assert max_difference(scores[0][0], scores[1][0]) < 1e-5
    np.testing.assert_array_equal(scores[0][1], scores[1][1])
    greedy_targets = np.asarray(jnp.argmax(whole.apply({"params": params}, inputs), -1))  # every target greedy
    assert np.asarray(score_targets(chunked, params, inputs, greedy_targets)[1]).all()

    from jaxgpt.attention import init_cache
    cached = [score_targets(model, params, inputs[:, :4], targets[:, :4], init_cache(cfg, B))
              for model in (whole, chunked)]
    assert max_difference(cached[0][0], cached[1][0]) < 1e-5
    assert max_difference(cached[0][2], cached[1][2]) == 0.0  # the same keys and values written

    rows = [Row(inputs[i, :n], targets[i, :n], mask[i, :n]) for i, n in enumerate((16, 9, 5))]
    row_scores = [score_rows(model, params, rows, batch_size=2) for model in (whole, chunked)]
    assert max_difference([s for s, _ in row_scores[0]], [s for s, _ in row_scores[1]]) < 1e-4


def test_one_train_step_equals_the_whole_logits():
    """AdamW, two accumulated micro-batches: the same loss, gradient norm and parameters."""
    cfg = tiny(**VARIANTS["tied"])
    optimizer, schedule = optax.adamw(1e-2), optax.constant_schedule(1e-2)
    inputs, targets, _ = batch()
    rows = np.concatenate([inputs, inputs[::-1]]), np.concatenate([targets, targets[::-1]])  # 6 rows: 2 × 3
    results = []
    for chunk in (0, 11):
        model = GPT(cfg, ComputeConfig(loss_chunk=chunk))
        state = init_state(model, optimizer, 0)
        results.append(jax.jit(make_train_step(model, optimizer, schedule, grad_accum=2))(
            state, rows, jax.random.key(0)))
    (whole, whole_metrics), (chunked, chunked_metrics) = results
    assert abs(float(whole_metrics["loss"]) - float(chunked_metrics["loss"])) < 1e-5
    assert abs(float(whole_metrics["grad_norm"]) - float(chunked_metrics["grad_norm"])) < 1e-5
    assert max_difference(whole.params, chunked.params) < 1e-5


# --- the invariant: no (tokens, vocabulary) array -------------------------------------------------

_SHAPE = re.compile(r"\b(?:f32|bf16|f16)\[([\d,]+)\]")


def largest_float_array(hlo: str) -> int:
    """The elements of the largest floating-point array in a compiled program's HLO text."""
    return max(int(np.prod([int(d) for d in dims.split(",")])) for dims in _SHAPE.findall(hlo))


def test_the_compiled_loss_and_gradient_never_hold_the_whole_logits():
    """The compiled loss and gradient of 2 × 64 tokens over a vocabulary of 2048: with chunks of
    16 tokens no array holds 128 × 2048 elements (the largest is a chunk's logits, or a weight),
    while the whole-logits program does hold them."""
    cfg = GPTConfig(vocab_size=2048, block_size=64, n_layer=1, n_head=2, d_model=16)
    params = GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 64), jnp.int32))["params"]
    tokens = jnp.zeros((2, 64), jnp.int32)
    whole_logits = tokens.size * cfg.vocab_size

    def largest(chunk: int) -> int:
        model = GPT(cfg, ComputeConfig(loss_chunk=chunk))
        grad = jax.jit(jax.value_and_grad(lambda p: loss_fn(model, p, tokens, tokens)))
        return largest_float_array(grad.lower(params).compile().as_text())

    assert largest(0) >= whole_logits
    assert largest(16) <= max(16 * cfg.vocab_size, cfg.vocab_size * cfg.d_model, 2 * 2 * 64 * 64)
    assert largest(16) < whole_logits // 4


def test_a_chunk_larger_than_the_batch_is_the_whole_logits_in_one_chunk():
    """loss_chunk = 1000 over a batch of 48 tokens: the loss, its gradients and the eval step's
    sums are the whole logits' (a float compare), and the compiled program holds the 48 tokens'
    logits once, never a 1000-token chunk padded from them."""
    cfg = tiny(**VARIANTS["untied, bias, soft cap"])
    params, (inputs, targets, mask) = params_of(cfg), batch()
    whole, one_chunk = GPT(cfg), GPT(cfg, ComputeConfig(loss_chunk=1000))

    def value_and_grad(model):
        return jax.jit(jax.value_and_grad(lambda p: loss_fn(model, p, inputs, targets, mask)))

    (loss, grads), (chunked_loss, chunked_grads) = (value_and_grad(m)(params) for m in (whole, one_chunk))
    assert abs(float(loss) - float(chunked_loss)) < 1e-6 and max_difference(grads, chunked_grads) < 1e-6
    sums = [make_eval_step(model)(params, inputs, targets, mask) for model in (whole, one_chunk)]
    assert max_difference(*sums) < 1e-4
    hlo = value_and_grad(one_chunk).lower(params).compile().as_text()
    assert largest_float_array(hlo) < 1000 * V and f"f32[{B * T},{V}]" in hlo


def test_the_estimate_and_the_checks_take_a_chunk_larger_than_the_batch_as_one_chunk_of_it():
    """A chunk of 10⁹ tokens was estimated as 10⁹ tokens' logits ("the run needs about 514 GiB")
    and refused: a micro-batch of N tokens holds at most N tokens' logits, so the memory check
    passes it and the micro-batch planner chooses as for a chunk of N."""
    from jaxgpt.config import TrainConfig
    from jaxgpt.train import micro_batch, preflight

    cfg, huge = tiny(), ComputeConfig(loss_chunk=10**9)
    train = TrainConfig(batch_size=B, grad_accum=1)
    assert micro_batch.chunk_bytes(cfg, huge, B * T) == micro_batch.chunk_bytes(cfg, huge.replace(loss_chunk=B * T),
                                                                                 B * T) == 8 * B * T * V
    preflight.check_memory(cfg, huge, train)  # no ConfigError
    rows = TrainConfig(rows_per_step=8, batch_size=0, grad_accum=0, memory_limit_gib=1.0)
    devices = jax.devices()[:1]
    assert micro_batch.fitted_plan(rows, 1, cfg, huge, devices) == micro_batch.fitted_plan(
        rows, 1, cfg, huge.replace(loss_chunk=8 * T), devices)
    assert micro_batch.fitted_plan(rows, 1, cfg, huge, devices).batch_size == 8


def test_a_run_with_a_chunk_larger_than_its_batch_trains_as_the_whole_logits(tmp_path):
    """train.py with compute.loss_chunk=10⁹ on the machine's own devices: not refused, and its
    losses are those of the same run with the whole logits."""
    from runs import cli_args, write_corpus
    from test_user_commands import run

    corpus = write_corpus(tmp_path / "corpus.txt")
    losses = []
    for chunk in (10**9, 0):
        args = cli_args(tmp_path, corpus, run=f"chunk_{chunk}", **{"train.steps": 2, "compute.loss_chunk": chunk})
        done = run(["python", "train.py", *args], tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        records = (tmp_path / f"chunk_{chunk}" / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(line)["train_loss"] for line in records])
    assert len(losses[0]) == 2 and np.allclose(losses[0], losses[1], rtol=0, atol=1e-5), losses


# --- sharded, and bad input -------------------------------------------------------------------------


def test_sharded_chunked_training_equals_one_device_whole_logits():
    """On 8 fake CPU devices (data, fsdp, tensor = 2, 2, 2: the rows split 4 ways), chunks of 4 tokens
    a device: three steps give the single-device whole-logits losses and parameters."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "PYTHONPATH": str(TESTS.parent)}
    script = ("import json, sys, numpy as np, jax, sharded_training as st\n"
              "from jaxgpt.model import GPT\nfrom jaxgpt.model_config import ComputeConfig\n"
              "ref, ref_params, _, _ = st.run(None)\nout = {}\n"
              "for shape in [(2, 2, 2)]:\n"
              "    losses, params, _, _ = st.run(shape, cfg=GPT(st.CFG, ComputeConfig(loss_chunk=4)))\n"
              "    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)\n"
              "    out[str(shape)] = [max(abs(a - b) for a, b in zip(losses, ref)),\n"
              "                       max(float(np.abs(a - b).max()) for a, b in pairs)]\n"
              "json.dump(out, sys.stdout)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=TESTS,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for mesh, (loss_diff, param_diff) in json.loads(done.stdout).items():
        assert loss_diff < 1e-5 and param_diff < 1e-5, mesh


@pytest.mark.parametrize("chunk", [-1, 2.5, "4096", True])
def test_a_chunk_that_is_not_a_count_of_tokens_is_one_line(chunk):
    with pytest.raises(ValueError, match=r"^ComputeConfig.loss_chunk=.*: must be an integer ≥ 0, the tokens per chunk"
                                         r"[^\n]*$"):
        ComputeConfig(loss_chunk=chunk)
