"""Muon: the Newton–Schulz orthogonalisation against a float64 SVD, which axes of each weight
matrix it orthogonalises over, and its state on meshes, checkpoints and a resumed run."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from muon_reference import optax_muon
from processes import finished, with_devices
from test_run import assert_trees_close, corpus, final_params, tiny_config  # noqa: F401 (corpus: a fixture)

from jaxgpt import GPT, ComputeConfig, GPTConfig
from jaxgpt.config import TrainConfig
from jaxgpt.model import param_layout
from jaxgpt.optim import make_optimizer, muon_dimension_numbers

TESTS = Path(__file__).resolve().parent
COEFFS = (3.4445, -4.7750, 2.0315)  # optax's (and modded-nanogpt's) quintic a, b, c
NS_STEPS = 5


def iterated_polynomial(s: np.ndarray, steps: int = NS_STEPS) -> np.ndarray:
    """p applied `steps` times, p(s) = a·s + b·s³ + c·s⁵, in float64: what the Newton–Schulz
    iteration X ← aX + b(XXᵀ)X + c(XXᵀ)²X does to each singular value of X."""
    a, b, c = COEFFS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


def band(lowest: float) -> tuple[float, float]:
    """min and max of p⁵ over a fine grid of [lowest, 1]: where p⁵ sends every normalised
    singular value at least `lowest`."""
    values = iterated_polynomial(np.linspace(lowest, 1.0, 200_001))
    return float(values.min()), float(values.max())


@pytest.mark.parametrize("shape", [(16, 16), (32, 8), (8, 24)])
def test_newton_schulz_pushes_singular_values_into_the_band_around_u_v_transposed(shape):
    """scale_by_muon with no momentum on one matrix G = U S Vᵀ: X₀ = G/‖G‖_F has singular values
    σᵢ/‖G‖_F ∈ (0, 1], each step maps them through p, so the update is U p⁵(S/‖G‖_F) Vᵀ.
    Its singular values equal p⁵ of G's (float64 SVD), lie in the band p⁵ promises over
    [σ_min/‖G‖_F, 1], and its cosine with U Vᵀ is at least Kantorovich's bound for values in a
    band [l, h]: Σpᵢ/(√r·√Σpᵢ²) ≥ 2√(l·h)/(l+h) (≈ 0.97 for the band [0.68, 1.13])."""
    g = np.random.default_rng(sum(shape)).normal(size=shape)
    orthogonalise = optax.contrib.scale_by_muon(ns_coeffs=COEFFS, ns_steps=NS_STEPS, beta=0.0, nesterov=False,
                                                weight_dimension_numbers={"w": optax.contrib.MuonDimensionNumbers()})
    grads = {"w": jnp.asarray(g, jnp.float32)}
    update = np.asarray(orthogonalise.update(grads, orthogonalise.init(grads))[0]["w"], np.float64)

    u, s, vt = np.linalg.svd(g, full_matrices=False)
    normalised = s / np.linalg.norm(g)
    expected = iterated_polynomial(normalised)
    got = np.linalg.svd(update, compute_uv=False)
    np.testing.assert_allclose(np.sort(got), np.sort(expected), rtol=2e-3, atol=2e-4)
    low, high = band(normalised.min())
    assert low - 1e-3 <= got.min() and got.max() <= high + 1e-3, (got, low, high)

    polar = u @ vt
    cosine = np.sum(update * polar) / (np.linalg.norm(update) * np.linalg.norm(polar))
    assert cosine >= 2 * np.sqrt(low * high) / (low + high) - 1e-3 and cosine > 0.9, (cosine, low, high)


def model_of(cfg: GPTConfig, scan_layers: bool = False) -> GPT:
    return GPT(cfg, ComputeConfig(scan_layers=scan_layers))


def numbers_by_path(model: GPT) -> dict[str, tuple | None]:
    """path → (reduction axes, output axes) for Muon's leaves of the model's params, None for AdamW's."""
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    found = muon_dimension_numbers(param_layout(model))(params)
    flat = jax.tree_util.tree_flatten_with_path(found, is_leaf=lambda x: x is None or
                                                isinstance(x, optax.contrib.MuonDimensionNumbers))[0]
    return {"/".join(k.key for k in path): None if n is None else (tuple(n.reduction_axis), tuple(n.output_axis))
            for path, n in flat}


