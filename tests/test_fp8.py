"""FP8 matmuls (compute.fp8; jaxgpt.platforms.forms.fp8_matmul): the product and its gradients against
a float64 NumPy evaluation of their formulas (FP8 rounding by ml_dtypes) and against the float product
within bounds derived from e4m3's and e5m2's precision; a train step and 50 steps of a tiny model
against bf16 compute; the refusals, one line each; and the program compiled for an H100 without a
GPU (the gpu extra), in which every matmul compute.fp8 names is a GEMM of FP8 operands.

The bounds. Rounding to a format of m mantissa bits moves a value v whose scaled magnitude |v/s| is at
least the smallest normal 2^e_min by at most half a step: 2^−(m+1)|v| (e4m3: m = 3, 2⁻⁴; e5m2: m = 2,
2⁻³). Below it the step is the subnormal one, 2^(e_min−m), so the move is at most 2^(e_min−m−1)·s
(e4m3: e_min = −6, 2⁻¹⁰·s; e5m2: e_min = −14, 2⁻¹⁷·s). Hence |δv| ≤ 2^−(m+1)|v| + 2^(e_min−m−1)·s for
every element, and for a product Σ_k a_k b_k of rounded â, b̂:
    |Σ â_k b̂_k − Σ a_k b_k| ≤ Σ_k |δa_k||b_k| + |a_k||δb_k| + |δa_k||δb_k|.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_compile_gpu import extra_installed

from jaxgpt import GPT, ComputeConfig, GPTConfig
from jaxgpt.compile import gpus
from jaxgpt.config import TrainConfig, default_config
from jaxgpt.errors import ConfigError
from jaxgpt.model import param_layout
from jaxgpt.optim import learning_rate_schedule, make_optimizer
from jaxgpt.platforms import forms
from jaxgpt.registries import open_compute
from jaxgpt.train.opening import compute_config
from jaxgpt.train.step import init_state, loss_fn, make_train_step

ROOT = Path(__file__).resolve().parent.parent
U32 = 2.0**-24  # float32's unit roundoff
# (format, largest finite value, half-step relative to a normal value, half the subnormal step (× s))
E4M3 = (ml_dtypes.float8_e4m3fn, 448.0, 2.0**-4, 2.0**-10)
E5M2 = (ml_dtypes.float8_e5m2, 57344.0, 2.0**-3, 2.0**-17)


# --- the formulas in float64 -------------------------------------------------------------------


def quantized(a, fmt):
    """(â = a_q·s in float64, s, the bound on |â − a| elementwise): current scaling s = max|a| / F
    (float32, as the product computes it), a_q = a/s rounded to the format by ml_dtypes."""
    dtype, largest, relative, subnormal = fmt
    a32 = np.asarray(a, np.float32)
    s = np.float32(np.abs(a32).max()) / np.float32(largest)
    s = s if s > 0 else np.float32(1)
    a_q = (a32 / s).astype(dtype)
    return a_q.astype(np.float64) * np.float64(s), s, relative * np.abs(a32) + subnormal * np.float64(s)


def product_bound(a, da, b, db):
    """The bound on |â b̂ − a b| of the module docstring, for matrices a (N, n), b (n, m)."""
    a, b = np.abs(a), np.abs(b)
    return da @ b + a @ db + da @ db


def accumulation(a_hat, b_hat, n):
    """float32 accumulation's bound on n products of FP8 values (each exact in float32), the output's rounding
    and the scales' last bits: (n + 4)·u·Σ|â_k b̂_k|."""
    return (n + 4) * U32 * (np.abs(a_hat) @ np.abs(b_hat))


