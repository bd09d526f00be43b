"""Parameters declare their layout (jaxgpt.layout): every parameter and every optimizer-state
leaf of each model variant is laid out on a (data 2, fsdp 2, tensor 2) mesh as a hand-written
table says, the per-device bytes are that table's count, a parameter made without axes is
refused, and no module of the package but model.py and convert.py names the model's modules."""

import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from processes import finished, with_devices

from jaxgpt import layout
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT, param_layout

ROOT = Path(__file__).resolve().parent.parent
MODULE_NAMES = re.compile(r"\b(c_attn|q_proj|kv_proj|c_proj|c_fc\w*|lm_head|wte|wpe)\b")


def test_no_module_but_the_model_and_the_gpt2_mapping_names_the_models_modules():
    """Layouts, groups, Muon's axes, quantisation and circuits read declarations, not names."""
    named = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in sorted((ROOT / "jaxgpt").rglob("*.py")) if path.name not in ("model.py", "convert.py")
             for number, line in enumerate(path.read_text().splitlines(), 1) if MODULE_NAMES.search(line)]
    assert named == []


class Undeclared(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x * self.param("gain", nn.initializers.ones, (x.shape[-1],))


def test_a_parameter_made_without_axes_is_refused_naming_it():
    params = jax.eval_shape(lambda: nn.Module.init(Undeclared(), jax.random.key(0), jnp.ones((2, 3)))["params"])
    with pytest.raises(ValueError, match=r"^parameter gain was made without logical axes: make it with "
                                         r"jaxgpt\.layout\.declare"):
        layout.check(params)
    with pytest.raises(ValueError, match=r"declare: unknown logical axes \['embd'\]"):
        layout.declare(nn.initializers.ones, ("embd",))


def test_a_rule_naming_an_unknown_mesh_axis_is_refused():
    with pytest.raises(ValueError, match=r"layout rules embed → model: a rule maps a logical axis"):
        layout.check_rules((*layout.RULES[1:], ("embed", "model")))


def test_each_matrix_declares_its_inputs_and_muons_axes_follow():
    """Worked example: the attention's projections and the FFN, per layer and stacked."""
    cfg = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=8, block_size=8, ffn_layers=2)
    block = param_layout(cfg)["h_0"]
    assert layout.matrix_axes(block["attn"]["c_attn"]["kernel"]) == ((0,), (2, 3))  # (d | 3, H, D)
    assert layout.matrix_axes(block["attn"]["c_proj"]["kernel"]) == ((0, 1), (2,))  # (H, D | d)
    assert layout.matrix_axes(block["mlp"]["c_fc_2"]["kernel"]) == ((0,), (1,))


# Each parameter's split on the (2, 2, 2) mesh, written out: which of its dimensions the data,
# fsdp and tensor axes divide (None: whole), keyed by the end of its path.
EXPECTED = {
    "wte/embedding": ("tensor", "fsdp"), "wpe/embedding": (None, "fsdp"),
    "attn/c_attn/kernel": ("fsdp", None, "tensor", None), "attn/c_attn/bias": (None, "tensor", None),
    "attn/q_proj/kernel": ("fsdp", "tensor", None), "attn/q_proj/bias": ("tensor", None),
    "attn/kv_proj/kernel": ("fsdp", None, "tensor", None), "attn/kv_proj/bias": (None, "tensor", None),
    "attn/c_proj/kernel": ("tensor", None, "fsdp"), "attn/c_proj/bias": (None,),
    "mlp/c_fc/kernel": ("fsdp", "tensor"), "mlp/c_fc/bias": ("tensor",),
    "mlp/c_fc_2/kernel": ("fsdp", "tensor"), "mlp/c_fc_3/kernel": ("fsdp", "tensor"),
    "mlp/c_fc_2/bias": ("tensor",), "mlp/c_fc_3/bias": ("tensor",),
    "mlp/c_proj/kernel": ("tensor", "fsdp"), "mlp/c_proj/bias": (None,),
    "lm_head/kernel": ("fsdp", "tensor"), "logits_bias": ("tensor",),
    "scale": (None,), "bias": (None,),  # norms' gains and biases (and q_norm/k_norm's)
    "previous/bigram": ("tensor", "fsdp"), "previous/smear_gate": (None,), "previous/smear_lambda": (),
    "previous/trigram": ("tensor", "fsdp"),
    # a value table's rows over tensor like the token table's, each head's width over fsdp like its d_model
    "value_embeds/table_0": ("tensor", None, "fsdp"), "value_embeds/table_1": ("tensor", None, "fsdp"),
    "value_embeds/gate_0": (), "value_embeds/gate_1": (), "unet/w_0": (),
    "attn/gate": (None, "tensor"), "attn/gate_bias": ("tensor",),  # the attention gate's, split as the heads
    "dense_skips/w1_1": ("fsdp", None), "dense_skips/w2_1": (None, None), "dense_skips/b_1": (None,),  # W1 reads d
}
MULTI_QUERY = {"attn/kv_proj/kernel": ("fsdp", None, None, None), "attn/kv_proj/bias": (None, None, None)}

