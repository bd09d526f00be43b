"""Circuits: W_QK recomputes the model's attention scores, W_OV its heads' output, and the
composition scores equal a float64 NumPy recomputation written here another way."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from runs import write_run
from test_model import random_params

from jaxgpt import GPT, GPTConfig
from jaxgpt.analysis import circuits

CFG = GPTConfig(vocab_size=23, block_size=12, n_layer=3, n_head=2, d_model=16, bias=False, positions="learned")
TOKENS = np.array([[3, 7, 1, 22, 5, 5, 9, 0, 14, 2]])


@pytest.fixture(scope="module")
def params():
    return random_params(CFG)


def first_layer_input(params) -> np.ndarray:
    """LN₁(E[x] + P[pos]) of layer 0 in float64: the x its attention reads."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = p["wte"]["embedding"][TOKENS[0]] + p["wpe"]["embedding"][: TOKENS.shape[1]]
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + CFG.norm_eps) * p["h_0"]["ln_1"]["scale"]  # bias=False: no β


def model_intermediates(params):
    _, state = GPT(CFG).apply({"params": params}, jnp.asarray(TOKENS), capture_intermediates=True,
                              mutable=["intermediates"])
    return state["intermediates"]


def test_w_qk_recomputes_the_attention_scores(params):
    """x_t W_QK x_sᵀ/√d_k against the model's weights: log A[t, s] = score[t, s] − logsumexp_s,
    so over the keys each query sees, the two agree up to the row's constant."""
    x = first_layer_input(params)
    qk, _ = circuits.head_matrices(params, CFG, 0)
    weights = np.asarray(model_intermediates(params)["h_0"]["attn"]["attention_weights"][0][0], np.float64)
    for h in range(CFG.n_head):
        scores = x @ qk[h] @ x.T / math.sqrt(CFG.head_dim)
        for t in range(TOKENS.shape[1]):
            ours, model = scores[t, : t + 1], np.log(weights[h, t, : t + 1])
            np.testing.assert_allclose(ours - ours.mean(), model - model.mean(), atol=1e-4)


def test_w_ov_applied_to_the_values_reproduces_the_heads_output(params):
    x = first_layer_input(params)
    _, ov = circuits.head_matrices(params, CFG, 0)
    inter = model_intermediates(params)["h_0"]["attn"]
    weights = np.asarray(inter["attention_weights"][0][0], np.float64)  # (H, T, T)
    output = np.asarray(inter["__call__"][0][0][0], np.float64)  # the attention block's output (T, d)
    np.testing.assert_allclose(sum(weights[h] @ x @ ov[h] for h in range(CFG.n_head)), output, atol=1e-4)


def test_composition_scores_equal_a_float64_recomputation(params):
    scores = circuits.composition(params, CFG)
    H, D, d = CFG.n_head, CFG.head_dim, CFG.d_model

    def head(layer, h):  # from the flat (d, 3·H·D) and (H·D, d) views of the kernels
        qkv = np.asarray(params[f"h_{layer}"]["attn"]["c_attn"]["kernel"], np.float64).reshape(d, 3 * H * D)
        w_o = np.asarray(params[f"h_{layer}"]["attn"]["c_proj"]["kernel"], np.float64).reshape(H * D, d)
        cols = lambda i: qkv[:, i * H * D + h * D: i * H * D + (h + 1) * D]  # noqa: E731
        return np.einsum("ia,ja->ij", cols(0), cols(1)), np.einsum("ia,aj->ij", cols(2), w_o[h * D:(h + 1) * D])

    def score(m1, m2):
        return math.sqrt((np.einsum("ij,jk->ik", m1, m2) ** 2).sum()) / math.sqrt((m1**2).sum() * (m2**2).sum())

    for la, lb, ha, hb in [(0, 1, 0, 1), (0, 2, 1, 0), (1, 2, 1, 1)]:
        (_, ov_a), (qk_b, ov_b) = head(la, ha), head(lb, hb)
        a, b = la * H + ha, lb * H + hb
        assert scores["q"][a, b] == pytest.approx(score(ov_a, qk_b), rel=1e-10)
        assert scores["k"][a, b] == pytest.approx(score(qk_b, ov_a.T), rel=1e-10)
        assert scores["v"][a, b] == pytest.approx(score(ov_a, ov_b), rel=1e-10)
    assert np.isnan(scores["q"][2, 0]) and np.isnan(scores["v"][0, 1])  # not earlier into later


def test_ranks_energy_and_token_circuits(params):
    spectra = circuits.spectra(params, CFG)
    assert spectra["qk"].shape == (CFG.n_layer, CFG.n_head, CFG.head_dim)
    assert (circuits.rank(spectra["ov"]) == CFG.head_dim).all()  # random weights: full rank d_head < d
    low = np.array([3.0, 4.0, 0.0])
    assert circuits.rank(low) == 2 and circuits.top_k_fraction(low, 1) == pytest.approx(9 / 25)
    token = circuits.token_circuits(params, CFG, 1, 0)
    qk, ov = circuits.head_matrices(params, CFG, 1)
    w_e = np.asarray(params["wte"]["embedding"], np.float64)
    i, j = 4, 17  # the tied unembedding is W_Eᵀ: token i's pushes on token j's logit
    assert token["ov"][i, j] == pytest.approx(w_e[i] @ ov[0] @ w_e[j], rel=1e-10)
    assert token["qk"][i, j] == pytest.approx(w_e[i] @ qk[0] @ w_e[j], rel=1e-10)
    assert circuits.top_copies(np.array([[0.1, 3.0, 2.0], [5.0, 1.0, 1.0]]), k=2).tolist() == [[1, 2], [0, 1]]


def char_run(run):
    """A run directory of a random 2-layer char model, as training writes it."""
    from jaxgpt import tokenizers

    tokenizer = tokenizers.train_tokenizer("char", ["the cat sat on the mat"])
    return write_run(run, GPTConfig(vocab_size=tokenizer.vocab_size, block_size=8, n_layer=2, n_head=2, d_model=16),
                     tokenizer)


def test_circuits_cli_on_a_run(tmp_path, capsys):
    from jaxgpt.analysis.__main__ import main

    run = char_run(tmp_path / "run")
    assert main(["circuits", str(run), "--top_k", "2"]) == 0
    out = capsys.readouterr().out
    assert "strongest Q-composition: layer 0 head" in out and "OV top-2" in out
    for name in ("circuits.json", "circuits_composition.png", "circuits_spectra.png"):
        assert (run / name).stat().st_size > 100


def test_circuits_that_cannot_be_written_say_where_to_write_instead(tmp_path, capsys, monkeypatch):
    from test_eval import refuse_writes_in

    from jaxgpt.analysis.__main__ import main

    run = char_run(tmp_path / "run")
    (tmp_path / "file").write_text("mine")
    assert main(["circuits", str(run), "--out", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err.strip() == (f"jaxgpt.analysis: error: cannot write in {tmp_path / 'file'} (a file, "
                                               "not a directory): pass --out DIR to write circuits.json and its "
                                               "pictures elsewhere")
    assert (tmp_path / "file").read_text() == "mine"
    refuse_writes_in(monkeypatch, run)  # a read-only run directory
    assert main(["circuits", str(run)]) == 2
    assert capsys.readouterr().err.strip() == (f"jaxgpt.analysis: error: cannot write in {run} (Permission denied): "
                                               "pass --out DIR to write circuits.json and its pictures elsewhere")
    assert main(["circuits", str(run), "--out", str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "circuits.json").exists() and not (run / "circuits.json").exists()