# --- the product and its gradient ---------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 6, 32), (40, 48)])
def test_the_fp8_product_is_the_formula_and_within_e4m3s_precision_of_x_w(rng, shape):
    """y = (x_q s_x)(W_q s_W): against the formula in float64 within float32 accumulation, and against
    x W within the e4m3 bound (2⁻⁴ relative per element, 2⁻¹⁰·s below the normal range)."""
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape))  # magnitudes over e4m3's range
    w = rng.standard_normal((shape[-1], 24)) * 0.1
    got = np.asarray(forms.linear(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), "fp8"), np.float64)
    rows, x2 = got.reshape(-1, 24), np.asarray(x, np.float32).reshape(-1, shape[-1]).astype(np.float64)
    (x_hat, _, dx), (w_hat, _, dw) = quantized(x2, E4M3), quantized(w, E4M3)
    want = x_hat @ w_hat
    assert np.all(np.abs(rows - want) <= accumulation(x_hat, w_hat, shape[-1]))
    plain = x2 @ np.asarray(w, np.float32)
    error, bound = np.abs(rows - plain), product_bound(x2, dx, np.asarray(w, np.float32), dw)
    assert np.all(error <= bound + accumulation(x_hat, w_hat, shape[-1]))
    assert error.max() > 1e-3 * np.abs(plain).max()  # it is FP8's product, not the float one


def test_an_all_zero_operand_gives_zeros_and_zero_gradients():
    """max|x| = 0 takes the scale 1 (no division by zero): y = 0, ∂L/∂W = xᵀ dY = 0, and ∂L/∂x = dY Wᵀ = 4
    for dY and W of ones (4 outputs), to the last bits of the two scales' product."""
    x, w = jnp.zeros((16, 8)), jnp.ones((8, 4))
    y, vjp = jax.vjp(forms.fp8_matmul, x, w)
    dx, dw = vjp(jnp.ones_like(y))
    assert not np.any(np.asarray(y)) and not np.any(np.asarray(dw))
    np.testing.assert_allclose(np.asarray(dx), 4.0, rtol=4 * U32)


def test_the_fp8_gradients_are_the_formula_with_the_gradient_in_e5m2(rng):
    """∂L/∂x = (dY_q s_dY)(W_q s_W)ᵀ and ∂L/∂W = (x_q s_x)ᵀ(dY_q s_dY), dY rounded to e5m2 with
    s_dY = max|dY|/57344: against the formulas in float64 within float32 accumulation, and against the
    float gradients dY Wᵀ, xᵀ dY within the bounds of e5m2 (2⁻³) times e4m3 (2⁻⁴)."""
    x, w = rng.standard_normal((48, 32)), rng.standard_normal((32, 16)) * 0.1
    g = rng.standard_normal((48, 16)) * np.exp(rng.uniform(-4, 4, (48, 16)))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    y, vjp = jax.vjp(lambda x, w: forms.linear(x, w, "fp8"), f32(x), f32(w))
    dx, dw = (np.asarray(d, np.float64) for d in vjp(f32(g)))
    x, w, g = (np.asarray(a, np.float32).astype(np.float64) for a in (x, w, g))
    (x_hat, _, ex), (w_hat, _, ew), (g_hat, _, eg) = quantized(x, E4M3), quantized(w, E4M3), quantized(g, E5M2)
    assert np.all(np.abs(dx - g_hat @ w_hat.T) <= accumulation(g_hat, w_hat.T, 16))
    assert np.all(np.abs(dw - x_hat.T @ g_hat) <= accumulation(x_hat.T, g_hat, 48))
    assert np.all(np.abs(dx - g @ w.T) <= product_bound(g, eg, w.T, ew.T) + accumulation(g_hat, w_hat.T, 16))
    assert np.all(np.abs(dw - x.T @ g) <= product_bound(x.T, ex.T, g, eg) + accumulation(x_hat.T, g_hat, 48))


# --- a tiny model's training --------------------------------------------------------------------

CFG = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, d_model=64)
TRAIN = TrainConfig(lr=3e-3, min_lr=1e-4, warmup_steps=5, steps=50, b1=0.9, b2=0.99, weight_decay=0.1, clip=1.0)
BF16 = ComputeConfig(dtype="bfloat16")
FP8 = BF16.replace(fp8="mlp,unembed")