LAYOUTS = r"""
import json, math, sys
import jax
from jaxgpt import layout
from jaxgpt.config import ComputeConfig, GPTConfig, TrainConfig
from jaxgpt.model import GPT, param_layout
from jaxgpt.optim import make_optimizer
from jaxgpt.sharding import make_mesh
from jaxgpt.train.step import abstract_state

mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
out = {}
for name, (fields, scan, optimizer) in json.loads(sys.argv[1]).items():
    gpt = GPT(GPTConfig(**fields), ComputeConfig(scan_layers=scan))
    declared = param_layout(gpt)
    state = abstract_state(gpt, make_optimizer(TrainConfig(optimizer=optimizer), declared), mesh)
    leaves = []
    for part in ("params", "opt_state"):
        for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(state, part)):
            keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
            shard = leaf.sharding.shard_shape(leaf.shape)
            leaves.append([part, keys, list(leaf.shape), [str(a) for a in leaf.sharding.spec], list(shard),
                           leaf.dtype.itemsize])
    out[name] = {"leaves": leaves, "declared_bytes": layout.bytes_per_device(declared, mesh)}
print(json.dumps(out))
"""

BASE = dict(vocab_size=64, n_layer=2, n_head=4, d_model=16, block_size=8)
VARIANTS = {
    "ffn_layers=3": (dict(BASE, ffn_layers=3), False, "adamw"),
    "ffn_layers=3, scan_layers, muon": (dict(BASE, ffn_layers=3), True, "muon"),
    "grouped-query": (dict(BASE, n_kv_head=2), False, "muon"),
    "multi-query": (dict(BASE, n_kv_head=1), False, "adamw"),
    "head_dim, untied, logits bias": (dict(BASE, head_dim=6, tie_embeddings=False, logits_bias=True), False, "adamw"),
    "qk_norm, rmsnorm, relu2, bias": (dict(BASE, qk_norm=True, norm="rmsnorm", activation="relu2", bias=True), False,
                                      "muon"),
    "sinusoidal": (dict(BASE, positions="sinusoidal"), False, "adamw"),
    "rope": (dict(BASE, positions="rope"), False, "adamw"),
    "alibi": (dict(BASE, positions="alibi"), False, "adamw"),
    "none": (dict(BASE, positions="none"), True, "adamw"),
    "linear": (dict(BASE, attention="linear"), False, "adamw"),
    "local": (dict(BASE, attention="local", window=4), False, "adamw"),
    "smear, bigram_table, trigram_table, attn_gate, scan_layers, muon": (
        dict(BASE, smear=True, bigram_table=50, trigram_table=50, attn_gate=4), True, "muon"),
    "value_embeds, unet_skips, dense_skips, muon": (dict(BASE, value_embeds=((0,), (1,)), unet_skips=True,
                                                         dense_skips=4), False, "muon"),
    "key_offset, paired_heads, scan_layers": (dict(BASE, positions="rope", key_offset=True, paired_heads=(1,)), True,
                                              "muon"),
}


def expected_spec(keys: list[str], variant: str) -> tuple | None:
    """The table's split of the param at the end of `keys` (None: no param ends there)."""
    names = [k for k in keys if not re.fullmatch(r"h_\d+|h|\d+|mu|nu|inner_states|[a-z_]*state", k)]
    table = {**EXPECTED, **(MULTI_QUERY if variant == "multi-query" else {})}
    for size in (3, 2, 1):
        if "/".join(names[-size:]) in table:
            return table["/".join(names[-size:])]
    return None


@pytest.fixture(scope="module")
def layouts():
    import json

    return json.loads(finished(with_devices(LAYOUTS, json.dumps(VARIANTS), devices=8), timeout=600))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_parameter_and_optimizer_state_is_laid_out_as_declared(layouts, variant):
    """Each param, and each optimizer-state leaf of a param's shape (AdamW's moments, Muon's
    momentum), splits as the table says (a stacked layer axis whole); the per-device bytes of
    the params are the table's count, which the declarations' own count equals."""
    found = layouts[variant]
    stacked = VARIANTS[variant][1]
    params_bytes = 0
    for part, keys, shape, spec, shard, itemsize in found["leaves"]:
        want = expected_spec(keys, variant)
        if part == "opt_state" and want is None:  # counts, Newton–Schulz's coefficients: whole
            assert all(axis == "None" for axis in spec), keys
            continue
        assert want is not None, f"no expected layout for {'/'.join(keys)}"
        if stacked and "h" in keys:
            want = (None, *want)
        spec = [None if s == "None" else s for s in spec] + [None] * (len(shape) - len(spec))
        assert tuple(spec) == want, (part, keys)
        ways = [2 if axis else 1 for axis in want]
        assert shard == [n // w for n, w in zip(shape, ways, strict=True)], (part, keys)
        if part == "params":
            params_bytes += itemsize * int(jnp.prod(jnp.array(shard)))
    assert params_bytes == found["declared_bytes"]


def test_the_deeper_ffn_layers_split_like_the_first():
    """The fault this layout fixes: c_fc_2 … c_fc_n matched no name rule and were replicated."""
    cfg = GPTConfig(**dict(BASE, ffn_layers=3))
    mlp = param_layout(cfg)["h_0"]["mlp"]
    assert [mlp[f"c_fc{s}"]["kernel"].names for s in ("", "_2", "_3")] == [("embed", "mlp"), ("mlp_in", "mlp"),
                                                                             ("mlp_in", "mlp")]
    assert jax.tree.leaves(GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32)))[0].__class__ is not \
        layout.Declared  # init gives plain arrays


