"""GPT-2 checkpoints in Hugging Face's format, read and written: the same function under other names.

    cfg, params = load_hf_gpt2("gpt2/")             # config.json + model.safetensors
    save_hf_gpt2("out/", cfg, params, tokenizer)    # what transformers' from_pretrained loads
    params, cfg, tokenizer = load_hf_run("gpt2/")   # for sampling and evaluation, like sampling.load_run

A Hugging Face GPT-2 directory holds config.json, the weights in model.safetensors (or in
shards listed by model.safetensors.index.json) and, for the tokenizer, vocab.json +
merges.txt. The tensors map to jaxgpt's parameters one to one (d = n_embd, H heads of size
D = d/H, f = n_inner or 4d, V = vocab_size; names may carry the prefix "transformer."):

    wte.weight              (V, d)            wte/embedding            (V, d)
    wpe.weight              (n_positions, d)  wpe/embedding            (block_size, d)
    h.i.ln_1.weight, .bias  (d,)              h_i/ln_1/scale, bias     (d,)   (ln_2, ln_f alike)
    h.i.attn.c_attn.weight  (d, 3d)           h_i/attn/c_attn/kernel   (d, 3, H, D)
    h.i.attn.c_attn.bias    (3d,)             h_i/attn/c_attn/bias     (3, H, D)
    h.i.attn.c_proj.weight  (d, d)            h_i/attn/c_proj/kernel   (H, D, d)
    h.i.mlp.c_fc.weight     (d, f)            h_i/mlp/c_fc/kernel      (d, f)
    h.i.mlp.c_proj.weight   (f, d)            h_i/mlp/c_proj/kernel    (f, d)
    lm_head.weight          (V, d)            lm_head/kernel           (d, V)  (untied only)

GPT-2's Conv1D stores its weight input-major, (in, out), and computes x W + b: already the layout of a Flax
kernel, so nothing is transposed. The fused c_attn's 3d outputs are [q | k | v], each head after head, so a
reshape gives (3, H, D); c_proj's d inputs are the heads side by side, so a reshape gives (H, D, d). lm_head
is a torch Linear, (out, in), so it is transposed; when the embeddings are tied it is not stored, or is a copy
of wte (one that differs is refused: transformers versions disagree on which counts). The attention's causal-
mask buffers (h.i.attn.bias, .masked_bias) that old checkpoints carry are not parameters and are skipped.

The configuration: n_positions → block_size, n_inner → d_ff (None: 4·n_embd),
layer_norm_epsilon → norm_eps, tie_word_embeddings → tie_embeddings, resid_pdrop →
dropout, activation_function gelu_new / gelu_pytorch_tanh / gelu_fast (all the tanh
approximation) → 'gelu', gelu (erf) → 'gelu_exact', relu → 'relu'. Attention options that
change the function (scale_attn_weights off, scale_attn_by_inverse_layer_idx, cross
attention) are refused; reorder_and_upcast_attn only computes scores in float32, as
jaxgpt always does, so it is accepted. Weights are read as float32 whatever their stored
dtype, and written as float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxgpt import tokenizers
from jaxgpt.blocks import block_name, unstack_layers
from jaxgpt.config import GPTConfig
from jaxgpt.files import write_atomically

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"

# activation_function → GPTConfig.activation (the tanh approximation goes by three names) and back.
ACTIVATIONS_FROM_HF = {
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
    "gelu_fast": "gelu",
    "gelu": "gelu_exact",
    "relu": "relu",
    "relu2": "relu2",
}
ACTIVATIONS_TO_HF = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu", "relu2": "relu2"}
GPT2 = GPTConfig()  # GPT-2's architecture: GPTConfig's defaults, which a model must keep to be exported as one

# GPT2Config's defaults, which transformers uses for keys a config.json leaves out.
HF_DEFAULTS = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
    "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
}
# Attention options of GPT2Config that change the function, with the value jaxgpt computes.
HF_FIXED_OPTIONS = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                    "add_cross_attention": False}

# Buffers that old checkpoints store next to the weights: the causal mask, not parameters.
_MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(masked_)?bias")


# --- the tensor table: one entry per GPT-2 tensor ------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """A GPT-2 tensor and the jaxgpt parameter it is: same numbers, other shape (and for a
    torch Linear weight, transposed)."""

    hf_name: str
    path: tuple[str, ...]  # into the jaxgpt params
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]
    transposed: bool = False
    is_bias: bool = False

    @property
    def saved_name(self) -> str:
        """The name save_pretrained gives it: the body's tensors sit under 'transformer.'."""
        return self.hf_name if self.hf_name == "lm_head.weight" else f"transformer.{self.hf_name}"

    def to_jaxgpt(self, tensor: np.ndarray) -> np.ndarray:
        return (tensor.T if self.transposed else tensor).reshape(self.shape)

    def to_hf(self, param: np.ndarray) -> np.ndarray:
        return (param.T if self.transposed else param).reshape(self.hf_shape)


