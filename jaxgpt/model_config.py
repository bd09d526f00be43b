"""What a model is, apart from how it runs (docs/ARCHITECTURE.md, "Two configs"):

    GPTConfig      the model's identity (config.model): the function it computes. It must match
                   to resume a run, load it, export it or compare it.
    ComputeConfig  how that function runs here (config.compute): the attention kernel, remat,
                   the compute and parameter dtypes, scan_layers. It belongs to the machine and
                   the command, not to the run: a resume or a sampler may choose any of it.

The schema names no implementation: it checks types, ranges and how settings combine. Whether
a name (model.positions, model.attention, compute.kernel, …) is one the code has is checked where
a config is opened, against the registry where its entries are defined (jaxgpt.registries).

Neither config asks which devices exist; every command checks its kernel against the devices
and the model with registries.check_kernel before anything compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxgpt.errors import is_int, is_number

NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post")
INITS = ("gpt2", "he", "small")
# The names of positions, attention forms, kernels, activations and feature maps are the registries'
# where their entries are defined, checked where a config is opened (jaxgpt.registries).
DTYPES = ("float32", "bfloat16", "float16", "float64")
WEIGHTS = ("float", "int8")  # how the weight matrices are stored: in param_dtype, or int8 with scales
# the weight matmuls compute.fp8 may name: the MLP's, the attention's projections (in and out) and the
# unembedding (model.unembed: the whole logits and the chunked loss's); model.py says which layer is which
FP8_MATMULS = ("mlp", "attention", "unembed")
# the compute section's keys that older run directories kept in the model section, and the
# kernels they named in model.attention
COMPUTE_KEYS = ("dtype", "param_dtype", "remat", "scan_layers")
OLD_KERNELS = ("explicit", "blocked", "xla", "cudnn")


def value_embed_tables(value_embeds) -> tuple[tuple[int, ...], ...]:
    """value_embeds as tuples (a saved config's lists too): one entry per table, the layers that
    add it; a bare integer is a table of one layer. ValueError (one line) for anything else."""
    def layers(entry):
        entry = (entry,) if isinstance(entry, int) and not isinstance(entry, bool) else entry
        if not isinstance(entry, (list, tuple)) or not entry or not all(
                isinstance(layer, int) and not isinstance(layer, bool) for layer in entry):
            raise ValueError(f"GPTConfig.value_embeds={value_embeds!r}: each entry is a table, the layer indices that "
                             "add it (a tuple of ints, or one int), e.g. ((0, -3), (1, -2), (2, -1))")
        return tuple(entry)

    if not isinstance(value_embeds, (list, tuple)):
        raise ValueError(f"GPTConfig.value_embeds={value_embeds!r}: must be a tuple of tables, each the layer "
                         "indices that add it, e.g. ((0, -3), (1, -2), (2, -1)); () for none")
    return tuple(layers(entry) for entry in value_embeds)


def value_embed_layers(value_embeds, n_layer: int) -> dict[int, int]:
    """{layer ℓ: the table k it adds} (a negative index counts from the end: −1 is the last
    layer). ValueError (one line) for a layer that does not exist or is listed twice."""
    found: dict[int, int] = {}
    for table, layers in enumerate(value_embed_tables(value_embeds)):
        for layer in layers:
            if not -n_layer <= layer < n_layer:
                raise ValueError(f"GPTConfig.value_embeds={value_embeds!r}: layer {layer} does not exist (n_layer="
                                 f"{n_layer}: layers 0 … {n_layer - 1}, or −{n_layer} … −1 from the end)")
            if layer % n_layer in found:
                raise ValueError(f"GPTConfig.value_embeds={value_embeds!r}: layer {layer % n_layer} is listed twice; "
                                 "each layer adds at most one table")
            found[layer % n_layer] = table
    return found


def paired_heads_tuple(paired_heads) -> tuple[int, ...]:
    """GPTConfig.paired_heads as a tuple of ints (a saved config's list too); ValueError (one line) otherwise."""
    if not isinstance(paired_heads, (list, tuple)) or not all(is_int(layer) for layer in paired_heads):
        raise ValueError(f"GPTConfig.paired_heads={paired_heads!r}: must be a tuple of layer indices whose heads are "
                         "paired, e.g. (0, 2, -1); () for none")
    return tuple(int(layer) for layer in paired_heads)


def paired_layers(paired_heads, n_layer: int) -> frozenset[int]:
    """The layers (0 … L−1) GPTConfig.paired_heads names (a negative index counts from the end: −1 is the
    last layer). ValueError (one line) for a layer that does not exist or is named twice."""
    found = [layer % n_layer for layer in paired_heads_tuple(paired_heads) if -n_layer <= layer < n_layer]
    if len(found) < len(paired_heads):
        raise ValueError(f"GPTConfig.paired_heads={tuple(paired_heads)!r}: n_layer={n_layer} has layers 0 … "
                         f"{n_layer - 1} (or −{n_layer} … −1 from the end)")
    if len(set(found)) < len(found):
        raise ValueError(f"GPTConfig.paired_heads={tuple(paired_heads)!r}: a layer is named twice")
    return frozenset(found)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A GPT's shape and choices. Defaults are GPT-2's: learned positions, pre-norm LayerNorm,
    tanh GELU, biases, and the unembedding tied to the token embedding."""

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    d_ff: int | None = None  # hidden width of the FFN; None means 4·d_model
    dropout: float = 0.0
    positions: str = "learned"
    norm: str = "layernorm"
    norm_position: str = "pre"
    parallel_block: bool = False
    activation: str = "gelu"
    bias: bool = True
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    # the attention form (jaxgpt.attention): softmax = softmax(QKᵀ/√D + M)V; linear =
    # φ(q)ᵀS/(φ(q)ᵀz) with the feature map linear_feature; local = softmax over the last
    # `window` positions only (a sliding window: its cache holds `window` slots)
    attention: str = "softmax"
    n_kv_head: int | None = None  # key/value heads, each shared by n_head/n_kv_head query heads; None = n_head
    head_dim: int | None = None  # the size D of each head; None = d_model // n_head
    logits_bias: bool = False  # a learned vector b_U added to the logits
    ffn_layers: int = 1  # hidden layers of the FFN: d → d_ff → … → d_ff → d
    ffn_dropout: float = 0.0  # dropout on the FFN's hidden activations
    init: str = "gpt2"  # "gpt2" | "he" | "small": the weights' initial distributions (model.kernel_std)
    linear_feature: str = "elu+1"  # φ of attention="linear": "elu+1" | "relu"
    window: int | None = None  # attention="local": a query sees itself and the window−1 positions before it
    qk_norm: bool = False  # RMSNorm of each head's query and key (learned gains of size D), before the positions
    logit_softcap: float | None = None  # c: logits c·tanh(z/c), never beyond ±c; None: plain logits
    zero_init_out: bool = False  # the projections into the residual stream and the untied unembedding start at zero
    # value embeddings (jaxgpt.stack): one entry per table VE_k (V, n_kv_head, head_dim), the layers that add it to
    # their values, V ← V + λ·VE[x] (−1: the last layer), e.g. ((0, -3), (1, -2), (2, -1)); () none
    value_embeds: tuple = ()
    unet_skips: bool = False  # the input of layer L−1−i gets w_i times the output of layer i, for i < L//2
    smear: bool = False  # e_t + λ·σ(w·e_t[:12])·e_{t−1}: a gated share of the token before (jaxgpt.previous)
    bigram_table: int = 0  # M > 0: a table of M rows indexed by a hash of (x_{t−1}, x_t), added to e_t; 0: none
    trigram_table: int = 0  # M > 0: a table of M rows indexed by a hash of (x_{t−2}, x_{t−1}, x_t), added to e_t
    # G > 0: each head's context C_h is scaled by σ(x[:G] W_g + b_g)_h, a gate read from the first G features of
    # the attention's input x (modded-nanogpt's attention gate reads 12); 0: no gate
    attn_gate: int = 0
    # w > 0: MUDD-style dense skips (jaxgpt.stack): the input of every layer ℓ ≥ 1 is the last hidden state plus
    # Σ_{j<ℓ} a_ℓj(t)·h_j over the earlier ones (h_0 the embeddings), a_ℓ(t) read from the token's last state by a
    # small MLP of width w (modded-nanogpt's is 64); 0: none
    dense_skips: int = 0
    # the partial key offset: with the positions and QK-norm applied, each key's second half of channels (d ≥ D/2)
    # is the key's of the token before it, in the same example (so one layer can do induction)
    key_offset: bool = False
    # the layers whose heads 2j and 2j+1 attend as one sequence of 2T places, token t's head 2j at place 2t and
    # head 2j+1 at 2t+1 (their queries see each other's keys), e.g. (0, 2, -1); () none
    paired_heads: tuple = ()

    def _resolve_defaults(self):
        """d_ff, head_dim and n_kv_head left as None take the values they mean."""
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        heads_valid = is_int(self.n_head) and self.n_head > 0 and is_int(self.d_model)
        if self.head_dim is None and heads_valid:
            if self.d_model % self.n_head:
                raise ValueError(
                    f"GPTConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}: "
                    f"choose n_head among the divisors of d_model, or set head_dim"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_head)
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)

    def _check_heads(self):
        """n_kv_head dividing n_head; the key offset a bool; paired heads on layers that exist, in pairs of
        heads that each have their own keys."""
        if self.n_head % self.n_kv_head:
            raise ValueError(f"GPTConfig.n_kv_head={self.n_kv_head} does not divide n_head={self.n_head}: "
                             f"choose n_kv_head among the divisors of n_head")
        _check_bool("GPTConfig", "key_offset", self.key_offset)
        object.__setattr__(self, "paired_heads", paired_heads_tuple(self.paired_heads))  # a saved config's list
        if self.paired_heads and self.n_head % 2:
            raise ValueError(f"GPTConfig.paired_heads={self.paired_heads!r} with n_head={self.n_head}: heads are "
                             "paired 2j with 2j+1, so n_head must be even")
        if self.paired_heads and self.n_kv_head != self.n_head:
            raise ValueError(f"GPTConfig.paired_heads={self.paired_heads!r} with n_kv_head={self.n_kv_head}: paired "
                             f"heads read each other's keys, one key head each; set n_kv_head={self.n_head} (or none)")
        paired_layers(self.paired_heads, self.n_layer)

    def __post_init__(self):
        self._resolve_defaults()
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "d_ff", "n_kv_head", "head_dim",
                     "ffn_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name}={value!r}: must be a positive integer")
        for name, valid in (("norm", NORMS), ("norm_position", NORM_POSITIONS), ("init", INITS)):
            check_choice("GPTConfig", name, getattr(self, name), valid)
        for name in ("parallel_block", "bias", "tie_embeddings", "logits_bias", "qk_norm", "zero_init_out", "smear",
                     "unet_skips"):
            _check_bool("GPTConfig", name, getattr(self, name))
        for name in ("dropout", "ffn_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r}: must be in [0, 1)")
        if not self.norm_eps > 0:
            raise ValueError(f"GPTConfig.norm_eps={self.norm_eps!r}: must be positive")
        cap = self.logit_softcap
        if cap is not None and not (is_number(cap) and 0 < cap < float("inf")):
            raise ValueError(f"GPTConfig.logit_softcap={cap!r}: must be None (plain logits) or a positive number, "
                             f"the cap c of c·tanh(z/c) (15 or 30 are usual)")
        self._check_heads()
        object.__setattr__(self, "value_embeds", value_embed_tables(self.value_embeds))  # a saved config's lists
        self._check_stack()
        if self.parallel_block and self.norm_position == "post":
            raise ValueError(
                "GPTConfig.parallel_block=True with norm_position='post': the parallel block is "
                "pre-norm (X + MHA(LN(X)) + FFN(LN(X))); set norm_position='pre'"
            )

    def _check_stack(self):
        """value_embeds on layers that exist, U-net skips with two layers to pair, bigram and trigram
        tables of at least 2 rows, an attention gate that reads features x has, dense skips with a
        width and a second layer."""
        value_embed_layers(self.value_embeds, self.n_layer)
        if self.unet_skips and self.n_layer < 2:
            raise ValueError(f"GPTConfig.unet_skips=True with n_layer={self.n_layer}: a U-net pairs layer i with layer "
                             "L−1−i and needs n_layer ≥ 2; set unet_skips=False or add layers")
        for gram, lacking in (("bigram", "none before"), ("trigram", "fewer than two before")):
            size = getattr(self, f"{gram}_table")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0 or size == 1:
                raise ValueError(f"GPTConfig.{gram}_table={size!r}: must be 0 (no {gram} embedding) or the rows of its "
                                 f"table, at least 2 (one is kept for a token with {lacking}; e.g. 5·vocab_size)")
        gate = self.attn_gate
        if isinstance(gate, bool) or not isinstance(gate, int) or not 0 <= gate <= self.d_model:
            raise ValueError(f"GPTConfig.attn_gate={gate!r}: must be 0 (no attention gate) or the number of the "
                             f"attention input's leading features its gate reads, 1 … d_model={self.d_model} (e.g. 12)")
        width = self.dense_skips
        if isinstance(width, bool) or not isinstance(width, int) or width < 0:
            raise ValueError(f"GPTConfig.dense_skips={width!r}: must be 0 (no dense skips) or the width of the small "
                             "MLP that reads each layer's skip weights, a positive integer (e.g. 64)")
        if width and self.n_layer < 2:
            raise ValueError(f"GPTConfig.dense_skips={width} with n_layer={self.n_layer}: a layer's dense skips read "
                             "the hidden states before its last one, which only a second layer has; set "
                             "dense_skips=0 or add layers")

    def replace(self, **changes) -> GPTConfig:
        """A copy with some fields changed (validated again). d_ff, head_dim and n_kv_head that
        hold their derived values (4·d_model, d_model/n_head, n_head) and are not changed are
        derived again, so replace(n_head=8) gives heads of d_model/8."""
        derived = {"d_ff": 4 * self.d_model, "head_dim": self.d_model // self.n_head, "n_kv_head": self.n_head}
        for name, value in derived.items():
            if name not in changes and getattr(self, name) == value:
                changes[name] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> GPTConfig:
        """Build from a plain dict (e.g. a saved run's config); unknown keys are an error. A
        model section written before the compute settings had their own section is read as
        its identity: its kernel, dtypes, remat and scan_layers are left out (split_model)."""
        return _from_dict(cls, split_model(values)[0])


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
    """How a model runs here (config.compute): none of it changes the function it computes
    (but for rounding, and int8 weights' quantisation), so a run may resume, and a run
    directory may be sampled, with any of it.

    kernel: the softmax attention kernel (jaxgpt.attention.kernels): explicit = ops.attention;
      blocked = the same in query blocks that skip the keys the causal mask hides; xla /
      cudnn = jax.nn.dot_product_attention (cudnn needs a CUDA GPU); flash = Pallas's flash
      attention (a TPU only); auto = the platform's own (flash on a TPU, cudnn on a GPU in
      16 bits, explicit on a CPU), chosen for the devices a run compiles for (on); when a run
      trains with model.dropout > 0, one that applies attention dropout (blocked on a GPU or
      TPU: the fused kernels never form the weights). A kernel chosen by name that cannot
      compute the model as asked is refused (check_kernel).
    remat: recompute attention and the elementwise ops in the backward pass (less memory).
    dtype: the dtype the matmuls compute in. param_dtype: the dtype the parameters are kept
      in (training: also the optimizer's; sampling: the weights are cast to it once).
    scan_layers: the blocks as one nn.scan over params stacked on a leading axis (one block
      compiled whatever n_layer is); blocks.layers_as converts params between the layouts.
    weights: "float" keeps every parameter in param_dtype. "int8" is weight-only quantisation
      for inference: each weight matrix (the Linear kernels and the token embedding, which is
      also the tied unembedding) is int8 with a float32 scale per output channel (quantize.layers),
      a quarter of float32's bytes to read per token; the rest stays in param_dtype. It
      approximates the function (within half a quantisation step per weight), so training
      refuses it; jaxgpt.quantize.params_for makes such params from float ones.
    loss_chunk: 0 computes the logits of a whole batch at once. n > 0 computes the unembedding
      and the cross-entropy n tokens at a time on each device (the batch's tokens padded to a
      whole number of chunks), with the loss's gradient taken chunk by chunk (chunked.chunked_cross_entropy),
      so that no device ever holds the logits of all its tokens, nor their gradient; evaluation and
      the likelihoods read the targets' log-probabilities chunk by chunk too.
    matmul: the form of the weight matrices' products (jaxgpt.platforms.forms.MATMULS): xla = XLA's own
      product and gradient; cpu = 2-D matmuls with a hand-written backward (int8 weights: a chunk
      of rows at a time), measured faster on a CPU; gpu = XLA's, with a product of fewer than 8
      rows (decoding) padded to 8 so that a GPU computes it as a GEMM; auto = cpu on a CPU, gpu on
      a CUDA GPU and xla elsewhere, chosen when the program is lowered for its devices.
    rope: the form of RoPE's rotation (forms.ROPES): pairs = ops.rope on the (…, D/2, 2) pairs;
      lanes = over the whole last axis (a TPU lays out an axis of 2 as 128 lanes); auto = pairs
      on a CPU and lanes elsewhere, chosen when the program is lowered.
    fp8: the weight matmuls computed in FP8 (forms.fp8_matmul: e4m3 operands, an e5m2 gradient, each
      scaled by its current max|·|), a comma-separated string of FP8_MATMULS ("" none): "mlp",
      "attention", "unembed". The params stay as they are; each named matmul runs in the form
      for_matmul gives it. It needs FP8 matrix units (an NVIDIA GPU of compute capability ≥ 8.9),
      checked where a run opens (jaxgpt.train.opening.compute_config); int8 weights refuse it.
    """

    kernel: str = "explicit"
    remat: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = False
    weights: str = "float"
    loss_chunk: int = 0
    matmul: str = "auto"
    rope: str = "auto"
    fp8: str = ""

    def __post_init__(self):
        if not isinstance(self.kernel, str):
            raise ValueError(f"ComputeConfig.kernel={self.kernel!r}: must be a kernel's name, or 'auto'")
        if not (is_int(self.loss_chunk) and self.loss_chunk >= 0):
            raise ValueError(f"ComputeConfig.loss_chunk={self.loss_chunk!r}: must be an integer ≥ 0, the tokens per "
                             f"chunk of the loss on each device (0: the whole logits at once; 4096 is a usual chunk)")
        check_choice("ComputeConfig", "weights", self.weights, WEIGHTS)
        for name in ("matmul", "rope"):  # the forms' names: registries.check_compute
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"ComputeConfig.{name}={getattr(self, name)!r}: must be a form's name, or 'auto'")
        for name in ("dtype", "param_dtype"):
            check_choice("ComputeConfig", name, getattr(self, name), DTYPES)
        for name in ("remat", "scan_layers"):
            _check_bool("ComputeConfig", name, getattr(self, name))
        self._check_fp8()

    def _check_fp8(self):
        """fp8 names weight matmuls (FP8_MATMULS), comma-separated, of float weights."""
        if not isinstance(self.fp8, str):
            raise ValueError(f"ComputeConfig.fp8={self.fp8!r}: must be a comma-separated string of "
                             f"{', '.join(FP8_MATMULS)} ('' for none)")
        unknown = [name for name in self.fp8_matmuls if name not in FP8_MATMULS]
        if unknown:
            raise ValueError(f"ComputeConfig.fp8={self.fp8!r}: {', '.join(map(repr, unknown))} is no weight matmul; "
                             f"name any of {', '.join(FP8_MATMULS)}, comma-separated ('' for none)")
        if self.fp8_matmuls and self.weights != "float":
            raise ValueError(f"ComputeConfig.fp8={self.fp8!r} with weights={self.weights!r}: FP8 matmuls quantise "
                             "float weights as they run; set compute.fp8='' for int8 weights, or weights='float'")

    @property
    def fp8_matmuls(self) -> tuple[str, ...]:
        """The weight matmuls fp8 names, in its order."""
        return tuple(name.strip() for name in self.fp8.split(",") if name.strip())

    def for_matmul(self, name: str) -> ComputeConfig:
        """The compute config the weight matmul `name` (one of FP8_MATMULS) runs with: matmul='fp8'
        (jaxgpt.platforms.forms.fp8_matmul) where fp8 names it, else this one."""
        if name not in FP8_MATMULS:
            raise ValueError(f"ComputeConfig.for_matmul({name!r}): the weight matmuls are {', '.join(FP8_MATMULS)}")
        return self.replace(matmul="fp8") if name in self.fp8_matmuls else self

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> ComputeConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ComputeConfig:
        """Build from a plain dict (e.g. a saved run's compute section); unknown keys are an error."""
        return _from_dict(cls, values)


def split_model(values: dict) -> tuple[dict, dict]:
    """(identity, compute) of a model section. Run directories written before the split kept
    the compute settings in it, and the kernel in `attention` (explicit, blocked, xla, cudnn:
    all the softmax form); those go to the compute side."""
    identity, compute = dict(values), {}
    for key in COMPUTE_KEYS:
        if key in identity:
            compute[key] = identity.pop(key)
    if identity.get("attention") in OLD_KERNELS:
        compute["kernel"] = identity["attention"]
        identity["attention"] = "softmax"
    return identity, compute


def _from_dict(cls, values: dict):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {', '.join(unknown)}; valid fields: "
                         f"{', '.join(sorted(known))}")
    return cls(**values)


def check_choice(owner: str, name: str, value: Any, valid) -> None:
    """A one-line ValueError when `value` is not one of `valid`, naming owner.name and the choices."""
    if value not in valid:
        raise ValueError(f"{owner}.{name}={value!r}: must be one of {', '.join(valid)}")


def _check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name}={value!r}: must be True or False")
