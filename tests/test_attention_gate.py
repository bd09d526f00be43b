"""The attention output gate (model.attn_gate = G): each head's context scaled by σ(x[:G] W_g + b_g)_h
of its token, against the float64 reference of tests/reference.py (every block form, grouped heads,
linear and local attention), decode == forward for each attention form's cache, the declarations
and the starting point (½ on every head), the GPT-2 export's refusal and bad settings in one line
(scan_layers: tests/test_scan_layers.py; resume: tests/test_multi_token.py's run)."""

import jax
import numpy as np
import pytest
import reference as ref
from test_model import (
    RECIPE,
    decodes_as_forward,
    forward,
    init_params,
    matches_reference,
    random_params,
    tiny,
    tokens,
)

from jaxgpt import GPTConfig, convert
from jaxgpt.model import param_layout

CASES = {
    "G=5": {"attn_gate": 5},
    "G=d,post-norm": {"attn_gate": 16, "norm_position": "post"},
    "parallel,gqa": {"attn_gate": 3, "parallel_block": True, "n_head": 4, "n_kv_head": 2},
    "linear": {"attn_gate": 5, "attention": "linear", "positions": "rope"},
    "local,recipe": {**RECIPE, "attn_gate": 4, "attention": "local", "window": 3},
}


@pytest.mark.parametrize("changes", CASES.values(), ids=CASES.keys())
def test_forward_matches_float64_reference(changes):
    cfg = tiny(**changes)
    _, want = matches_reference(cfg)
    ungated = ref.gpt_forward(cfg.replace(attn_gate=0), jax.device_get(random_params(cfg)),
                              np.asarray(tokens(cfg, 2, 9)))
    assert np.abs(want - ungated).max() > 1e-3  # the gate did act


@pytest.mark.parametrize("form", [{}, {"attention": "local", "window": 3}, {"attention": "linear"}], ids=str)
def test_decode_equals_forward(form):
    """The gate reads only its own token: a prefill and one-token steps compute what one pass does."""
    decodes_as_forward(tiny(attn_gate=5, **form))


def test_layout_groups_and_starting_point():
    """W_g (gate, heads) and b_g (heads): scalars (AdamW, no weight decay), split over heads as the
    context is; both start at zero, so every head starts gated by σ(0) = ½: a fresh model computes
    what it does without the gate with W_O halved."""
    cfg = tiny(attn_gate=5)
    declared = param_layout(cfg)["h_0"]["attn"]
    got = {name: (leaf.names, leaf.group, leaf.value.shape) for name, leaf in declared.items()
           if name.startswith("gate")}
    assert got == {"gate": (("gate", "heads"), "scalar", (5, 2)), "gate_bias": (("heads",), "scalar", (2,))}
    fresh = jax.device_get(init_params(cfg))
    halved = {name: value for name, value in fresh.items()}
    for layer in range(cfg.n_layer):
        attn = dict(fresh[f"h_{layer}"]["attn"])
        assert not np.any(attn.pop("gate")) and not np.any(attn.pop("gate_bias"))
        attn["c_proj"] = {**attn["c_proj"], "kernel": attn["c_proj"]["kernel"] / 2}
        halved[f"h_{layer}"] = {**fresh[f"h_{layer}"], "attn": attn}
    x = tokens(cfg, 2, 9)  # the shape test_forward_matches_float64_reference compiled
    want = ref.gpt_forward(tiny(), halved, np.asarray(x))
    np.testing.assert_allclose(np.asarray(forward(cfg, init_params(cfg), x)), want, atol=1e-4, rtol=1e-4)


def test_gpt2_export_refuses_in_one_line():
    with pytest.raises(ValueError, match="attn_gate=12: GPT-2's heads are not gated") as error:
        convert.config_to_hf(tiny(d_model=32, attn_gate=12))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("value", [-1, 9, True, 2.0])
def test_bad_settings_are_one_line(value):
    with pytest.raises(ValueError, match=f"attn_gate={value!r}: must be 0") as error:
        GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8, attn_gate=value)
    assert "\n" not in str(error.value)