def batch(i: int):
    """8 rows of arithmetic sequences mod 64 (a start and a stride of 1–3): learnable in a few steps."""
    r = np.random.default_rng(i)
    tokens = (r.integers(0, 64, (8, 1)) + r.integers(1, 4, (8, 1)) * np.arange(CFG.block_size + 1)) % 64
    return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_a_train_step_with_fp8_mlp_and_unembedding_is_the_bf16_step_within_fp8s_rounding():
    """The same step (make_train_step, and its loss's gradients) with compute.fp8='mlp,unembed' against
    bf16 compute.
    The loss: a token's cross-entropy moves by at most 2·max_v |Δz_v| (its gradient in the logits,
    softmax − one-hot, sums to at most 2 in absolute value), so the mean loss by at most the mean of
    that bound; and each logit, a product of two e4m3-rounded operands (≤ 2⁻⁴ each), moves by at most
    2⁻³ of the logits' largest magnitude.
    The gradients: each term of the backward's sums carries the e5m2 rounding of dY (≤ 2⁻³) and the
    e4m3 rounding of x or W (≤ 2⁻⁴): (1 + 2⁻³)(1 + 2⁻⁴) − 1 < 0.2 relative, which bounds each
    gradient's relative error where its terms do not cancel; every gradient is held to 0.2 (in norm).
    The FP8 path is shown in use: its MLP gradients differ from bf16's by more than bf16's rounding."""
    optimizer = make_optimizer(TRAIN, param_layout(CFG))
    state, schedule, (x, y) = init_state(CFG, optimizer, jax.random.key(0)), learning_rate_schedule(TRAIN), batch(0)
    results = {}
    for name, compute in (("float32", ComputeConfig()), ("bf16", BF16), ("fp8", FP8)):
        model = GPT(CFG, compute)
        _, metrics = jax.jit(make_train_step(model, optimizer, schedule))(state, (x, y), jax.random.key(1))
        grads = jax.jit(jax.grad(lambda p, m=model: loss_fn(m, p, x, y)))(state.params)
        logits = np.asarray(jax.jit(lambda p, m=model: m.apply({"params": p}, x))(state.params), np.float64)
        results[name] = float(metrics["loss"]), float(metrics["grad_norm"]), grads, logits
    (fp8_loss, fp8_norm, fp8_grads, fp8_z), (bf16_loss, bf16_norm, bf16_grads, bf16_z) = results["fp8"], results["bf16"]
    moved = np.abs(fp8_z - bf16_z).max(axis=-1)  # each token's max |Δz|
    assert moved.max() <= 2**-3 * np.abs(bf16_z).max()
    assert abs(fp8_loss - bf16_loss) <= 2 * moved.mean() and fp8_loss != bf16_loss
    assert fp8_norm == pytest.approx(bf16_norm, rel=0.2)
    errors = jax.tree.map(relative, fp8_grads, bf16_grads)
    assert max(jax.tree.leaves(errors)) < 0.2, errors
    bf16_rounding = jax.tree.map(relative, bf16_grads, results["float32"][2])
    mlp = [errors["h_0"]["mlp"][layer]["kernel"] for layer in ("c_fc", "c_proj")]
    assert min(mlp) > 2 * max(bf16_rounding["h_0"]["mlp"][layer]["kernel"] for layer in ("c_fc", "c_proj"))


def test_fifty_steps_with_fp8_reach_bf16s_loss_within_two_percent():
    """A tiny model trained 50 steps with compute.fp8='mlp,unembed' and with bf16 compute from the same
    start on the same batches: the mean loss of the last 5 steps within 2% of bf16's (FP8's rounding
    is unbiased, so it slows training little), and far below the first (ln 64 ≈ 4.16)."""
    optimizer, schedule = make_optimizer(TRAIN, param_layout(CFG)), learning_rate_schedule(TRAIN)
    start, finals = init_state(CFG, optimizer, jax.random.key(0)), {}
    for name, compute in (("bf16", BF16), ("fp8", FP8)):
        step, state, losses = jax.jit(make_train_step(GPT(CFG, compute), optimizer, schedule)), start, []
        for i in range(50):
            state, metrics = step(state, batch(i + 1), jax.random.key(i))
            losses.append(float(metrics["loss"]))
        finals[name] = float(np.mean(losses[-5:]))
        assert finals[name] < 0.6 * losses[0], (name, losses[0], losses[-5:])
    assert finals["fp8"] == pytest.approx(finals["bf16"], rel=0.02)


