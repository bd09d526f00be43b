"""attention='linear': the parallel causal form against the recurrence (float64 NumPy), the
constant-size recurrent state, and generation with it, past the context where the positions
allow. The reference forward, causality and decode-equals-forward tests list it with the other
variants (test_model.VARIANTS, test_model.CAUSAL, test_variants.CACHED)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from test_model import forward, random_params, tiny, tokens

from jaxgpt import init_cache, ops
from jaxgpt.decode.sampling import generate


@pytest.mark.parametrize("feature", ["elu+1", "relu"])
@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_parallel_form_equals_the_recurrence(feature, n_kv_head):
    """(A V)/(A 1 + ε) with A = φ(Q)φ(K)ᵀ ⊙ M, against S_t, z_t accumulated token by token in float64."""
    rng = np.random.default_rng(0)
    B, T, H, D = 2, 64, 4, 8
    q, k, v = rng.standard_normal((B, T, H, D)), rng.standard_normal((B, T, n_kv_head, D)), \
        rng.standard_normal((B, T, n_kv_head, D))
    phi = ops.FEATURE_MAPS[feature]
    fq, fk = phi(jnp.asarray(q, jnp.float32)), phi(jnp.asarray(k, jnp.float32))
    got = ops.linear_attention(fq, fk, jnp.asarray(v, jnp.float32), ops.causal_mask(T))
    shared = np.repeat(k, H // n_kv_head, axis=2), np.repeat(v, H // n_kv_head, axis=2)
    want = ref.linear_attention_recurrent(q, *shared, feature)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_state_is_the_sum_over_absorbed_tokens():
    """S = Σ φ(k_s) v_sᵀ and z = Σ φ(k_s) over the tokens marked absorb, in float64."""
    rng = np.random.default_rng(1)
    fk, v = np.abs(rng.standard_normal((2, 6, 3, 4))), rng.standard_normal((2, 6, 3, 5))
    absorb = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]], bool)
    zero = (jnp.zeros((2, 3, 4, 5)), jnp.zeros((2, 3, 4)))
    S, z = ops.linear_attention_state(jnp.asarray(fk, jnp.float32), jnp.asarray(v, jnp.float32), absorb, zero)
    for b in range(2):
        kept = absorb[b]
        np.testing.assert_allclose(np.asarray(S[b]), np.einsum("shd,she->hde", fk[b, kept], v[b, kept]), atol=1e-5)
        np.testing.assert_allclose(np.asarray(z[b]), fk[b, kept].sum(0), atol=1e-5)


def test_the_state_does_not_grow():
    cfg = tiny(attention="linear", positions="rope", n_head=4, n_kv_head=2)
    cache = init_cache(cfg, 3)
    size = sum(leaf.nbytes for leaf in cache.S + cache.z)
    assert size == cfg.n_layer * 3 * 2 * (4 * 4 + 4) * 4  # layers, rows, kv heads, D·D + D (D = 16/4), float32
    params = random_params(cfg)
    for length in (5, 1, 1):
        _, cache = forward(cfg, params, tokens(cfg, 3, length), cache)
        assert sum(leaf.nbytes for leaf in cache.S + cache.z) == size
    np.testing.assert_array_equal(np.asarray(cache.index), 7)


def assert_greedy(cfg, params, sequence, prompt_length):
    """Each token after the prompt is the argmax of a full forward over the whole sequence
    before it (one forward of the whole sequence: position t−1 sees only tokens 0…t−1)."""
    logits = forward(cfg, params, jnp.asarray([sequence]))[0]
    chosen = np.asarray(jnp.argmax(logits[prompt_length - 1:-1], axis=-1)).tolist()
    assert sequence[prompt_length:] == chosen


@pytest.mark.parametrize("positions", ["rope", "none"])
def test_generation_goes_past_the_context_with_the_state(positions):
    """block_size 8, prompts of 2 and 5 tokens and 12 new ones: past the context the model reads
    the whole sequence (nothing is cropped), and the recurrent decode gives the tokens a full
    forward over the sequence gives, row by row, in one padded batch."""
    cfg = tiny(attention="linear", positions=positions, block_size=8)
    params = random_params(cfg)
    prompts = [[3, 9], [1, 4, 1, 5, 9]]
    out = generate(params, cfg, prompts, jax.random.key(0), max_new_tokens=12, temperature=0.0)
    for row, prompt in enumerate(prompts):
        length = int(out.lengths[row])
        assert length == len(prompt) + 12
        assert_greedy(cfg, params, np.asarray(out.tokens[row, :length]).tolist(), len(prompt))


def test_positions_that_end_at_the_context_are_refused_past_it():
    cfg = tiny(attention="linear", positions="learned", block_size=8)
    params = random_params(cfg)
    with pytest.raises(ValueError, match=r"attention='linear' with positions='learned' has positions only up to "
                                         r"block_size=8.*positions='rope' or 'none'"):
        generate(params, cfg, [[1, 2, 3]], jax.random.key(0), max_new_tokens=6)
    out = generate(params, cfg, [[1, 2, 3]], jax.random.key(0), max_new_tokens=5, temperature=0.0)
    assert_greedy(cfg, params, np.asarray(out.tokens[0]).tolist(), 3)