def _tensor_table(cfg: GPTConfig) -> list[_Tensor]:
    """Every tensor of the GPT-2 that `cfg` describes (biases included even when cfg has none)."""
    d, f, V, H, D = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_head, cfg.head_dim

    def norm(hf_name: str, path: tuple[str, ...]) -> list[_Tensor]:
        return [_Tensor(f"{hf_name}.weight", (*path, "scale"), (d,), (d,)),
                _Tensor(f"{hf_name}.bias", (*path, "bias"), (d,), (d,), is_bias=True)]

    def dense(hf_name: str, path: tuple[str, ...], n_in: int, n_out: int, kernel: tuple, bias: tuple) -> list[_Tensor]:
        return [_Tensor(f"{hf_name}.weight", (*path, "kernel"), (n_in, n_out), kernel),
                _Tensor(f"{hf_name}.bias", (*path, "bias"), (n_out,), bias, is_bias=True)]

    table = [_Tensor("wte.weight", ("wte", "embedding"), (V, d), (V, d)),
             _Tensor("wpe.weight", ("wpe", "embedding"), (cfg.block_size, d), (cfg.block_size, d))]
    for i in range(cfg.n_layer):
        hf, block = f"h.{i}", block_name(i)
        table += norm(f"{hf}.ln_1", (block, "ln_1"))
        table += dense(f"{hf}.attn.c_attn", (block, "attn", "c_attn"), d, 3 * d, (d, 3, H, D), (3, H, D))
        table += dense(f"{hf}.attn.c_proj", (block, "attn", "c_proj"), d, d, (H, D, d), (d,))
        table += norm(f"{hf}.ln_2", (block, "ln_2"))
        table += dense(f"{hf}.mlp.c_fc", (block, "mlp", "c_fc"), d, f, (d, f), (f,))
        table += dense(f"{hf}.mlp.c_proj", (block, "mlp", "c_proj"), f, d, (f, d), (d,))
    table += norm("ln_f", ("ln_f",))
    if not cfg.tie_embeddings:
        table.append(_lm_head(cfg))
    return table


def _lm_head(cfg: GPTConfig) -> _Tensor:
    V, d = cfg.vocab_size, cfg.d_model
    return _Tensor("lm_head.weight", ("lm_head", "kernel"), (V, d), (d, V), transposed=True)


# --- configurations -------------------------------------------------------------------------


def config_from_hf(hf: Mapping[str, Any], source: str = CONFIG_FILE) -> GPTConfig:
    """The GPTConfig of a GPT-2 config.json's contents; ValueError (naming `source`) for a
    model that is not GPT-2 or a GPT-2 option jaxgpt does not compute."""
    model_type = hf.get("model_type")
    if model_type is None:
        raise ValueError(f"{source} has no model_type, so it is not the config of a Hugging Face model "
                         "(a jaxgpt run directory is not a Hugging Face checkpoint)")
    if model_type != "gpt2":
        raise ValueError(f"{source} describes a model of type {model_type!r}, not GPT-2 (model_type 'gpt2'): "
                         "jaxgpt reads GPT-2 checkpoints only")
    for option, standard in HF_FIXED_OPTIONS.items():
        if hf.get(option, standard) != standard:
            raise ValueError(f"{source} sets {option}={hf[option]!r}; jaxgpt computes GPT-2 with "
                             f"{option}={standard} only, so it cannot load this model")
    value = {**HF_DEFAULTS, **{key: hf[key] for key in HF_DEFAULTS if key in hf}}
    activation = value["activation_function"]
    if activation not in ACTIVATIONS_FROM_HF:
        raise ValueError(f"{source} sets activation_function={activation!r}; jaxgpt computes "
                         f"{', '.join(ACTIVATIONS_FROM_HF)} only")
    try:
        return GPTConfig(
            vocab_size=value["vocab_size"], block_size=value["n_positions"], n_layer=value["n_layer"],
            n_head=value["n_head"], d_model=value["n_embd"], d_ff=value["n_inner"],
            dropout=float(value["resid_pdrop"]), positions="learned", norm="layernorm", norm_position="pre",
            parallel_block=False, activation=ACTIVATIONS_FROM_HF[activation], bias=True,
            tie_embeddings=value["tie_word_embeddings"], norm_eps=float(value["layer_norm_epsilon"]),
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source} does not describe a valid GPT-2: {err}") from None


