"""attention='local', the sliding window, added through the form interface (jaxgpt/attention/
local.py): the float64 reference with the window in its mask, every softmax kernel, decoding
with a ring cache of `window` slots equal to the full forward, and the registries in step
with the config schema."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from test_model import decode_step_by_step, forward, random_params, tiny, tokens

from jaxgpt import ComputeConfig, GPTConfig, init_cache
from jaxgpt.attention import KERNELS, Kernel, RingCache, kernels
from jaxgpt.decode import sampling
from jaxgpt.registries import check_compute, check_model


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)


def test_a_kernel_added_to_the_registry_is_a_compute_setting_at_once(monkeypatch):
    """The registry is the list of valid names: one entry there (the function and its record of
    what it can do), and nothing else, makes a kernel."""
    calls = []

    def counting(q, k, v, where, bias_of, on_weights):
        calls.append(q.shape)
        return kernels.explicit(q, k, v, where, bias_of, on_weights)

    with pytest.raises(ValueError, match=r"kernel='counting': must be one of explicit, blocked, xla, cudnn"):
        check_compute(ComputeConfig(kernel="counting"))
    monkeypatch.setitem(KERNELS, "counting", Kernel(counting, backend=None, dropout=True, bias=True, window=True,
                                                    segments=True))
    cfg = tiny()
    params, x = random_params(cfg), tokens(cfg, 2, 9)
    close(forward(cfg, params, x, compute=ComputeConfig(kernel="counting")), forward(cfg, params, x))
    assert calls == [(2, 9, cfg.n_head, cfg.head_dim)] * cfg.n_layer


def test_a_window_is_only_for_the_local_form():
    with pytest.raises(ValueError, match=r"window=8 with attention='softmax': only attention='local' reads it"):
        check_model(GPTConfig(window=8))


@pytest.mark.parametrize("kernel", ["explicit", "blocked", "xla"])
@pytest.mark.parametrize("positions", ["learned", "rope", "alibi"])
def test_each_kernel_computes_the_windowed_reference(kernel, positions):
    """T = 70 > one query block (64): the blocked kernel's blocks see the window too."""
    cfg = tiny(attention="local", window=5, positions=positions, block_size=80)
    params = random_params(cfg)
    x = tokens(cfg, 2, 70)
    want = ref.gpt_forward(cfg, jax.device_get(params), np.asarray(x))
    close(forward(cfg, params, x, compute=ComputeConfig(kernel=kernel)), want, 1e-4)


def test_a_window_as_long_as_the_context_is_softmax_attention():
    local = tiny(attention="local", window=16)
    params = random_params(local)
    x = tokens(local, 2, 16)
    close(forward(local, params, x), forward(tiny(), params, x))


@pytest.mark.parametrize("window", [1, 3, 6])
def test_decoding_through_the_ring_equals_the_full_forward(window):
    """Prefill 1, 4 or 11 tokens, then one at a time: the ring of `window` slots wraps many times."""
    cfg = tiny(attention="local", window=window, positions="rope")
    params = random_params(cfg)
    x = tokens(cfg, 2, 14)
    full = forward(cfg, params, x)
    for prompt_length in (1, 4, 11):
        close(decode_step_by_step(cfg, params, x, prompt_length, cfg.block_size), full)


def test_the_cache_is_bounded_by_the_window():
    cfg = tiny(attention="local", window=3)
    cache = init_cache(cfg, 2)
    assert isinstance(cache, RingCache) and cache.keys[0].shape == (2, 3, cfg.n_kv_head, cfg.head_dim)
    params, x = random_params(cfg), tokens(cfg, 2, 12)
    _, cache = forward(cfg, params, x, cache)
    assert cache.keys[0].shape[1] == 3  # twelve tokens seen, three kept
    np.testing.assert_array_equal(np.sort(np.asarray(cache.positions[0]), axis=1), [[9, 10, 11]] * 2)


def test_generate_with_padded_prompts_and_past_the_context_equals_recomputing():
    """Two prompt lengths in one padded batch, generated past block_size (cropping): each row's
    greedy tokens are the argmax of one full forward of its own cropped sequence."""
    cfg = tiny(attention="local", window=4, block_size=8)
    params = random_params(cfg)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    result = sampling.generate(params, cfg, prompts, 0, max_new_tokens=7, temperature=0.0)
    for prompt, row in zip(prompts, result.new_tokens(), strict=True):
        sequence = list(prompt)
        for token in row:
            window = jnp.asarray(sequence[-cfg.block_size:])[None]
            assert int(jnp.argmax(forward(cfg, params, window)[0, -1])) == int(token)
            sequence.append(int(token))
