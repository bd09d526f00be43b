"""The kernels' records (jaxgpt.attention.kernels.KERNELS) and the one check of a kernel
(jaxgpt.registries.check_kernel): 'auto' picks a kernel that can compute what the model asks on
every platform, a kernel chosen by name that cannot is refused in one line naming those that
can, and what each record says of attention dropout is what its kernel does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.attention import KERNELS, Kernel, Where, kernels
from jaxgpt.config import default_config
from jaxgpt.errors import ConfigError
from jaxgpt.model import CausalSelfAttention
from jaxgpt.model_config import ComputeConfig, GPTConfig
from jaxgpt.registries import check_kernel, check_model, compute_on, needs
from jaxgpt.train.opening import compute_config


def tiny(**changes) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=23, block_size=96, n_layer=1, n_head=2, d_model=16), **changes})


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_in_training_with_attention_dropout_picks_a_kernel_that_applies_it(platform, dtype):
    compute, cfg = ComputeConfig(kernel="auto", dtype=dtype), tiny(dropout=0.1)
    kernel = compute_on(compute, platform, cfg, training=True).kernel
    assert KERNELS[kernel].dropout and KERNELS[kernel].runs(platform, dtype)
    assert check_kernel("auto", cfg, platform, dtype=dtype, training=True) == kernel
    # without dropout to apply (sampling, or no dropout), the platform's own fused kernel
    assert compute_on(compute, platform, cfg).kernel == compute_on(compute, platform, tiny(), training=True).kernel == \
        {"cpu": "explicit", "gpu": "cudnn" if dtype == "bfloat16" else "xla", "tpu": "flash"}[platform]


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_a_run_with_dropout_resolves_auto_to_a_kernel_that_applies_it(platform):
    """opening.compute_config, which train.py and jaxgpt.compile call for the devices they compile for."""
    config = default_config()
    config.model.dropout, config.compute.kernel, config.compute.dtype = 0.1, "auto", "bfloat16"
    assert KERNELS[compute_config(config, platform).kernel].dropout


@pytest.mark.parametrize("kernel, platform, dtype", [("xla", "cpu", "float32"), ("cudnn", "gpu", "bfloat16"),
                                                     ("flash", "tpu", "float32")])
def test_a_kernel_that_cannot_apply_dropout_is_refused_in_one_line_naming_those_that_can(kernel, platform, dtype):
    cfg = tiny(dropout=0.1)
    with pytest.raises(ValueError) as refused:
        check_kernel(kernel, cfg, platform, dtype=dtype, training=True)
    assert str(refused.value) == (f"--config.compute.kernel={kernel} does not apply attention dropout "
                                  "(model.dropout=0.1): use explicit or blocked, or model.dropout=0")
    assert check_kernel(kernel, cfg, platform, dtype=dtype) == kernel  # sampling applies no dropout
    assert check_kernel(kernel, tiny(dropout=0.1, attention="linear"), platform, dtype=dtype, training=True) == \
        kernel  # a form without softmax weights never calls the kernel


def test_a_run_refuses_the_xla_kernel_with_dropout_before_anything_compiles():
    config = default_config()
    config.model.dropout, config.compute.kernel = 0.1, "xla"
    with pytest.raises(ConfigError, match=r"^--config.compute.kernel=xla does not apply attention dropout "
                                          r"\(model.dropout=0.1\): use explicit or blocked, or model.dropout=0$"):
        compute_config(config, "cpu")


def test_jaxgpt_compile_checks_the_kernel_as_a_run_does():
    """jaxgpt.compile builds its programs through opening.compute_config: the same check, first."""
    from jaxgpt.compile import compile_programs

    config = default_config()
    config.model.vocab_size, config.model.dropout, config.compute.kernel = 64, 0.1, "xla"
    with pytest.raises(ConfigError, match=r"^--config.compute.kernel=xla does not apply attention dropout"):
        compile_programs(config)


def test_a_kernel_computing_in_16_bits_only_is_refused_in_float32_naming_those_that_can():
    with pytest.raises(ValueError, match=r"^--kernel=cudnn computes in bfloat16 or float16 only, not float32: use "
                                         r"explicit or blocked or xla \(the model computes the same\)"):
        check_kernel("cudnn", tiny(), "gpu", dtype="float32", flag="--kernel")


@pytest.mark.parametrize("ability, cfg, packed, setting", [
    ("bias", tiny(positions="alibi"), False, "model.positions='alibi'"),
    ("window", tiny(attention="local", window=4), False, "model.attention='local'"),
    ("segments", tiny(), True, "packed records"),
])
def test_a_kernel_without_an_ability_the_model_asks_for_is_refused(monkeypatch, ability, cfg, packed, setting):
    """Today every kernel takes a bias, a window and segments: a kernel added without one is
    refused where the model or the data asks for it, and 'auto' passes it by."""
    lacking = Kernel(kernels.explicit, backend=None, dropout=True, **{**dict(bias=True, window=True, segments=True),
                                                                      ability: False})
    monkeypatch.setitem(KERNELS, "lacking", lacking)
    monkeypatch.setitem(kernels.PREFERENCE, "cpu", ("lacking",))
    assert set(needs(cfg, packed=packed)) == {ability}
    with pytest.raises(ValueError, match=rf"^--config.compute.kernel=lacking does not .*\({setting}.*\): use "
                                         r"explicit or blocked or xla$"):
        check_kernel("lacking", cfg, "cpu", packed=packed)
    assert check_kernel("lacking", tiny(), "cpu") == "lacking"
    assert check_kernel("auto", cfg, "cpu", packed=packed) == "explicit"
    assert check_kernel("auto", tiny(), "cpu") == "lacking"


def test_a_positional_bias_needs_a_form_with_softmax_scores():
    with pytest.raises(ValueError, match=r"attention='linear' with positions='alibi': the scheme asks softmax "
                                         r"scores for a bias, and this form forms none; use positions='learned' or"):
        check_model(tiny(attention="linear", positions="alibi"))


# --- what the records say of dropout is what the kernels do ---------------------------------------

T = 80  # past one block of the blocked kernel (kernels.BLOCK = 64): its blocks apply dropout too
KEYS = 256


@pytest.fixture(scope="module")
def attention_dropout():
    """For a kernel: (the attention layer's output without dropout, with dropout under one key, its
    mean over KEYS keys) of a tiny model with model.dropout = 0.5, on this CPU."""
    cfg = tiny(dropout=0.5)
    x = jax.random.normal(jax.random.key(1), (1, T, cfg.d_model))
    positions = jnp.arange(T)[None, :]
    where = Where(positions, positions)

    def outputs(kernel: str):
        layer = CausalSelfAttention(cfg, ComputeConfig(kernel=kernel))
        variables = layer.init(jax.random.key(0), x, where)

        @jax.jit
        def run(key):
            return layer.apply(variables, x, where, deterministic=False, rngs={"dropout": key})[0]

        keys = jax.random.split(jax.random.key(2), KEYS)
        many = jax.lax.map(run, keys)
        return np.asarray(layer.apply(variables, x, where)[0]), np.asarray(many[0]), np.asarray(many.mean(axis=0))

    return outputs


@pytest.mark.parametrize("kernel", [name for name, record in KERNELS.items() if record.runs("cpu", "float32")])
def test_each_record_says_truly_whether_its_kernel_applies_attention_dropout(attention_dropout, kernel):
    """A kernel whose record says dropout=True changes the output under a dropout key, and its
    mean over many keys is the output without dropout (inverted dropout is unbiased, and the
    layer is linear in the weights); one that says False leaves it as it is, which is why
    check_kernel refuses it when the model asks for dropout."""
    deterministic, one, mean = attention_dropout(kernel)
    if not KERNELS[kernel].dropout:
        np.testing.assert_allclose(one, deterministic, atol=1e-6)
        return
    spread = np.abs(one - deterministic).max()
    assert spread > 0.1 * np.abs(deterministic).max()
    assert np.abs(mean - deterministic).max() < 0.25 * spread
