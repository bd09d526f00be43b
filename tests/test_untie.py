"""train.untie_at: the token embedding E and the untied unembedding W_U one table (W_U = Eᵀ, the embed
group's) for the steps s < S = round(untie_at · the schedule's steps), then two, W_U's optimizer state starting as E's.
The train step's AdamW updates against a float64 NumPy evaluation of the equations (tied steps on
g_E + g_Uᵀ, untied steps each on its own), the tables equal bit for bit before S and apart after, the
state copied at S under AdamW and Muon, a run resumed across S bit for bit like an uninterrupted one,
the sweep's --ablate setting it, and bad settings in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from runs import tiny_config, write_corpus
from test_model import tiny, tokens
from test_run import final_params

from jaxgpt.cli import parse_config
from jaxgpt.config import TrainConfig, default_config
from jaxgpt.errors import ConfigError
from jaxgpt.model import GPT, param_layout
from jaxgpt.optim import make_optimizer
from jaxgpt.optim.tying import Tying
from jaxgpt.train.step import init_state, loss_fn, make_train_step

CFG = tiny(tie_embeddings=False, n_layer=1)
# a constant rate (lr = min_lr, no warmup), the embed and head groups at rates of their own, decay, no clipping
TRAIN = TrainConfig(lr=0.01, min_lr=0.01, embed_lr=0.05, head_lr=0.02, warmup_steps=0, steps=4, untie_at=0.5,
                    clip=0.0, weight_decay=0.1)
STEPS = 4  # S = 2: steps 0 and 1 tied, 2 and 3 untied


def embedding_and_head(params):
    return params["wte"]["embedding"], params["lm_head"]["kernel"]


@pytest.fixture(scope="module")
def stepped():
    """(the states before and after each of STEPS steps, the untied model's gradients (g_E, g_U) at each
    state, the batch): the train step with two micro-batches, compiled once."""
    model = GPT(CFG)
    optimizer = make_optimizer(TRAIN, param_layout(model))
    step = jax.jit(make_train_step(model, optimizer, optax.constant_schedule(TRAIN.lr), grad_accum=2))
    untied_grads = jax.jit(jax.grad(lambda params, x, y: loss_fn(model, params, x, y)))
    x = tokens(CFG, 4, 9, seed=1)
    batch = (x[:, :-1], x[:, 1:])
    states = [init_state(model, optimizer, 0)]
    for _ in range(STEPS):
        states.append(step(states[-1], batch, jax.random.key(0))[0])
    grads = [embedding_and_head(untied_grads(state.params, *batch)) for state in states[:-1]]
    return states, grads


def f64(x):
    return np.asarray(x, np.float64)


def test_tied_and_untied_adamw_steps_match_float64(stepped):
    """While tied (s < S) the shared table takes Adam's update of G = g_E + g_Uᵀ at the embed group's rate η_E, with
    its decay; W_U's moments stay 0. From S each table takes its own gradient at its own rate, W_U's moments starting
    from E's (transposed):
        m ← β₁m + (1−β₁)g,  v ← β₂v + (1−β₂)g²,  θ ← θ − η_g(m/(1−β₁ᵗ) / (√(v/(1−β₂ᵗ)) + ε) + λθ)."""
    states, grads = stepped
    b1, b2, eps, decay = TRAIN.b1, TRAIN.b2, TRAIN.eps, TRAIN.weight_decay
    m_e = v_e = np.zeros((CFG.vocab_size, CFG.d_model))
    m_u = v_u = np.zeros((CFG.d_model, CFG.vocab_size))

    def adam(theta, m, v, g, t, rate):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g**2
        return theta - rate * (m / (1 - b1**t) / (np.sqrt(v / (1 - b2**t)) + eps) + decay * theta), m, v

    for s, (g_e, g_u) in enumerate(grads):
        e, u = map(f64, embedding_and_head(states[s].params))
        g_e, g_u = f64(g_e), f64(g_u)
        if s < TRAIN.untie_step:  # one table: E takes the sum of both gradients
            want_e, m_e, v_e = adam(e, m_e, v_e, g_e + g_u.T, s + 1, TRAIN.embed_lr)
            want_u = want_e.T
        else:
            if s == TRAIN.untie_step:
                m_u, v_u = m_e.T, v_e.T
            want_e, m_e, v_e = adam(e, m_e, v_e, g_e, s + 1, TRAIN.embed_lr)
            want_u, m_u, v_u = adam(u, m_u, v_u, g_u, s + 1, TRAIN.head_lr)
        got_e, got_u = embedding_and_head(states[s + 1].params)
        np.testing.assert_allclose(got_e, want_e, rtol=1e-5, atol=1e-6, err_msg=f"E after step {s}")
        np.testing.assert_allclose(got_u, want_u, rtol=1e-5, atol=1e-6, err_msg=f"W_U after step {s}")


def test_the_tables_are_one_before_the_untie_step_and_two_after(stepped):
    states, grads = stepped
    for s, state in enumerate(states):
        e, u = embedding_and_head(state.params)
        if s <= TRAIN.untie_step:  # the state a step reads: at S, W_U starts from the shared value
            np.testing.assert_array_equal(u, e.T, err_msg=f"state {s}")
        else:
            assert np.abs(u - e.T).max() > 1e-4, f"state {s}"
    g_e, g_u = grads[0]
    assert np.abs(g_u.T - g_e).max() > 1e-3  # the two gradients differ: the tie, not the data, made them one


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_at_the_untie_step_the_unembedding_takes_the_embeddings_optimizer_state(optimizer):
    """After tied updates (W_U's gradient 0), untie_state at S gives W_U's Adam moments E's, transposed, and
    leaves every other leaf; before S it leaves the state as it is."""
    model = GPT(CFG)
    train = TrainConfig(optimizer=optimizer, steps=4, warmup_steps=0, untie_at=0.5)
    optimizer_ = make_optimizer(train, param_layout(model))
    params = init_state(model, optimizer_, 0).params
    grads = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape)), params)
    grads["lm_head"]["kernel"] = jnp.zeros_like(grads["lm_head"]["kernel"])
    _, state = jax.jit(optimizer_.update)(grads, optimizer_.init(params), params)
    tying = optimizer_.tying
    untied, kept = (tying.untie_state(state, step, optimizer_) for step in (tying.untie_step, tying.untie_step - 1))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), kept, state))
    moments = [leaf for leaf in jax.tree.leaves(state) if leaf.shape == grads["lm_head"]["kernel"].shape]
    copied = [leaf for leaf in jax.tree.leaves(untied) if leaf.shape == grads["lm_head"]["kernel"].shape]
    tables = [leaf for leaf in jax.tree.leaves(state) if leaf.shape == grads["wte"]["embedding"].shape]
    assert len(moments) == len(copied) == 2 and all(not leaf.any() for leaf in moments)  # Adam's μ and ν of W_U
    assert len(tables) == 2 and all(np.abs(table).max() > 0 for table in tables)
    for table, leaf in zip(tables, copied, strict=True):
        np.testing.assert_array_equal(leaf, table.T)
    changed = [a for a, b in zip(jax.tree.leaves(untied), jax.tree.leaves(state), strict=True) if not (a == b).all()]
    assert len(changed) == 2


def test_a_run_resumed_across_the_untie_step_ends_bit_for_bit_as_an_uninterrupted_one(tmp_path):
    """untie_at = 0.67 of a schedule of 6 steps (decay_steps, which the stop at step 3 keeps): S = 4. A run stopped
    at step 3 (its checkpoint tied) and resumed ends with the params of one that ran the 6 steps straight, bit for
    bit; the tables are apart at the end."""
    from jaxgpt.train.run import train

    corpus = write_corpus(tmp_path / "corpus.txt")
    untie = {"model.tie_embeddings": False, "train.untie_at": 0.67, "train.decay_steps": 6, "train.eval_every": 6}
    assert train(tiny_config(tmp_path, corpus, "split", **untie, **{"train.steps": 3}))["step"] == 3
    e, u = embedding_and_head(final_params(tmp_path / "split"))
    np.testing.assert_array_equal(u, e.T)
    resumed = train(tiny_config(tmp_path, corpus, "split", **untie))
    whole = train(tiny_config(tmp_path, corpus, "whole", **untie))
    assert resumed["step"] == whole["step"] == 6 and resumed["val_loss"] == whole["val_loss"]
    split, straight = final_params(tmp_path / "split"), final_params(tmp_path / "whole")
    for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(a, b)
    e, u = embedding_and_head(straight)
    assert np.abs(u - e.T).max() > 0


@pytest.mark.parametrize("untie_at, message", [
    (0, "train.untie_at=0: must be None or a number in (0, 1)"),
    (1.0, "train.untie_at=1.0: must be None or a number in (0, 1)"),
    (-0.5, "train.untie_at=-0.5: must be None or a number in (0, 1)"),
    ("half", "train.untie_at='half': must be None or a number in (0, 1)"),
    (0.1, "train.untie_at=0.1 unties at step 0 of train.steps=4, which leaves no tied step: choose it in [0.25, 0.75]"),
    (0.9, "train.untie_at=0.9 unties at step 4 of train.steps=4, which leaves no untied step"),
    (0.99, "train.untie_at=0.99 unties at step 10 of train.decay_steps=10, which leaves no untied step"),
])
def test_a_bad_untie_at_is_one_line(untie_at, message):
    with pytest.raises(ConfigError) as error:
        TrainConfig(steps=4, warmup_steps=0, untie_at=untie_at, decay_steps=10 if untie_at == 0.99 else None)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_untie_at_with_tied_embeddings_is_refused_in_one_line():
    from jaxgpt.train.preflight import check_sections

    config = default_config()
    config.train.untie_at = 0.67
    assert config.model.tie_embeddings
    with pytest.raises(ConfigError) as error:
        check_sections(config, TrainConfig.from_mapping(config.train))
    assert str(error.value) == ("train.untie_at=0.67 unties the embedding and the unembedding, but "
                                "model.tie_embeddings=True makes them one table for the whole run: set "
                                "--config.model.tie_embeddings=False, or drop train.untie_at")
    with pytest.raises(ConfigError, match=r"^train.untie_at needs a model with one token embedding and one "):
        Tying.of(param_layout(GPT(tiny())), 2)


def test_the_sweep_sets_untie_at_from_an_ablation():
    from jaxgpt.sweep import DEFAULT_CONFIG, ablations_of

    setting = ablations_of(["untie:train.untie_at=0.67"])["untie"]
    assert setting == {"train.untie_at": "0.67"}
    config = parse_config(["sweep", *(f"--config.{key}={value}" for key, value in setting.items())], DEFAULT_CONFIG)
    assert TrainConfig.from_mapping(config.train).untie_at == 0.67