TINY = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8, tie_embeddings=False)
NOT_MUON = ["wte/embedding", "wpe/embedding", "lm_head/kernel", "ln_f/scale", "ln_f/bias"]


def test_muon_takes_the_blocks_matrices_with_their_reduction_and_output_axes():
    """Loop layout, untied, two layers: Muon gets exactly the blocks' four kernels; c_attn
    (d, 3, H, D) reduces d and outputs (H, D), its 3 (Q, K, V) a batch axis; W_O (H, D, d)
    reduces (H, D). Embeddings, lm_head, biases and gains stay on AdamW."""
    found = numbers_by_path(model_of(GPTConfig(**TINY)))
    expected = {}
    for i in range(2):
        expected |= {f"h_{i}/attn/c_attn/kernel": ((0,), (2, 3)), f"h_{i}/attn/c_proj/kernel": ((0, 1), (2,)),
                     f"h_{i}/mlp/c_fc/kernel": ((0,), (1,)), f"h_{i}/mlp/c_proj/kernel": ((0,), (1,))}
    assert {path: n for path, n in found.items() if n is not None} == expected
    assert set(NOT_MUON) <= set(found) and all(found[path] is None for path in NOT_MUON)
    assert all(found[path] is None for path in found if path.endswith(("bias", "scale")))


def test_under_scan_layers_the_layer_axis_is_a_batch_axis():
    found = numbers_by_path(model_of(GPTConfig(**TINY, ffn_layers=2), scan_layers=True))
    assert {path: n for path, n in found.items() if n is not None} == {
        "h/attn/c_attn/kernel": ((1,), (3, 4)), "h/attn/c_proj/kernel": ((1, 2), (3,)),
        "h/mlp/c_fc/kernel": ((1,), (2,)), "h/mlp/c_fc_2/kernel": ((1,), (2,)), "h/mlp/c_proj/kernel": ((1,), (2,))}
    assert all(found[path] is None for path in NOT_MUON)


def test_grouped_query_projections_keep_k_and_v_apart():
    found = numbers_by_path(model_of(GPTConfig(**{**TINY, "n_head": 4, "n_kv_head": 2})))
    assert found["h_0/attn/q_proj/kernel"] == ((0,), (1, 2))  # (d, H, D)
    assert found["h_0/attn/kv_proj/kernel"] == ((0,), (2, 3))  # (d, 2, H_kv, D): K and V each alone
    assert found["h_0/attn/q_proj/bias"] is None and found["h_0/attn/kv_proj/bias"] is None


def test_each_layer_and_each_of_q_k_v_is_orthogonalised_on_its_own():
    """First Muon step (lr 1, no warmup, decay or clip) on a scan_layers model, gradient G: the
    Nesterov momentum is a positive multiple of G, so the update of each (layer, Q/K/V) slice
    of c_attn, a (d, H·D) = (16, 16) matrix (shape scale 1), is −p⁵ of that slice's own
    normalised singular values: a slice normalised with its neighbours would not match."""
    layers, d, heads, head_dim = 2, 16, 2, 8
    kernel = jax.random.normal(jax.random.key(3), (layers, d, 3, heads, head_dim))
    grads = {"h": {"attn": {"c_attn": {"kernel": kernel}}}}  # the leaf of a scan_layers model, at its path
    zeros = jax.tree.map(jnp.zeros_like, grads)
    train = TrainConfig(optimizer="muon", lr=1.0, warmup_steps=0, weight_decay=0.0, clip=0.0, steps=10)
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=layers, n_head=heads, d_model=d, head_dim=head_dim)
    optimizer = make_optimizer(train, param_layout(model_of(cfg, scan_layers=True)))
    updates, _ = jax.jit(lambda g, p: optimizer.update(g, optimizer.init(p), p))(grads, zeros)
    g = np.asarray(grads["h"]["attn"]["c_attn"]["kernel"], np.float64)  # (L, d, 3, H, D)
    u = np.asarray(updates["h"]["attn"]["c_attn"]["kernel"], np.float64)
    for layer in range(layers):
        for which in range(3):
            slice_of = lambda a: a[layer, :, which].reshape(d, -1)  # noqa: E731, B023
            s = np.linalg.svd(slice_of(g), compute_uv=False)
            expected = np.sort(iterated_polynomial(s / np.linalg.norm(s)))
            got = np.sort(np.linalg.svd(-slice_of(u), compute_uv=False))
            np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-4)