def config_to_hf(cfg: GPTConfig, tokenizer: tokenizers.Tokenizer | None = None) -> dict[str, Any]:
    """The config.json of the GPT-2 that is `cfg` (bos/eos ids from `tokenizer`); ValueError for what it cannot be."""
    refusals = [
        (cfg.positions != GPT2.positions, f"positions={cfg.positions!r}: GPT-2 learns its position table "
                                          f"({GPT2.positions!r})"),
        (cfg.norm != "layernorm", f"norm={cfg.norm!r}: GPT-2 uses LayerNorm ('layernorm')"),
        (cfg.norm_position != "pre", f"norm_position={cfg.norm_position!r}: GPT-2 normalises before each "
                                     "sublayer ('pre')"),
        (cfg.parallel_block, "parallel_block=True: GPT-2's attention and FFN are sequential"),
        (cfg.n_kv_head != cfg.n_head or cfg.head_dim * cfg.n_head != cfg.d_model or cfg.logits_bias
         or cfg.ffn_layers > 1, "n_kv_head, head_dim, logits_bias, ffn_layers: GPT-2 has only the defaults"),
        (cfg.attention != GPT2.attention, f"attention={cfg.attention!r}: GPT-2's attention is softmax over every "
                                          f"earlier position ({GPT2.attention!r})"),
        (cfg.qk_norm, "qk_norm=True: GPT-2 scores raw queries and keys"),
        (cfg.logit_softcap is not None, f"logit_softcap={cfg.logit_softcap!r}: GPT-2's logits are not capped"),
        (cfg.activation not in ACTIVATIONS_TO_HF, f"activation={cfg.activation!r}: GPT-2's FFN uses one of "
                                                 f"{', '.join(ACTIVATIONS_TO_HF)}"),
        (bool(cfg.value_embeds), f"value_embeds={cfg.value_embeds!r}: GPT-2's values are X W_V alone"),
        (cfg.unet_skips, "unet_skips=True: GPT-2's blocks read only the block before"),
        (cfg.smear, "smear=True: GPT-2 embeds each token alone, without the one before it"),
        (cfg.bigram_table > 0, f"bigram_table={cfg.bigram_table}: GPT-2 has no bigram hash embedding"),
        (cfg.trigram_table > 0, f"trigram_table={cfg.trigram_table}: GPT-2 has no trigram hash embedding"),
        (cfg.attn_gate > 0, f"attn_gate={cfg.attn_gate}: GPT-2's heads are not gated"),
        (cfg.key_offset, "key_offset=True: GPT-2's keys are each token's own"),
        (bool(cfg.paired_heads), f"paired_heads={cfg.paired_heads!r}: GPT-2's heads attend apart"),
        (cfg.dense_skips > 0, f"dense_skips={cfg.dense_skips}: GPT-2's blocks read only the block before"),
    ]
    problems = [reason for refused, reason in refusals if refused]
    if problems:
        raise ValueError(f"this model cannot be written as GPT-2: {'; '.join(problems)}")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.d_ff,
        "activation_function": ACTIVATIONS_TO_HF[cfg.activation],
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02,
        **HF_FIXED_OPTIONS,
        "reorder_and_upcast_attn": False,
        "bos_token_id": tokenizer.bos_id if tokenizer else None,
        "eos_token_id": tokenizer.eos_id if tokenizer else None,
        "use_cache": True,
    }


# --- reading --------------------------------------------------------------------------------


def load_hf_config(path: str | os.PathLike) -> GPTConfig:
    """The GPTConfig of the Hugging Face GPT-2 directory `path` (its config.json), checked."""
    directory = _checkpoint_dir(path)
    return config_from_hf(_read_json(directory / CONFIG_FILE, "config"), str(directory / CONFIG_FILE))


