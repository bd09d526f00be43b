"""Pictures: the attention maps and next-token probabilities drawn are the model's own
(checked against float64 NumPy recomputations), the loss curves are those of the run as it
finally went, and `python -m jaxgpt.viz` writes PNGs of the promised size or fails in one line."""

import functools
import json
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
import reference as ref
from matplotlib.image import imread
from runs import write_run
from test_model import random_params

from jaxgpt import GPT, GPTConfig, tokenizers, viz
from jaxgpt.train.run import load_run

TEXT = "def add(a, b):\n    return a + b\n"  # 16 characters + 4 special tokens
PROMPT = "def add(a, b):"
MAX_WIDTH = 900  # px: every picture, so committed PNGs stay small


def tiny(**changes):
    base = dict(vocab_size=20, block_size=16, n_layer=2, n_head=3, d_model=12)
    return GPTConfig(**{**base, **changes})


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG header: the signature, then the IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def assert_picture(path: Path, min_height: int = 200) -> None:
    """A PNG at most MAX_WIDTH wide that shows something: many distinct colours, not a blank."""
    width, height = png_size(path)
    assert width == MAX_WIDTH and min_height <= height <= 2 * MAX_WIDTH, (width, height)
    pixels = imread(path)
    assert pixels.shape == (height, width, 4)
    colours = np.unique((pixels * 255).round().astype(np.uint8).view(np.uint32))
    assert len(colours) > 50
    assert path.stat().st_size < 200_000


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny run directory as training writes it, whose model uses the fused attention
    kernel (written in its compute section, as training writes it): its attention weights
    exist only when viz runs the explicit kernel."""
    tokenizer = tokenizers.train_tokenizer("char", [TEXT])
    cfg = tiny()
    assert tokenizer.vocab_size == cfg.vocab_size
    path = write_run(tmp_path_factory.mktemp("viz") / "run", cfg, tokenizer, step=4, compute={"kernel": "xla"})
    records = [{"step": s, "train_loss": 3.0 - 0.2 * s, "tokens_seen": 64 * s} for s in range(1, 9)]
    records[3]["val_loss"], records[7]["val_loss"] = 2.5, 1.8
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def loaded(run_dir):
    return load_run(run_dir)


# --- the numbers behind the pictures -------------------------------------------------------


def softmax64(scores):
    scores = scores - scores.max(-1, keepdims=True)
    e = np.exp(scores)
    return e / e.sum(-1, keepdims=True)


@functools.partial(jax.jit, static_argnums=0)
def layer_inputs(cfg, params, tokens):
    """LN₁(X) of every block: what its attention reads, captured as the model runs."""
    _, state = GPT(cfg).apply({"params": params}, tokens, capture_intermediates=True, mutable=["intermediates"])
    blocks = {name: layer for name, layer in state["intermediates"].items() if name.startswith("h_")}
    return {name: layer["ln_1"]["__call__"][0] for name, layer in blocks.items()}


def recomputed_attention(cfg, params, tokens, layer):
    """A = softmax(QKᵀ/√d_k + bias + M) in float64 from the layer's input LN₁(X) (captured from
    the model's run) and its c_attn weights."""
    x = np.asarray(layer_inputs(cfg, params, tokens)[f"h_{layer}"][0], np.float64)  # (T, d)
    c_attn = jax.tree.map(lambda a: np.asarray(a, np.float64), params[f"h_{layer}"]["attn"]["c_attn"])
    qkv = np.einsum("td,dchk->chtk", x, c_attn["kernel"]) + c_attn["bias"][:, :, None, :]
    q, k = qkv[0], qkv[1]  # (H, T, D)
    T, D = x.shape[0], q.shape[-1]
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(D)
    if cfg.positions == "alibi":
        distance = np.arange(T)[:, None] - np.arange(T)[None, :]
        scores = scores - np.asarray(ref.alibi_slopes(cfg.n_head))[:, None, None] * distance
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    return softmax64(scores)


# attention_maps runs the explicit kernel whatever the run ran with (run_dir: the fused 'xla').
@pytest.mark.parametrize("changes", [{}, {"positions": "alibi"}],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_attention_maps_are_the_models_own_weights(changes):
    """For a prompt 3 tokens longer than the context: the maps are over its last block_size tokens."""
    cfg = tiny(**changes)
    params = random_params(cfg)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, cfg.block_size + 3)
    T = cfg.block_size
    future = np.triu(np.ones((T, T), bool), k=1)
    for layer in range(cfg.n_layer):
        maps = viz.attention_maps(params, cfg, prompt, layer)
        assert maps.shape == (cfg.n_head, T, T)
        assert (maps[:, future] == 0.0).all()  # no query sees a later key
        np.testing.assert_allclose(maps.sum(-1), 1.0, rtol=1e-5)
        want = recomputed_attention(cfg, params, prompt[None, -T:], layer)
        np.testing.assert_allclose(maps, want, rtol=1e-4, atol=1e-5)
        uniform = np.where(future, 0.0, 1.0 / np.arange(1, T + 1)[:, None])
        assert np.abs(maps - uniform).max() > 0.1  # the weights are far from uniform: the check has power
    np.testing.assert_array_equal(viz.attention_maps(params, cfg, prompt, -1), maps)  # -1: the last layer