# --- refusals ----------------------------------------------------------------------------------


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_an_unknown_matmul_name_is_refused_naming_the_ones_that_exist():
    with pytest.raises(ValueError) as error:
        ComputeConfig(fp8="mlp,ffn")
    message = one_line(error)
    assert "'ffn'" in message and "mlp, attention, unembed" in message


def test_fp8_with_int8_weights_is_refused():
    with pytest.raises(ValueError) as error:
        open_compute({"fp8": "mlp", "weights": "int8"})
    assert "weights='int8'" in one_line(error) and "compute.fp8=''" in one_line(error)


def fp8_config(names: str = "mlp,unembed"):
    config = default_config()
    config.compute.fp8 = names
    return config


@pytest.mark.parametrize("platform,capability", [("cpu", None), ("tpu", None), ("gpu", (8, 0)), ("gpu", (8, 6))])
def test_fp8_is_refused_where_there_are_no_fp8_gemms(platform, capability):
    with pytest.raises(ConfigError) as error:
        compute_config(fp8_config(), platform, capability)
    message = one_line(error)
    assert message.startswith("compute.fp8='mlp,unembed' needs FP8 matrix units (an NVIDIA GPU of compute capability")
    assert f"on {platform} drop compute.fp8" in message if platform != "gpu" else "capability 8." in message


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_fp8_is_allowed_on_ada_hopper_and_later(capability):
    assert compute_config(fp8_config(), "gpu", capability).fp8_matmuls == ("mlp", "unembed")
    assert compute_config(fp8_config(""), "cpu").fp8_matmuls == ()


def fp8_dots(jaxpr) -> int:
    """The dot_generals of a jaxpr, its inner ones too (custom_vjp, cond, pjit), whose operands are FP8."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general" and all(v.aval.dtype.itemsize == 1 for v in eqn.invars)
        for value in eqn.params.values():
            for inner in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(inner, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
                    count += fp8_dots(getattr(inner, "jaxpr", inner))
    return count


@pytest.mark.parametrize("names,dots", [("", 0), ("mlp", 4), ("attention", 4), ("unembed", 1),
                                        ("mlp,attention,unembed", 9)])
def test_each_name_puts_its_own_matmuls_in_fp8(names, dots):
    """The forward of 2 layers: the MLP's c_fc and c_proj and the attention's c_attn and c_proj a layer, and the
    unembedding, each one product of FP8 operands where compute.fp8 names it."""
    model, tokens = GPT(CFG, ComputeConfig(fp8=names)), jnp.zeros((2, CFG.block_size), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    assert fp8_dots(jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens))(params).jaxpr) == dots
    compute = ComputeConfig(fp8="unembed, mlp")
    assert [compute.for_matmul(name).matmul for name in ("mlp", "attention", "unembed")] == ["fp8", "auto", "fp8"]


# --- compiled for an H100 -------------------------------------------------------------------------

# In a process that has not imported JAX (the CUDA plugin describes the topology): the train step as
# jaxgpt.compile builds it for h100:1 (XLA's Triton GEMMs), and the loss's value and gradient with them
# off (cuBLAS's GEMMs), each program's text written to the folder argv[2].
COMPILE = """
import sys
from pathlib import Path
from jaxgpt.compile import compile_programs, topology_devices
devices = topology_devices("h100:1")
import jax
from jaxgpt.config import default_config
from jaxgpt.model import GPT, param_shapes
from jaxgpt.train import opening
from jaxgpt.train.step import loss_fn
config, out = default_config(), Path(sys.argv[2])
for key, value in {"model.vocab_size": 320, "model.n_layer": 2, "model.n_head": 4, "model.d_model": 64,
                   "model.block_size": 64, "model.bias": False, "train.batch_size": 8, "train.eval_batch_size": 8,
                   "train.grad_accum": 1, "compute.kernel": "xla", "compute.dtype": "bfloat16",
                   "compute.fp8": sys.argv[1]}.items():
    section, name = key.split(".")
    config[section][name] = value