MESHES = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[2])
import jax, numpy as np
import sharded_training as st
from jaxgpt import sharding
from jaxgpt.checkpoint import Checkpoints
from jaxgpt.model import param_layout
from jaxgpt.optim import make_optimizer
from jaxgpt.train.step import abstract_state

train = dataclasses.replace(st.TRAIN, optimizer="muon", schedule="wsd", embed_lr=0.01, scalar_lr=0.002,
                            muon_coeffs="polar_express", normuon=True, cautious_weight_decay=True)
# the modern recipe's model switches with it (configs/speedrun_*.py)
cfg = dataclasses.replace(st.CFG, qk_norm=True, activation="relu2", logit_softcap=3.0, zero_init_out=True,
                          tie_embeddings=False, positions="rope", norm="rmsnorm", bias=False,
                          value_embeds=((0,), (1,)), bigram_table=32)
ref_losses, ref_params, _, _ = st.run(None, train, cfg)
losses, params, sharded_leaves, state = st.run((2, 2, 2), train, cfg)
pairs = zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
out = {"param_diff": max(float(np.abs(a - b).max()) for a, b in pairs), "sharded_leaves": sharded_leaves,
       "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))}
momentum = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
            if "'muon'" in jax.tree_util.keystr(path) and leaf.ndim >= 2]
out["sharded_momentum"] = sum(not leaf.sharding.is_fully_replicated for leaf in momentum)
neurons = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
           if "'muon'" in jax.tree_util.keystr(path) and ".nu[" in jax.tree_util.keystr(path)]
out["sharded_neurons"] = sum(not leaf.sharding.is_fully_replicated for leaf in neurons)
tables = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
          if "value_embeds" in jax.tree_util.keystr(path) and leaf.ndim == 3]
out["value_tables"] = [str(leaf.sharding.spec) for leaf in tables]
checkpoints = Checkpoints(sys.argv[1], async_save=False)
checkpoints.save(3, state.to_dict())
saved = jax.device_get(state.to_dict())
optimizer, restored_onto = make_optimizer(train, param_layout(cfg)), []
for shape, devices in (((8, 1, 1), None), ((1, 1, 1), jax.devices()[:1])):
    mesh = sharding.make_mesh(dict(zip(sharding.AXES, shape)), devices)
    abstract = abstract_state(cfg, optimizer, mesh).to_dict()
    restored, step = checkpoints.restore(abstract)
    for got, want, target in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), jax.tree.leaves(abstract)):
        assert got.sharding == target.sharding and np.array_equal(np.asarray(got), want)
    restored_onto.append(str(shape))