def test_next_token_distribution_is_the_models():
    cfg = tiny()
    params = random_params(cfg)
    tokens = np.array([3, 7, 1, 12, 5])
    ids, probs = viz.next_token_distribution(params, cfg, tokens, k=5)
    logits = ref.gpt_forward(cfg, jax.device_get(params), tokens[None])[0, -1]
    want = softmax64(logits)
    np.testing.assert_array_equal(ids, np.argsort(-want)[:5])
    np.testing.assert_allclose(probs, want[ids], rtol=1e-4)
    assert len(viz.next_token_distribution(params, cfg, tokens, k=100)[0]) == cfg.vocab_size


def test_loss_curves_keep_the_records_of_the_run_as_it_finally_went():
    """A run killed at step 40 after a checkpoint at 20 logs 30 and 40 again when resumed."""
    logged = [(10, 4.0), (20, 3.0), (30, 2.9), (40, 2.8), (30, 2.5), (40, 2.4), (50, 2.3)]
    records = [{"step": s, "train_loss": loss, "tokens_seen": 100 * s} for s, loss in logged]
    records[1]["val_loss"] = 3.1
    records[3]["val_loss"] = 2.85  # lost with the abandoned steps
    records[6]["val_loss"] = 2.2
    curves = viz.loss_curves(records)
    assert curves["train"] == [(10, 1000, 4.0), (20, 2000, 3.0), (30, 3000, 2.5), (40, 4000, 2.4), (50, 5000, 2.3)]
    assert curves["validation"] == [(20, 2000, 3.1), (50, 5000, 2.2)]


# --- the pictures ---------------------------------------------------------------------------


def test_token_labels_show_spaces_and_newlines(loaded):
    _, _, tokenizer = loaded
    assert viz.token_labels(tokenizer, tokenizer.encode("a \n")) == ["'a'", "' '", "'\\n'"]


def viz_cli(capsys, *args):
    status = viz.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_writes_each_picture_of_the_promised_size_into_the_run_directory_or_out(capsys, run_dir, tmp_path):
    for command, name, options in [("loss", "loss.png", ()), ("attention", "attention.png", ("--prompt", PROMPT)),
                                   ("next", "next_token.png", ("--prompt", PROMPT, "--k", 4))]:
        status, out, err = viz_cli(capsys, command, run_dir, *options)
        assert status == 0, err
        assert out.strip() == str(run_dir / name)
        assert_picture(run_dir / name)
    out_file = tmp_path / "pictures" / "a.png"  # a directory that does not exist yet
    status, out, _ = viz_cli(capsys, "attention", run_dir, "--prompt", "add", "--layer", -1, "--out", out_file)
    assert status == 0 and out.strip() == str(out_file)
    assert_picture(out_file, min_height=MAX_WIDTH // 2)  # 3 heads: two rows of square heatmaps


@pytest.mark.parametrize("args,message", [
    (("loss", "{missing}"), "does not exist"),
    (("loss", "{empty}"), "no metrics.jsonl records"),
    (("attention", "{run}", "--prompt", ""), "the prompt is empty"),
    (("attention", "{run}", "--prompt", "xyz"), "cannot encode"),
    (("attention", "{run}", "--prompt", "add", "--layer", "2"), "layer 2 is out of range: the model has layers 0…1"),
    (("next", "{run}", "--prompt", "add", "--k", "0"), "k must be a positive integer"),
    (("next", "{empty}", "--prompt", "add"), "not a complete run directory"),
])
def test_cli_bad_input_is_a_one_line_error(capsys, run_dir, tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "run": run_dir}
    status, out, err = viz_cli(capsys, *(a.format(**paths) for a in args))
    assert status == 2 and out == ""
    assert err.startswith("jaxgpt.viz: error: ") and err.count("\n") == 1, err
    assert message in err


def test_a_picture_that_cannot_be_written_says_where_to_draw_it_instead(capsys, run_dir, tmp_path, monkeypatch):
    from test_eval import refuse_writes_in

    refuse_writes_in(monkeypatch, run_dir)  # a read-only run directory
    status, out, err = viz_cli(capsys, "loss", run_dir)
    assert (status, out) == (2, "")
    assert err == f"jaxgpt.viz: error: cannot write in {run_dir} (Permission denied): pass --out FILE to draw it " \
                  "elsewhere\n"
    status, out, err = viz_cli(capsys, "loss", run_dir, "--out", tmp_path)
    assert status == 2 and f"--out {tmp_path} is a directory: name the PNG file" in err
    status, out, err = viz_cli(capsys, "loss", run_dir, "--out", tmp_path / "loss.png")
    assert status == 0 and out.strip() == str(tmp_path / "loss.png")
    assert_picture(tmp_path / "loss.png")


def test_sample_py_draws_the_attention_picture_of_its_prompt(capsys, run_dir, tmp_path):
    from scripts import load_script

    sample_cli = load_script("sample.py")
    out_file = tmp_path / "attention.png"
    status = sample_cli.main(["--run_dir", str(run_dir), "--prompt", PROMPT, "--max_new_tokens", "3",
                              "--attention_png", str(out_file), "--attention_layer", "-1"])
    assert status == 0, capsys.readouterr().err
    assert_picture(out_file)
    status = sample_cli.main(["--run_dir", str(run_dir), "--prompt", PROMPT, "--attention_png", str(out_file),
                              "--attention_layer", "5"])
    assert status == 2 and "out of range" in capsys.readouterr().err