_, programs = compile_programs(config, devices, generate=False)
(out / "triton.hlo").write_text(programs[0].compiled.as_text())
gpt = GPT(opening.model_config(config, 320), opening.compute_config(config, "gpu", (9, 0)))
on = jax.sharding.SingleDeviceSharding(devices[0])
params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), param_shapes(gpt))
tokens = jax.ShapeDtypeStruct((8, 64), "int32", sharding=on)
grad = jax.jit(jax.value_and_grad(lambda p, x, y: loss_fn(gpt, p, x, y)))
compiled = grad.lower(params, tokens, tokens).compile({"xla_gpu_enable_triton_gemm": False})
(out / "cublas.hlo").write_text(compiled.as_text())
"""
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>\S+) = (?P<type>\([^)]*\)|\S+) (?P<op>[\w-]+)\((?P<args>[^)]*)\)")
WEIGHT_MATMULS = {"mlp": r"/mlp/c_(fc|proj)/", "attention": r"/attn/(attn\.project/)?(c_attn|q_proj|kv_proj|c_proj)/",
                  "unembed": r"jvp\(GPT\)\)?/[\w.]+$"}  # the unembedding: the one product GPT makes itself


def gemms(hlo: str) -> list[tuple[str | None, bool]]:
    """(the weight matmul it computes, or None, whether its operands are FP8) of every GEMM of a
    compiled GPU program: each dot (a Triton GEMM fusion's) and each cuBLAS custom call, the matmul
    read from the Flax module path in its op_name (forward, or transpose(…) for a gradient)."""
    found, types = [], {}
    for line in hlo.splitlines():
        if line.startswith(("%", "ENTRY")):  # a computation: its names are its own
            types = {}
        match = INSTRUCTION.match(line)
        if not match:
            continue
        types[match["name"]] = match["type"]
        target = re.search(r'custom_call_target="([^"]*)"', line)
        if match["op"] != "dot" and not (target and target[1].startswith("__cublas")):
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        op_name = op_name[1] if op_name else ""  # XLA keeps none on some batched GEMMs (the attention's scores)
        layer = next((name for name, path in WEIGHT_MATMULS.items() if re.search(path, op_name)), None)
        if target:
            fp8 = target[1].endswith("$f8")
        else:
            operands = [types[arg.strip().lstrip("%")] for arg in match["args"].split(",")]
            fp8 = all(kind.startswith("f8") for kind in operands)
        found.append((layer, fp8))
    return found


def compiled_for_h100(tmp_path, names: str) -> tuple[str, str]:
    if not extra_installed():
        pytest.skip(f"compiling for a GPU needs the gpu extra: {gpus.INSTALL}")
    env = {key: value for key, value in os.environ.items() if key not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    done = subprocess.run([sys.executable, "-c", COMPILE, names, str(tmp_path)], env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return (tmp_path / "triton.hlo").read_text(), (tmp_path / "cublas.hlo").read_text()


def test_every_named_matmul_is_an_fp8_gemm_in_the_program_for_an_h100(tmp_path):
    """compute.fp8='mlp,unembed' on 2 layers: 2 MLP matmuls a layer and the unembedding, 5 named
    matmuls, each a forward GEMM and two gradient GEMMs: 15 FP8 GEMMs, and no wider GEMM of theirs.
    The attention's 4 matmuls stay as they were: 12 GEMMs, none in FP8. In the train step as compiled
    by default (Triton's GEMMs, the FP8 arrays their operands) and with Triton's GEMMs off: cuBLASLt's
    FP8 GEMM (custom call __cublas$lt$matmul$f8), once XLA knows the target's CUDA runtime."""
    for hlo in compiled_for_h100(tmp_path, "mlp,unembed"):
        found = gemms(hlo)
        counts = {(layer, fp8): found.count((layer, fp8)) for layer in WEIGHT_MATMULS for fp8 in (True, False)}
        assert counts == {("mlp", True): 12, ("unembed", True): 3, ("attention", False): 12,
                          ("mlp", False): 0, ("unembed", False): 0, ("attention", True): 0}, json.dumps(str(counts))
        assert sum(fp8 for _, fp8 in found) == 15  # nothing else in FP8
    assert hlo.count('custom_call_target="__cublas$lt$matmul$f8"') == 15