def load_hf_gpt2(path: str | os.PathLike) -> tuple[GPTConfig, dict]:
    """(config, params) of the Hugging Face GPT-2 directory `path`: config.json and
    model.safetensors (or its shards), read through safetensors' NumPy API. ValueError,
    saying what is wrong, for a directory that is not a GPT-2 checkpoint, a missing or
    damaged file, or tensors whose shapes do not match config.json."""
    directory = _checkpoint_dir(path)
    cfg = load_hf_config(directory)
    files = _tensor_files(directory)
    names = {_strip_prefix(name): (name, file) for file, file_names in files.items() for name in file_names}
    table = _tensor_table(cfg)
    lm_head = _lm_head(cfg)
    known = {entry.hf_name for entry in table} | {lm_head.hf_name}  # a tied one is checked against wte below
    unexpected = sorted(n for n in names if n not in known and not _MASK_BUFFER.fullmatch(n))
    if unexpected:
        raise ValueError(f"{directory} holds tensors that GPT-2 of config.json does not have ({_few(unexpected)}): "
                         "it is not a GPT2LMHeadModel checkpoint, or config.json does not belong to it")
    params: dict = {}
    try:
        with contextlib.ExitStack() as stack:
            handles = {file: stack.enter_context(safe_open(str(file), framework="np")) for file in files}
            for entry in table:
                _set(params, entry.path, entry.to_jaxgpt(_read_tensor(handles, names, entry, cfg, directory)))
            if cfg.tie_embeddings and lm_head.hf_name in names:
                stored = _read_tensor(handles, names, lm_head, cfg, directory)
                if not np.array_equal(stored, params["wte"]["embedding"]):
                    raise ValueError(f"{directory}: config.json ties lm_head to wte (tie_word_embeddings=true) but the "
                                     "weights hold a different lm_head.weight, which transformers versions treat "
                                     "differently; set tie_word_embeddings to false to use it, or delete it")
    except SafetensorError as err:
        raise ValueError(f"{directory}: a weights file is damaged ({err})") from None
    return cfg, jax.tree.map(jnp.asarray, params)


def _read_tensor(handles: dict, names: dict, entry: _Tensor, cfg: GPTConfig, directory: Path) -> np.ndarray:
    """The tensor of `entry` as float32, after checking that it is there with its shape."""
    if entry.hf_name not in names:
        raise ValueError(f"{directory} has no tensor {entry.hf_name!r}, which config.json's GPT-2 needs "
                         f"(n_layer={cfg.n_layer}, tie_word_embeddings={cfg.tie_embeddings}): "
                         "the weights are incomplete or belong to another config")
    stored_name, file = names[entry.hf_name]
    shape = tuple(handles[file].get_slice(stored_name).get_shape())
    if shape != entry.hf_shape:
        raise ValueError(f"tensor {entry.hf_name!r} in {file.name} has shape {shape}, but config.json "
                         f"(n_embd={cfg.d_model}, n_head={cfg.n_head}, n_inner={cfg.d_ff}, "
                         f"vocab_size={cfg.vocab_size}, n_positions={cfg.block_size}) needs "
                         f"{entry.hf_shape}: config.json does not belong to these weights")
    return np.asarray(handles[file].get_tensor(stored_name), np.float32)


def load_hf_tokenizer(path: str | os.PathLike) -> tokenizers.BPETokenizer | None:
    """The byte-level BPE of vocab.json + merges.txt in `path`; None when it has neither."""
    directory = _checkpoint_dir(path)
    vocab, merges = directory / VOCAB_FILE, directory / MERGES_FILE
    if not vocab.is_file() and not merges.is_file():
        return None
    for present, absent in ((vocab, merges), (merges, vocab)):
        if not absent.is_file():
            raise ValueError(f"{directory} has {present.name} but no {absent.name}: the GPT-2 tokenizer needs both")
    return tokenizers.BPETokenizer.from_gpt2(vocab, merges)


def load_hf_run(path: str | os.PathLike) -> tuple[dict, GPTConfig, tokenizers.BPETokenizer]:
    """(params, config, tokenizer) of a Hugging Face GPT-2 directory, as sampling.load_run
    gives them for a run directory; the tokenizer (vocab.json + merges.txt) is required."""
    cfg, params = load_hf_gpt2(path)
    tokenizer = load_hf_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"{path} has no {VOCAB_FILE} + {MERGES_FILE}, so its text cannot be tokenized: copy "
                         "them from the checkpoint this model was trained with")
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                         f"{cfg.vocab_size}: vocab.json and merges.txt belong to another model")
    return params, cfg, tokenizer


def _checkpoint_dir(path: str | os.PathLike) -> Path:
    directory = Path(path).expanduser()
    if not directory.is_dir():
        what = "is a file" if directory.exists() else "does not exist"
        raise ValueError(f"{directory} {what}: give the directory of a Hugging Face GPT-2 checkpoint "
                         f"({CONFIG_FILE} + {WEIGHTS_FILE})")
    if not (directory / CONFIG_FILE).is_file():
        raise ValueError(f"{directory} has no {CONFIG_FILE}, so it is not a Hugging Face checkpoint directory")
    return directory


def _read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}): the {what} file is damaged") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds {type(value).__name__}, not a JSON object: the {what} file is damaged")
    return value