checkpoints.close()
out["restored_onto"] = restored_onto
print(json.dumps(out))
"""


def test_muon_on_a_mesh_equals_one_device_and_its_state_restores_onto_other_meshes(tmp_path):
    """On 8 CPU devices: three Muon steps (wsd, groups at their own rates; Polar Express, NorMuon,
    cautious weight decay) of the recipe's model with value embeddings and a bigram table, on the
    (2, 2, 2) mesh give the single device's losses and parameters; the state, its momentum and
    NorMuon's statistics per neuron sharded with their parameters, checkpoints and restores bit
    for bit onto (8, 1, 1) and one device."""
    out = json.loads(finished(with_devices(MESHES, tmp_path / "run", TESTS), timeout=300))
    assert out["loss_diff"] < 1e-5 and out["param_diff"] < 1e-5, out
    assert out["sharded_leaves"] > 0 and out["sharded_momentum"] > 0 and out["sharded_neurons"] > 0, out
    # the value-embedding tables split as declared (rows over tensor, each head's width over fsdp),
    # gathered whole where they are looked up (jaxgpt.axes.whole)
    assert out["value_tables"] == ["P('tensor', None, 'fsdp')"] * 2, out
    assert out["restored_onto"] == ["(8, 1, 1)", "(1, 1, 1)"]


def test_muon_with_wsd_resumed_equals_uninterrupted(tmp_path, corpus):  # noqa: F811
    """Muon with its switches (Polar Express, NorMuon, cautious weight decay) and a batch-size
    schedule of 8 rows a step (two micro-batches) before step 4, then 4: a run stopped at step 3
    and resumed ends where an uninterrupted one does, and both saw 8·4 + 4·2 rows."""
    from jaxgpt.train.run import train

    muon = {"train.optimizer": "muon", "train.schedule": "wsd", "train.lr": 0.02, "train.embed_lr": 0.01,
            "train.cooldown_fraction": 0.75, "train.muon_coeffs": "polar_express", "train.normuon": True,
            "train.cautious_weight_decay": True, "train.batch_schedule": ((4, 8),),
            # and the recipe's model switches (configs/speedrun_*.py)
            "model.qk_norm": True, "model.activation": "relu2", "model.logit_softcap": 3.0,
            "model.zero_init_out": True, "model.tie_embeddings": False, "model.positions": "rope",
            "model.norm": "rmsnorm"}
    first = train(tiny_config(tmp_path, corpus, "split", **muon, **{"train.steps": 3}))
    assert first["step"] == 3
    resumed = train(tiny_config(tmp_path, corpus, "split", **muon, **{"train.steps": 6}))
    whole = train(tiny_config(tmp_path, corpus, "whole", **muon, **{"train.steps": 6}))
    assert resumed["step"] == whole["step"] == 6
    assert_trees_close(final_params(tmp_path / "split"), final_params(tmp_path / "whole"), atol=1e-6)
    assert resumed["val_loss"] == pytest.approx(whole["val_loss"], abs=1e-6)
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    seen = {r["step"]: r["tokens_seen"] for r in records if "tokens_seen" in r}
    assert seen[6] == (8 * 4 + 4 * 2) * 16 and seen[1] == 8 * 16  # rows × block_size


# --- banks: the same updates as optax.contrib.muon, each device its own share ------------------

BANKS = """
import json, re, sys
import jax, jax.numpy as jnp, numpy as np, optax
from jaxgpt import GPT, ComputeConfig, GPTConfig, layout, sharding
from jaxgpt.config import TrainConfig
from jaxgpt.model import param_layout
from jaxgpt.optim import make_optimizer
sys.path.insert(0, sys.argv[1])
from muon_reference import optax_muon

# 4 layers of d = 32: a bank of 16 (32, 32) matrices (Q, K, V, W_O) and one of 8 (32, 128) (W_in, W_outᵀ)
cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=4, d_model=32)
train = TrainConfig(optimizer="muon", lr=0.05, warmup_steps=0, weight_decay=0.1, clip=0.0, steps=10)
out = {"diff": {}, "whole_bank_dots": {}, "share_dots": {}}
for scan in (False, True):
    gpt = GPT(cfg, ComputeConfig(scan_layers=scan))
    declared = param_layout(gpt)
    params = gpt.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    grads = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(i), p.shape), params) for i in (1, 2)]
    reference, ours = optax_muon(train, declared), make_optimizer(train, declared)
    assert jax.tree.structure(reference.init(params)) == jax.tree.structure(ours.init(params))
    state, expected = reference.init(params), []
    for g in grads:
        update, state = jax.jit(reference.update)(g, state, params)
        expected.append(update)
    for shape in ((1, 1, 1), (8, 1, 1), (1, 8, 1)):
        mesh = sharding.make_mesh(dict(zip(sharding.AXES, shape)), jax.devices()[:int(np.prod(shape))])
        at = layout.param_shardings(declared, mesh)
        state = jax.device_put(ours.init(params), layout.tree_shardings(ours.init(params), declared, mesh, ours))
        placed = jax.device_put(params, at)
        with jax.set_mesh(mesh):
            step = jax.jit(ours.update).lower(placed, state, placed).compile()
        diff = 0.0
        for g, want in zip(grads, expected):
            update, state = step(jax.device_put(g, at), state, placed)
            diff = max(diff, max(float(np.abs(np.asarray(a) - b).max())
                                 for a, b in zip(jax.tree.leaves(update), jax.device_get(jax.tree.leaves(want)))))
        hlo = step.as_text()
        out["diff"][f"{scan} {shape}"] = diff
        found = re.findall(r"= f32\\[([\\d,]+)\\]\\{[^}]*\\} dot\\(", hlo)
        dots = [tuple(int(n) for n in dims.split(",")) for dims in found]
        whole = [dims for dims in dots if dims in ((16, 32, 32), (8, 32, 128), (8, 32, 32))]
        out["whole_bank_dots"][f"{scan} {shape}"] = len(whole)
        shares = [dims for dims in dots if dims in ((2, 32, 32), (32, 32), (32, 128))]
        out["share_dots"][f"{scan} {shape}"] = len(shares)
