"""Value embeddings and U-net skips (jaxgpt.stack): the model against a float64 NumPy forward written
from the equations, the scanned layout against the loop, decoding with the cache against the forward
pass, packed rows against each example alone, the params' declarations and count, their layouts (and
Muon's state) converted, a records run resumed, the GPT-2 export's refusal, and bad settings in one line."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from test_model import RECIPE, decode_step_by_step, forward, random_params, tiny, tokens
from test_packed import packed_row

from jaxgpt import GPT, ComputeConfig, GPTConfig, layout, ops, stack
from jaxgpt.blocks import layers_as, stack_layers, unstack_layers
from jaxgpt.config import TrainConfig
from jaxgpt.model import flops_per_token, param_count, param_layout
from jaxgpt.optim import make_optimizer

CASES = {  # value embeddings alone (GQA, a table shared by two layers), skips alone (L even and odd), both
    "value_embeds": {"n_layer": 3, "n_head": 4, "n_kv_head": 2, "value_embeds": ((0, -1), 1)},
    "value_embeds,head_dim": {"value_embeds": (1,), "head_dim": 6, "positions": "rope"},
    "unet,L=4": {"n_layer": 4, "unet_skips": True},
    "unet,L=3": {"n_layer": 3, "unet_skips": True, "norm": "rmsnorm", "bias": False},
    "both,recipe": {**RECIPE, "n_layer": 4, "n_head": 4, "n_kv_head": 2, "value_embeds": ((0, 2), (1, 3)),
                    "unet_skips": True},
}
BOTH = tiny(**CASES["both,recipe"])


def reference_forward(cfg, params, x):
    """logits in float64 for pre-norm blocks with value embeddings and U-net skips, written from
    the equations: block ℓ's values V_ℓ = X W_V + λ_ℓ VE_{k(ℓ)}[x], and block L−1−i's input
    X + w_i Z_i (Z_i the output of block i, i < ⌊L/2⌋)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    B, T = x.shape
    L, H, g = cfg.n_layer, cfg.n_head, cfg.n_head // cfg.n_kv_head
    table_of = {layer % L: k for k, layers in enumerate(cfg.value_embeds) for layer in layers}
    positions = np.tile(np.arange(T), (B, 1))

    def norm(h, q):
        if cfg.norm == "layernorm":
            return ref.layer_norm(h, q["scale"], q.get("bias"), cfg.norm_eps)
        return ref.rms_norm(h, q["scale"], cfg.norm_eps)

    def bias(q):
        return q.get("bias", np.zeros(1))

    def dense(h, q):
        return np.tensordot(h, q["kernel"], axes=1) + bias(q)

    def mha(h, q, layer):
        if "c_attn" in q:
            qh, kh, vh = np.einsum("btd,dchk->cbthk", h, q["c_attn"]["kernel"]) + bias(q["c_attn"])[:, None, None]
        else:
            qh = np.einsum("btd,dhk->bthk", h, q["q_proj"]["kernel"]) + bias(q["q_proj"])
            kh, vh = np.einsum("btd,dchk->cbthk", h, q["kv_proj"]["kernel"]) + bias(q["kv_proj"])[:, None, None]
        if layer in table_of:  # V ← V + λ VE[x]
            ve = p["value_embeds"]
            vh = vh + ve[f"gate_{layer}"] * ve[f"table_{table_of[layer]}"][x]
        kh, vh = (np.stack([a[:, :, h // g] for h in range(H)], axis=2) for a in (kh, vh))
        if cfg.qk_norm:
            qh, kh = ref.rms_norm(qh, q["q_norm"]["scale"], cfg.norm_eps), ref.rms_norm(kh, q["k_norm"]["scale"],
                                                                                      cfg.norm_eps)
        if cfg.positions == "rope":
            qh, kh = ref.rope(qh, positions, cfg.rope_base), ref.rope(kh, positions, cfg.rope_base)
        ctx = ref.attention(qh, kh, vh, np.tril(np.ones((T, T), bool)))
        return np.einsum("bthk,hkd->btd", ctx, q["c_proj"]["kernel"]) + bias(q["c_proj"])

    h = p["wte"]["embedding"][x] + (p["wpe"]["embedding"][:T] if cfg.positions == "learned" else 0)
    outputs = []
    for layer in range(L):
        source = L - 1 - layer
        if cfg.unet_skips and source < min(layer, L // 2):  # X_{L−1−i} ← X_{L−1−i} + w_i Z_i
            h = h + p["unet"][f"w_{source}"] * outputs[source]
        q = p[f"h_{layer}"]
        y = h + mha(norm(h, q["ln_1"]), q["attn"], layer)
        h = y + dense(ref.activation(cfg.activation, dense(norm(y, q["ln_2"]), q["mlp"]["c_fc"])), q["mlp"]["c_proj"])
        outputs.append(h)
    h = norm(h, p["ln_f"])
    logits = h @ (p["wte"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]["kernel"])
    return logits if cfg.logit_softcap is None else cfg.logit_softcap * np.tanh(logits / cfg.logit_softcap)


@pytest.mark.parametrize("changes", CASES.values(), ids=CASES.keys())
def test_value_embeddings_and_unet_skips_match_the_float64_reference(changes):
    cfg = tiny(**changes)
    params = random_params(cfg)
    x = tokens(cfg, 2, 9)
    want = reference_forward(cfg, jax.device_get(params), np.asarray(x))
    np.testing.assert_allclose(forward(cfg, params, x), want, atol=2e-5, rtol=1e-4)
    plain = cfg.replace(value_embeds=(), unet_skips=False)  # the same params without the paths: other logits
    assert np.abs(reference_forward(plain, jax.device_get(params), np.asarray(x)) - want).max() > 1e-3


def test_scanned_layers_compute_the_loop_and_decode_equals_the_forward_pass():
    cfg, scan = BOTH, ComputeConfig(scan_layers=True)
    params = random_params(cfg)
    stacked = layers_as(params, True)
    assert set(stacked) >= {"h", "value_embeds", "unet"} and not any(key.startswith("h_") for key in stacked)
    x = tokens(cfg, 2, 9)  # the reference test's: its compiled forward pass
    whole = forward(cfg, params, x)  # the loop's logits, which each layout's decoding must give

    def loss(compute, p):
        return ops.cross_entropy(GPT(cfg, compute).apply({"params": p}, x[:, :-1]), x[:, 1:])

    grad = lambda compute, p: jax.jit(jax.value_and_grad(lambda q: loss(compute, q)))(p)  # noqa: E731
    (loop_loss, loop_grads), (scan_loss, scan_grads) = grad(ComputeConfig(remat=True), params), grad(scan, stacked)
    np.testing.assert_allclose(scan_loss, loop_loss, atol=1e-6, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6), unstack_layers(scan_grads),
                 loop_grads)
    assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(loop_grads["value_embeds"]))
    for compute, p in ((ComputeConfig(), params), (scan, stacked)):
        np.testing.assert_allclose(decode_step_by_step(cfg, p, x, 4, cfg.block_size, compute=compute), whole,
                                   atol=1e-5, rtol=1e-5)


def test_packed_rows_equal_each_example_alone():
    """Each example of a packed row has the logits the float64 reference gives it alone."""
    cfg = GPTConfig(vocab_size=19, block_size=20, n_layer=3, n_head=2, d_model=16, value_embeds=((0, 2),),
                    unet_skips=True)
    params = random_params(cfg)
    (x, pos, seg), examples = packed_row((5, 9, 4), cfg.block_size, np.random.default_rng(1))
    packed = jax.jit(lambda p: GPT(cfg).apply({"params": p}, x, positions=pos, segments=seg))(params)
    start = 0
    for example in examples:
        alone = reference_forward(cfg, jax.device_get(params), np.asarray(example)[None])
        np.testing.assert_allclose(packed[0, start:start + len(example)], alone[0], atol=2e-5, rtol=1e-4)
        start += len(example)


def test_params_are_declared_counted_and_convert_between_layouts():
    cfg = BOTH
    declared = param_layout(cfg)
    tables, gates = declared["value_embeds"], declared["value_embeds"]
    for k in (0, 1):
        table = tables[f"table_{k}"]
        assert (table.names, table.group, table.value.shape) == (("vocab", "kv_heads", "value_dim"), "embed",
                                                                 (23, 2, 4))
    scalars = [gates[f"gate_{layer}"] for layer in range(4)] + [declared["unet"][f"w_{i}"] for i in (0, 1)]
    assert all((leaf.names, leaf.group, leaf.value.shape) == ((), "scalar", ()) for leaf in scalars)
    assert layout.groups(declared)["h_0"]["attn"]["q_proj"]["kernel"] == "matrix"

    plain = cfg.replace(value_embeds=(), unet_skips=False)
    assert param_count(cfg) - param_count(plain) == 2 * 23 * 2 * 4 + 4 + 2  # two tables, four gates, two weights
    # tied: the tables are lookups, never counted as the unembedding's FLOPs; the scalars count as 6 each
    tied = cfg.replace(tie_embeddings=True)
    assert flops_per_token(tied, 16) == flops_per_token(tied.replace(value_embeds=(), unet_skips=False), 16) + 6 * 6

    values = stack.UNet(4, jnp.float32).init(jax.random.key(0))["params"]  # the scalars' first values
    values |= stack.ValueEmbeds(cfg, ComputeConfig(), jax.nn.initializers.zeros).init(
        jax.random.key(0), jnp.zeros((1, 2), jnp.int32))["params"]
    values = nn.meta.unbox(values)
    assert {name: float(v) for name, v in values.items() if v.ndim == 0} == {
        "w_0": 1.0, "w_1": 1.0, "gate_0": 0.5, "gate_1": 0.5, "gate_2": 0.5, "gate_3": 0.5}
    scan = ComputeConfig(scan_layers=True)
    scanned = jax.eval_shape(lambda: GPT(cfg, scan).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    params = random_params(cfg)
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
    assert shapes(scanned) == shapes(jax.eval_shape(lambda: stack_layers(params)))
    # Muon's state (its AdamW part holds masked copies of the blocks) converts between the layouts too
    train = TrainConfig(optimizer="muon")
    loop_state = jax.eval_shape(make_optimizer(train, declared).init, params)
    scan_state = jax.eval_shape(make_optimizer(train, param_layout(GPT(cfg, scan))).init, scanned)
    assert shapes(jax.eval_shape(lambda state: layers_as(state, False), scan_state)) == shapes(loop_state)
    assert shapes(jax.eval_shape(lambda state: layers_as(state, True), loop_state)) == shapes(scan_state)


@pytest.mark.parametrize("changes, message", [
    ({"value_embeds": ((0, 5),)}, r"value_embeds=\(\(0, 5\),\): layer 5 does not exist \(n_layer=2"),
    ({"value_embeds": ((0,), (-2,))}, r"layer 0 is listed twice; each layer adds at most one table"),
    ({"value_embeds": "0,1"}, r"value_embeds='0,1': must be a tuple of tables"),
    ({"value_embeds": ((0.5,),)}, r"each entry is a table, the layer indices that add it"),
    ({"value_embeds": ((),)}, r"each entry is a table"),
    ({"unet_skips": True, "n_layer": 1}, r"unet_skips=True with n_layer=1: .* needs n_layer ≥ 2"),
    ({"unet_skips": "yes"}, r"unet_skips='yes': must be True or False"),
])
def test_bad_settings_are_refused_in_one_line(changes, message):
    with pytest.raises(ValueError, match=message) as error:
        tiny(**changes)
    assert "\n" not in str(error.value)


def test_a_saved_configs_lists_read_as_tuples_and_gpt2_export_refuses_in_one_line():
    from jaxgpt.convert import config_to_hf

    cfg = GPTConfig.from_dict({**BOTH.to_dict(), "value_embeds": [[0, 2], [1, 3]]})
    assert cfg == BOTH and hash(cfg) == hash(BOTH)
    with pytest.raises(ValueError, match=r"cannot be written as GPT-2: .*value_embeds=\(\(0, 2\), \(1, 3\)\): .*"
                                         r"unet_skips=True") as error:
        config_to_hf(cfg)
    assert "\n" not in str(error.value)


def test_a_records_run_resumes_exactly(tmp_path):
    """Packed records, trained with Muon (and AdamW for the tables and scalars), resumed."""
    from test_records import records_run_config

    from jaxgpt.train.run import train
    from jaxgpt.train.rundir import load_run

    model = {"model.n_layer": 2, "model.value_embeds": ((0, -1),), "model.unet_skips": True, "train.optimizer": "muon"}
    first = train(records_run_config(tmp_path, "split", **model, **{"train.steps": 3}))
    resumed = train(records_run_config(tmp_path, "split", **model))
    whole = train(records_run_config(tmp_path, "whole", **model))
    assert first["step"] == 3 and resumed["step"] == whole["step"] == 6
    split, whole_params = load_run(tmp_path / "split", step=6)[0], load_run(tmp_path / "whole", step=6)[0]
    assert set(split["value_embeds"]) == {"table_0", "gate_0", "gate_1"} and set(split["unet"]) == {"w_0"}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0), split, whole_params)
    assert resumed["val_loss"] == pytest.approx(whole["val_loss"], abs=1e-6)