def _tensor_files(directory: Path) -> dict[Path, list[str]]:
    """Each weights file of the checkpoint and the tensor names it holds."""
    index_path = directory / WEIGHTS_INDEX_FILE
    single = directory / WEIGHTS_FILE
    if single.is_file():
        files = [single]
    elif index_path.is_file():
        weight_map = _read_json(index_path, "weights index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no weight_map object: the weights index is damaged")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ValueError(f"{index_path} lists {file.name}, which is missing: the download is incomplete")
    else:
        others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.h5"))
        hint = (f" (it has {', '.join(others)}: load it in transformers and save_pretrained(..., "
                "safe_serialization=True))" if others else "")
        raise ValueError(f"{directory} has no {WEIGHTS_FILE}{hint}; jaxgpt reads safetensors weights only")
    names = {}
    for file in files:
        try:
            with safe_open(str(file), framework="np") as handle:
                names[file] = list(handle.keys())
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{file} is not a readable safetensors file ({err}): download it again") from None
    return names


def _strip_prefix(name: str) -> str:
    return name.removeprefix("transformer.")


# --- writing --------------------------------------------------------------------------------


def check_gpt2_tokenizer(tokenizer: tokenizers.Tokenizer, cfg: GPTConfig) -> None:
    """ValueError unless `tokenizer` can be written as GPT-2's vocab.json + merges.txt for a
    model of `cfg`: a byte-level BPE with GPT-2's split pattern (the files cannot record another)."""
    if not isinstance(tokenizer, tokenizers.BPETokenizer):
        raise ValueError(f"the run's {tokenizer.kind} tokenizer has no GPT-2 form (vocab.json + merges.txt hold a "
                         "byte-level BPE); keep the run's tokenizer.json to encode text for this model")
    if tokenizer.pattern != tokenizers.GPT2_SPLIT_PATTERN:
        raise ValueError("the run's BPE splits text with another pattern than GPT-2's, which vocab.json + "
                         "merges.txt cannot record; keep the run's tokenizer.json to encode text for this model")
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {cfg.vocab_size}")


def save_hf_gpt2(path: str | os.PathLike, cfg: GPTConfig, params, tokenizer: tokenizers.Tokenizer | None = None
                 ) -> None:
    """Write the model as a Hugging Face GPT-2 directory: config.json and model.safetensors
    (float32), and with `tokenizer` its vocab.json + merges.txt. ValueError, before anything
    is written, for a configuration GPT-2 cannot express (rope, rmsnorm, swiglu, …), params
    that are not those of `cfg`, or a tokenizer with no GPT-2 form. A model without biases
    is written with zero biases, which computes the same function."""
    hf_config = config_to_hf(cfg, tokenizer)
    if tokenizer is not None:
        check_gpt2_tokenizer(tokenizer, cfg)
    params = unstack_layers(params)  # a scan_layers model's blocks are stacked
    tensors = {}
    for entry in _tensor_table(cfg):
        if entry.is_bias and not cfg.bias:
            tensors[entry.saved_name] = np.zeros(entry.hf_shape, np.float32)
            continue
        param = _get(params, entry.path)
        if tuple(param.shape) != entry.shape:
            raise ValueError(f"params {'/'.join(entry.path)} has shape {tuple(param.shape)}, but the config needs "
                             f"{entry.shape}: these params are not those of this config")
        tensors[entry.saved_name] = np.ascontiguousarray(entry.to_hf(np.asarray(param, np.float32)))
    directory = Path(path).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    # transformers refuses safetensors files whose metadata does not name their format.
    write_atomically(directory / WEIGHTS_FILE, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    write_atomically(directory / CONFIG_FILE,
                      lambda tmp: Path(tmp).write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8"))
    if tokenizer is not None:
        tokenizer.save_gpt2(directory)


# --- a shorter context ----------------------------------------------------------------------


def crop_block_size(cfg: GPTConfig, params, block_size: int) -> tuple[GPTConfig, dict]:
    """The same model with a shorter context: a learned position table keeps its first
    block_size rows (a sequence of at most that many tokens is computed exactly as before)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= cfg.block_size:
        raise ValueError(f"block_size={block_size!r}: must be an integer in 1…{cfg.block_size}, the model's context")
    if "wpe" in params:  # a learned position table: its rows past block_size go
        params = {**params, "wpe": {"embedding": params["wpe"]["embedding"][:block_size]}}
    return cfg.replace(block_size=block_size), params


# --- small helpers --------------------------------------------------------------------------


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree, path: tuple[str, ...]):
    for depth, key in enumerate(path):
        if not isinstance(tree, Mapping) or key not in tree:
            raise ValueError(f"params have no {'/'.join(path[:depth + 1])}: they are not those of this config")
        tree = tree[key]
    return tree


def _few(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(map(repr, names[:limit]))
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