print(json.dumps(out))
"""


def test_banked_updates_equal_optax_muon_and_each_device_orthogonalises_its_share(tmp_path):
    """Two Muon updates (momentum, Nesterov, weight decay; lr 0.05, the GPT-2 recipe's) of a
    4-layer model, per layer and scanned, on one device and on 8 CPU devices split by data and
    by fsdp, equal optax.contrib.muon's for every parameter to 1e-6, and the state is laid out
    as optax's. (What remains is float32 rounding, which the iteration amplifies: about 3e-6 of
    the largest entry of a direction, as between optax's own batched and single-matrix paths.)

    The compiled program of each mesh of 8 holds no Newton–Schulz product of a whole bank (16
    (32, 32) or 8 (32, 128) matrices, or the 8 (32, 32) of a layer split a bank would not make),
    only the per-device shares: 2 (32, 32) and 1 (32, 128)."""
    out = json.loads(finished(with_devices(BANKS, TESTS, devices=8), timeout=600))
    assert max(out["diff"].values()) < 1e-6, out["diff"]
    for mesh, count in out["whole_bank_dots"].items():
        if "(1, 1, 1)" in mesh:
            assert count > 0, out  # one device: the banks' own batched products
        else:
            assert count == 0 and out["share_dots"][mesh] > 0, (mesh, out)


def test_a_state_written_by_optax_muon_resumes_on_the_banks(tmp_path):
    """A checkpoint of the state optax.contrib.muon made (two steps, as jaxgpt saved it before
    its banks) restores into the banked optimizer's state, and the next update from it equals
    optax's own next update (lr 0.05) to 1e-6."""
    from jaxgpt import sharding
    from jaxgpt.checkpoint import Checkpoints
    from jaxgpt.train.step import TrainState, abstract_state, init_state

    cfg = GPTConfig(**TINY)
    train = TrainConfig(optimizer="muon", lr=0.05, warmup_steps=0, weight_decay=0.1, clip=1.0, steps=10)
    declared, reference = param_layout(cfg), optax_muon(train, param_layout(cfg))
    state, reference_update = init_state(cfg, reference, 0), jax.jit(reference.update)  # one program for all three
    grads = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(i), p.shape), state.params) for i in range(3)]
    for g in grads[:2]:
        _, opt_state = reference_update(g, state.opt_state, state.params)
        state = TrainState(step=state.step + 1, params=state.params, opt_state=opt_state)
    checkpoints = Checkpoints(tmp_path / "ckpt", async_save=False)
    checkpoints.save(2, state.to_dict())
    ours = make_optimizer(train, declared)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    restored, step = checkpoints.restore(abstract_state(cfg, ours, mesh).to_dict())
    checkpoints.close()
    assert step == 2
    got, _ = jax.jit(ours.update)(grads[2], restored["opt_state"], restored["params"])
    want, _ = reference_update(grads[2], state.opt_state, state.params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