def test_the_declarations_are_read_whatever_kernel_computes_the_model():
    """The layout is traced on a whole row, as training's init is: the TPU flash kernel's blocks
    of 128 queries are not asked to fit one token (the compile of GPT-2 for a TPU slice)."""
    from jaxgpt.config import ComputeConfig

    cfg = GPTConfig(**dict(BASE, block_size=256))
    flash = param_layout(GPT(cfg, ComputeConfig(kernel="flash")))
    assert jax.tree.map(lambda leaf: leaf.names, flash, is_leaf=layout.is_declared) == \
        jax.tree.map(lambda leaf: leaf.names, param_layout(cfg), is_leaf=layout.is_declared)


def by_hand(names: tuple[str, ...], shape: tuple[int, ...], mesh) -> tuple:
    """RULES read by hand: each dimension, in order, split over its logical axis's mesh axis
    where that axis has several devices, divides the dimension and no earlier dimension took it."""
    table, taken, out = dict(layout.RULES), set(), []
    for name, size in zip(names, shape, strict=True):
        axis = table.get(name)
        split = axis is not None and mesh.shape[axis] > 1 and size % mesh.shape[axis] == 0 and axis not in taken
        taken |= {axis} if split else set()
        out.append(axis if split else None)
    return tuple(out)


def moment_of(path) -> tuple[str, str] | None:
    """(the optax state field, the parameter's path) of a leaf under a state's mu or nu, else None."""
    for i, key in enumerate(path):
        if getattr(key, "name", None) in ("mu", "nu"):
            return key.name, jax.tree_util.keystr(path[i + 1:])
    return None


@pytest.mark.parametrize("optimizer, normuon", [("adamw", False), ("muon", True)])
@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 8, 1), (1, 2, 4)])
def test_the_optimizer_states_pair_with_the_declarations(optimizer, normuon, shape):
    """layout.tree_shardings of an optimizer state, given its optimizer: every leaf under a state's
    mu or nu (AdamW's moments, Muon's momentum, NorMuon's statistics per neuron) is laid out as
    RULES, read by hand, lays out the parameter at its path (a statistic's reduced dimensions
    whole), every other leaf (counts, Newton–Schulz's coefficients) whole; every parameter is in
    two moments (AdamW's two, or Muon's momentum and NorMuon's statistic)."""
    from jax.sharding import AbstractMesh

    from jaxgpt.config import TrainConfig
    from jaxgpt.optim import make_optimizer

    mesh = AbstractMesh(shape, ("data", "fsdp", "tensor"))
    cfg = GPTConfig(**dict(BASE, vocab_size=66, value_embeds=((0,), (1,)), bigram_table=50))  # 66: not over 4
    declared = param_layout(cfg)
    params = jax.tree.map(lambda leaf: leaf.value, declared, is_leaf=layout.is_declared)
    tx = make_optimizer(TrainConfig(optimizer=optimizer, normuon=normuon), declared)
    state = jax.eval_shape(tx.init, params)
    where = layout.tree_shardings(state, declared, mesh, tx)
    found = {jax.tree_util.keystr(path): leaf for path, leaf in
             jax.tree_util.tree_leaves_with_path(declared, is_leaf=layout.is_declared)}
    moments = []
    for (path, leaf), at in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(where), strict=True):
        moment = moment_of(path)
        if moment is None:
            assert tuple(at.spec) == (), jax.tree_util.keystr(path)
            continue
        param = found[moment[1]]
        want = by_hand(param.names, param.value.shape, mesh)
        want = tuple(axis if n == m else None for n, m, axis in zip(leaf.shape, param.value.shape, want, strict=True))
        assert tuple(at.spec) == want, jax.tree_util.keystr(path)
        moments.append(moment[1])
    assert sorted(moments) == sorted(list(found) * 2)
    assert any(n == 1 for leaf in jax.tree.leaves(state) for n in leaf.shape) == normuon  # NorMuon's statistics
    hand = {key: by_hand(leaf.names, leaf.value.shape, mesh) for key, leaf in found.items()}
    assert {key: tuple(at.spec) for key, at in
            layout.by_path(layout.param_shardings(declared, mesh)).items()} == hand
