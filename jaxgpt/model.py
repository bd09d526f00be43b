"""The GPT as Flax Linen modules: each owns its parameters and composes the math in `ops`.

    X = E[x] + P            (Embed)
    Y = X + MHA(LN₁(X))     (Block, pre-norm; post-norm and parallel forms are options)
    Z = Y + FFN(LN₂(Y))
    logits = LN_f(Z) W_U    (W_U = Eᵀ when tied)

`GPT(cfg, compute).apply({'params': params}, tokens)` is a pure function of a plain params
pytree: cfg says what the model computes, compute (default: float32, the explicit kernel) how
it runs here. Generation passes an explicit cache in and gets the updated one back.
"""

from __future__ import annotations

import functools
import inspect
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt import layout, ops, previous, programs, stack
from jaxgpt.attention import FORMS, KERNELS, Where, check_window, kernels
from jaxgpt.axes import rows_split
from jaxgpt.blocks import layers_as, stack_layers, unstack_layers  # noqa: F401  (their home before jaxgpt.blocks)
from jaxgpt.model_config import ComputeConfig, GPTConfig
from jaxgpt.platforms import forms
from jaxgpt.positions import SCHEMES
from jaxgpt.quantize.layers import Dense, Int8Embed, Int8Linear
from jaxgpt.registries import check_compute, check_model, compute_on

INIT_STD = 0.02


def normal(std):
    return nn.initializers.normal(stddev=std)


def kernel_std(cfg: GPTConfig, fan_in: int, residual: bool = False) -> float:
    """The std σ of a weight matrix's N(0, σ²) entries under cfg.init:
    gpt2: σ = 0.02, and 0.02/√(2·n_layer) for the projections into the residual stream;
    he: σ = √(2/fan_in) for every matrix; small: σ = √(2/(5·d_model)), divided by √(2·n_layer)
    for the residual projections. fan_in is the matrix's input width."""
    if cfg.init == "he":
        return math.sqrt(2 / fan_in)
    std = INIT_STD if cfg.init == "gpt2" else math.sqrt(2 / (5 * cfg.d_model))
    return std / math.sqrt(2 * cfg.n_layer) if residual else std


def embedding_std(cfg: GPTConfig) -> float:
    """The token and position tables: N(0, 0.02²) under gpt2 and he, N(0, 2/(5·d_model)) under small."""
    return math.sqrt(2 / (5 * cfg.d_model)) if cfg.init == "small" else INIT_STD


# --- modules ------------------------------------------------------------------------------


class Linear(Dense):
    """y = x W + b, with W of shape (input dims…, output dims…): the input dims are the last
    `n_in` axes of x. Computed as one 2-D matmul (`product`; the frame, fields and b are
    jaxgpt.quantize.layers.Dense's).
    W is drawn from N(0, σ²), σ = kernel_std(cfg, fan_in, residual), or is zero at first with
    `zero_init` (cfg.zero_init_out's projections). With compute.weights="int8" the model makes
    jaxgpt.quantize.layers.Int8Linear in its place (`dense`), with the same arguments."""

    @staticmethod
    def product(w: dict, x, compute: ComputeConfig):
        """y = x W for x (..., n), in x's dtype, W the float kernel (n, m) ({'kernel'}): ops.linear
        in compute.matmul's form (jaxgpt.platforms.forms.linear)."""
        return forms.linear(x, w["kernel"].astype(x.dtype), compute.matmul)

    @nn.compact
    def weights(self, in_shape: tuple) -> dict:
        """W as `product` takes it (flattened to (n, m)) and b ('bias'), made here the first time:
        what the untied unembedding gives `unembed`."""
        out_shape = tuple(self.features)
        init = nn.initializers.zeros if self.zero_init else normal(kernel_std(self.cfg, math.prod(in_shape),
                                                                               self.residual))
        kernel = self.param("kernel", layout.declare(init, self.axes, inputs=self.n_in, group=self.group),
                            (*in_shape, *out_shape), self.compute.params_dtype)
        w = {"kernel": kernel.reshape(math.prod(in_shape), math.prod(out_shape))}
        if self.use_bias:
            w["bias"] = self.bias(out_shape)
        return w


def dense(compute: ComputeConfig) -> type[Linear] | type[Int8Linear]:
    """The dense layer that reads compute's weights: Linear, or for weights="int8"
    jaxgpt.quantize.layers.Int8Linear (the same arguments, `weights` and `product`)."""
    return Int8Linear if compute.weights == "int8" else Linear


class Embed(nn.Embed):
    """Flax's nn.Embed, E[x] for a table E (V, d), whose table is also the tied unembedding."""

    def unembedding(self) -> dict:
        """W_U = Eᵀ as Linear.product takes it."""
        return {"kernel": self.embedding.T}


class LayerNorm(nn.Module):
    """γ ⊙ (x − μ)/√(σ² + ε) + β."""

    cfg: GPTConfig
    compute: ComputeConfig
    axis: str = "norm"  # the logical axis of γ and β

    @nn.compact
    def __call__(self, x):
        d, dtype = x.shape[-1], self.compute.params_dtype
        scale = self.param("scale", layout.declare(nn.initializers.ones, (self.axis,)), (d,), dtype)
        bias = self.param("bias", layout.declare(nn.initializers.zeros, (self.axis,)), (d,), dtype) if self.cfg.bias \
            else None
        return ops.layer_norm(x, scale, bias, self.cfg.norm_eps)


class RMSNorm(nn.Module):
    """γ ⊙ x/√(mean(x²) + ε)."""

    cfg: GPTConfig
    compute: ComputeConfig
    axis: str = "norm"  # the logical axis of γ

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", layout.declare(nn.initializers.ones, (self.axis,)), (x.shape[-1],),
                           self.compute.params_dtype)
        return ops.rms_norm(x, scale, self.cfg.norm_eps)


class Dropout(nn.Module):
    """ops.dropout with a key from the 'dropout' RNG stream; the identity when deterministic."""

    rate: float

    @nn.compact
    def __call__(self, x, deterministic: bool):
        if deterministic or self.rate == 0.0:
            return x
        return ops.dropout(x, self.rate, self.make_rng("dropout"))


def make_norm(cfg: GPTConfig, compute: ComputeConfig, name: str) -> nn.Module:
    return {"layernorm": LayerNorm, "rmsnorm": RMSNorm}[cfg.norm](cfg, compute, name=name)


class CausalSelfAttention(nn.Module):
    """MHA(X) = concat_h(softmax(Q_h K_{g(h)}ᵀ/√d_k + M) V_{g(h)}) W_O, with Q, K, V = X W_Q, X W_K, X W_V.

    Q has n_head heads of size D = head_dim, K and V n_kv_head, each shared by n_head/n_kv_head
    query heads: g(h) = ⌊h·n_kv_head/n_head⌋ (g(h) = h for multi-head attention). With qk_norm,
    each head's q and k are RMS-normalised over D (gains q_norm/scale, k_norm/scale of size D,
    shared by the heads) before the positions rotate them. The form
    (cfg.attention: softmax, linear, local) and the kernel that computes it (compute.kernel)
    come from jaxgpt.attention. With value_embed (λ, VE[x]), V ← V + λ·VE[x] (jaxgpt.stack). With
    attn_gate = G, each head's context is scaled by a gate σ(x[:G] W_g + b_g)_h of the token (`gate`).
    With key_offset the form offsets the keys it reads (ops.offset_keys). `paired` (a layer of
    paired_heads; an array of the scan with compute.scan_layers): heads 2j and 2j+1 attend as one
    sequence, rotated at 2p + i (kernels.paired, ops.pair_heads).
    Params: with n_kv_head = n_head, c_attn/kernel (d, 3, H, D)
    (GPT-2's layout); otherwise q_proj/kernel (d, H, D) and kv_proj/kernel (d, 2, H_kv, D).
    c_proj/kernel (H, D, d) is W_O.
    """

    cfg: GPTConfig
    compute: ComputeConfig

    def project(self, x):
        """Q (B, T, H, D), K and V (B, T, H_kv, D)."""
        cfg, compute, Dense = self.cfg, self.compute.for_matmul("attention"), dense(self.compute)
        if cfg.n_kv_head == cfg.n_head:
            qkv = Dense((3, cfg.n_head, cfg.head_dim), ("embed", "qkv", "heads", "head_dim"), cfg, compute,
                        use_bias=cfg.bias, name="c_attn")(x)
            return qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
        q = Dense((cfg.n_head, cfg.head_dim), ("embed", "heads", "head_dim"), cfg, compute, use_bias=cfg.bias,
                  name="q_proj")(x)
        kv = Dense((2, cfg.n_kv_head, cfg.head_dim), ("embed", "kv", "kv_heads", "head_dim"), cfg, compute,
                   use_bias=cfg.bias, name="kv_proj")(x)
        return q, kv[..., 0, :, :], kv[..., 1, :, :]

    def kernel(self, where: Where, deterministic: bool) -> str:
        """compute.kernel, or for 'auto' the platform's kernel that does what this call asks
        (attention dropout when training with it; segments for packed rows)."""
        return compute_on(self.compute, jax.default_backend(), self.cfg, training=not deterministic,
                          packed=where.q_segments is not None).kernel

    def gate(self, x, context):
        """With attn_gate = G: C_h ← σ(x[:G] W_g + b_g)_h · C_h per token (ops.gate_heads), params gate (G, H)
        and gate_bias (H,), scalars (AdamW, no decay) at zero, so every head starts at σ(0) = ½."""
        cfg, dtype = self.cfg, self.compute.params_dtype
        w = self.param("gate", layout.declare(nn.initializers.zeros, ("gate", "heads")), (cfg.attn_gate, cfg.n_head),
                       dtype)
        b = self.param("gate_bias", layout.declare(nn.initializers.zeros, ("heads",)), (cfg.n_head,), dtype)
        return ops.gate_heads(context, x, w, b)

    @nn.compact
    def __call__(self, x, where: Where, layer_cache=None, *, deterministic=True, value_embed=None, paired=False):
        cfg = self.cfg
        scheme = SCHEMES[cfg.positions]
        q, k, v = self.project(x)
        if value_embed is not None:
            v = stack.add_value_embedding(v, *value_embed)
        if cfg.qk_norm:
            q = RMSNorm(cfg, self.compute, axis="head_dim", name="q_norm")(q)
            k = RMSNorm(cfg, self.compute, axis="head_dim", name="k_norm")(k)
        rope = functools.partial(forms.rope, form=self.compute.rope)  # ops.rope in compute.rope's form
        kernel = KERNELS[self.kernel(where, deterministic)]

        def attend(module, q, k, v, where, layer_cache, paired: bool):
            """The form's attention, q and k rotated at their positions: with paired heads, head 2j+i's
            of token t at 2p_t + i, the places of their one sequence (ops.pair_positions)."""
            if paired:
                q, k = scheme.rotate(cfg, ops.pair_heads(q), ops.pair_heads(k), ops.pair_positions(where.q_positions),
                                     rope)
                q, k = ops.unpair_heads(q), ops.unpair_heads(k)
            else:
                q, k = scheme.rotate(cfg, q, k, where.q_positions, rope)

            def on_weights(weights, whole: bool):
                if whole:  # the (T, S) map of all the queries, for pictures (paired: each head's, per token)
                    module.sow("intermediates", "attention_weights", ops.unpair_weights(weights) if paired else weights)
                return Dropout(cfg.dropout)(weights, deterministic)

            return FORMS[cfg.attention].attend(cfg, kernels.paired(kernel) if paired else kernel, q, k, v, where,
                                               layer_cache, lambda w: scheme.bias(cfg, w), on_weights)

        if isinstance(paired, bool):
            context, layer_cache = attend(self, q, k, v, where, layer_cache, paired)
        else:  # a layer of compute.scan_layers: whether it pairs its heads is an array the scan reads
            context, layer_cache = nn.cond(paired, functools.partial(attend, paired=True),
                                           functools.partial(attend, paired=False), self, q, k, v, where, layer_cache)
        if cfg.attn_gate:
            context = self.gate(x, context)
        out = dense(self.compute)((cfg.d_model,), ("heads", "head_dim", "embed"), cfg,
                                  self.compute.for_matmul("attention"), n_in=2,
                                  use_bias=cfg.bias, residual=True, zero_init=cfg.zero_init_out, name="c_proj")
        return out(context), layer_cache


class MLP(nn.Module):
    """FFN(X) = act(X W₁ + b₁) W₂ + b₂; for gated activations X W₁ is [XW, XV] and act halves it.

    With ffn_layers = n: H₁ = act(X W₁ + b₁), H_i = act(H_{i−1} W_i + b_i) for i = 2…n (each
    d_ff → d_ff: params c_fc_2 … c_fc_n), FFN(X) = H_n W_out + b_out (c_proj); ffn_dropout
    applies to each H_i. Gated activations are refused for n > 1 (GPTConfig)."""

    cfg: GPTConfig
    compute: ComputeConfig

    @nn.compact
    def __call__(self, x, deterministic=True):
        cfg, compute, Dense = self.cfg, self.compute.for_matmul("mlp"), dense(self.compute)
        act, drop = ops.ACTIVATIONS[cfg.activation], Dropout(cfg.ffn_dropout)
        width = cfg.d_ff * (2 if cfg.activation in ops.GATED_ACTIVATIONS else 1)
        h = drop(act(Dense((width,), ("embed", "mlp"), cfg, compute, use_bias=cfg.bias, name="c_fc")(x)),
                 deterministic)
        for i in range(2, cfg.ffn_layers + 1):
            h = drop(act(Dense((cfg.d_ff,), ("mlp_in", "mlp"), cfg, compute, use_bias=cfg.bias, name=f"c_fc_{i}")(h)),
                     deterministic)
        return Dense((cfg.d_model,), ("mlp", "embed"), cfg, compute, use_bias=cfg.bias, residual=True,
                     zero_init=cfg.zero_init_out, name="c_proj")(h)


class Block(nn.Module):
    """Pre-norm:  Y = X + MHA(LN₁(X)),  Z = Y + FFN(LN₂(Y))
    Post-norm: Y = LN₁(X + MHA(X)),  Z = LN₂(Y + FFN(Y))
    Parallel:  Z = X + MHA(LN₁(X)) + FFN(LN₁(X))
    value_embed (λ, VE[x]) joins the attention's values (jaxgpt.stack); paired: its attention pairs
    its heads (a layer of paired_heads; CausalSelfAttention)."""

    cfg: GPTConfig
    compute: ComputeConfig

    @nn.compact
    def __call__(self, x, where: Where, layer_cache=None, deterministic=True, value_embed=None, paired=False):
        cfg, compute = self.cfg, self.compute
        ln_1 = make_norm(cfg, compute, "ln_1")
        attn, mlp = CausalSelfAttention(cfg, compute, name="attn"), MLP(cfg, compute, name="mlp")
        drop = lambda h: Dropout(cfg.dropout)(h, deterministic)  # noqa: E731
        mha = lambda h: attn(h, where, layer_cache, deterministic=deterministic, value_embed=value_embed,  # noqa: E731
                             paired=paired)
        ffn = lambda h: mlp(h, deterministic)  # noqa: E731

        if cfg.parallel_block:
            h = ln_1(x)
            a, layer_cache = mha(h)
            return x + drop(a) + drop(ffn(h)), layer_cache
        ln_2 = make_norm(cfg, compute, "ln_2")
        if cfg.norm_position == "pre":
            a, layer_cache = mha(ln_1(x))
            y = x + drop(a)
            return y + drop(ffn(ln_2(y))), layer_cache
        a, layer_cache = mha(x)
        y = ln_1(x + drop(a))
        return ln_2(y + drop(ffn(y))), layer_cache


def locate(tokens, cache, positions=None, segments=None):
    """(positions (B, T), the Where of the blocks, the cache with the new tokens' places
    written) for tokens (B, T): positions default to 0…T−1, after a cache cache.index…"""
    if cache is not None:
        return cache.locate(tokens, positions, segments)
    if positions is None:
        positions = jnp.arange(tokens.shape[-1])[None, :]
    return positions, Where(positions, positions, segments, segments), cache


def argnums(method, *names: str) -> tuple[int, ...]:
    """The positions of `method`'s parameters `names`, self counted (what nn.remat's static_argnums index)."""
    parameters = list(inspect.signature(method).parameters)
    return tuple(parameters.index(name) for name in names)


class GPT(nn.Module):
    """tokens (B, T) → logits (B, T, V) = LN_f(Blocks(E[x] + P)) W_U (+ b_U with logits_bias), soft-capped
    to c·tanh(logits/c) with logit_softcap = c.

    positions (B, T): each token's position, default 0…T−1 (with a cache: cache.index …
    cache.index+T−1). segments (B, T): with several examples packed in a row, the example
    each token belongs to (their positions restart at 0): attention is causal within an
    example and never crosses into another. None: the row is one sequence.

    With `cache` (jaxgpt.attention.init_cache), the tokens join it (the softmax form writes
    their keys, values, positions and segments into the slots cache.index …; the linear form
    absorbs them into its state; the local form keeps the last `window`), and `(logits,
    new_cache)` is returned. With compute.scan_layers the blocks are one nn.scan over
    params["h"] (see layers_as). Dropout is applied only when deterministic=False and a
    'dropout' RNG is given.

    hidden=True returns (LN_f(Z) (B, T, d), the unembedding's weights) instead of the logits,
    their `unembed`: for a loss that makes them a chunk of tokens at a time (jaxgpt.loss).

    value_rows (K, B, T, H_kv, D): the value tables' rows of these tokens, looked up before
    (stack.looked_up), the tables then not read: the train step looks up a whole step's once,
    outside its loop of micro-batches. None: looked up here.

    window w (no cache): every layer's query sees itself and the w − 1 positions before it, not the
    whole row: a window schedule's training step (train.window_schedule). The softmax form without
    paired heads only (window_conflict).
    """

    cfg: GPTConfig
    compute: ComputeConfig = ComputeConfig()

    def __post_init__(self):
        """A name the registries do not hold is refused in one line when the model is made."""
        check_model(self.cfg)
        check_compute(self.compute)
        super().__post_init__()

    def init(self, rngs, *args, **kwargs):
        """Flax's init, with every parameter a plain array. Each was made with its declaration
        (jaxgpt.layout.declare), which param_layout reads; one made without is refused here.
        The layout is how the model runs, not what it is: with scan_layers the params are the
        per-layer init's, stacked, so a seed gives the same weights in either layout."""
        if self.compute.scan_layers:
            per_layer = self.clone(compute=self.compute.replace(scan_layers=False)).init(rngs, *args, **kwargs)
            return {**per_layer, "params": stack_layers(per_layer["params"])}
        variables = super().init(rngs, *args, **kwargs)
        layout.check(variables["params"])
        return nn.meta.unbox(variables)

    @nn.compact
    def __call__(self, tokens, cache=None, *, positions=None, segments=None, deterministic: bool = True,
                 hidden: bool = False, value_rows=None, window: int | None = None):
        cfg, compute = self.cfg, self.compute
        deterministic = deterministic or not self.has_rng("dropout")
        before, (positions, where, cache) = cache, locate(tokens, cache, positions, segments)
        if window is not None:  # a query sees itself and the window − 1 positions before (ops.window_mask)
            where = where._replace(window=check_window(cfg, window, cache))
        init, dtypes = normal(embedding_std(cfg)), (compute.compute_dtype, compute.params_dtype)
        if compute.weights == "int8":
            wte = Int8Embed(cfg.vocab_size, cfg.d_model, dtypes[0], name="wte")
        else:
            wte = Embed(cfg.vocab_size, cfg.d_model, embedding_init=layout.declare(init, ("vocab", "embed"),
                                                                                   group="embed"),
                        dtype=dtypes[0], param_dtype=dtypes[1], name="wte")

        def position_table(rows: int) -> nn.Embed:
            table = layout.declare(init, ("positions", "embed"), group="embed")
            return nn.Embed(rows, cfg.d_model, embedding_init=table, dtype=dtypes[0], param_dtype=dtypes[1], name="wpe")

        e = previous.PreviousToken(cfg, compute, name="previous")(wte, tokens, positions, where.q_segments, before)
        x = rows_split(SCHEMES[cfg.positions].embed(cfg, e, positions, position_table))
        x = self.perturb("embeddings", x)  # a zero 'perturbations' entry: its gradient is ∂/∂X
        x = Dropout(cfg.dropout)(x, deterministic)
        x, new_layers = self.blocks(x, tokens, where, cache, positions, deterministic, value_rows)

        x = make_norm(cfg, compute, "ln_f")(x)
        head = self.unembedding(wte)
        out = (x, head) if hidden else unembed(cfg, compute, head, x)
        return out if cache is None else (out, cache.with_layers(new_layers, tokens.shape[-1]))

    def unembedding(self, wte) -> dict:
        """The unembedding's weights as `unembed` takes them: W_U (Eᵀ when tied) and b_U ('bias')."""
        cfg, compute = self.cfg, self.compute
        if not cfg.tie_embeddings:
            lm_head = dense(compute)((cfg.vocab_size,), ("embed", "vocab"), cfg, compute, group="head",
                                     use_bias=False, zero_init=cfg.zero_init_out, name="lm_head")
            head = lm_head.weights((cfg.d_model,))
        else:  # W_U = Eᵀ
            head = wte.unembedding()
        if cfg.logits_bias:
            head["bias"] = self.param("logits_bias", layout.declare(nn.initializers.zeros, ("vocab",)),
                                      (cfg.vocab_size,), compute.params_dtype)
        return head

    def blocks(self, x, tokens, where: Where, cache, positions, deterministic: bool, value_rows=None):
        """The n_layer blocks, each with its layer of the cache, and the paths around them
        (jaxgpt.stack: value embeddings, U-net and dense skips): (x, the layers' new caches)."""
        cfg, compute = self.cfg, self.compute
        # With remat, a block keeps only its weight-matmul outputs for the backward pass and
        # recomputes attention and the elementwise ops from them.
        # In the loop a block's `paired` is a Python bool (static); the scan reads it from an array.
        static = ("deterministic",) if compute.scan_layers else ("deterministic", "paired")
        block = nn.remat(Block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                         static_argnums=argnums(Block.__call__, *static)) if compute.remat else Block
        layer_caches = [None if cache is None else cache.layer(layer, positions) for layer in range(cfg.n_layer)]
        return stack.blocks(block, cfg, compute, x, tokens, where, layer_caches, deterministic,
                            normal(embedding_std(cfg)), value_rows)


def unembed(cfg: GPTConfig, compute: ComputeConfig, head: dict, x):
    """logits = x W_U (+ b_U), float32, soft-capped to c·tanh(logits/c) with logit_softcap = c, for
    x (..., d) the final norm's output and head the unembedding's weights (GPT.unembedding): the one
    place logits are made, for the whole batch (GPT) or a chunk of its tokens (the chunked loss); in
    FP8 where compute.fp8 names "unembed"."""
    logits = dense(compute).product(head, rows_split(x).astype(compute.compute_dtype), compute.for_matmul("unembed"))
    if "bias" in head:  # b_U
        logits = logits + head["bias"]
    logits = logits.astype(jnp.float32)
    if cfg.logit_softcap is not None:  # c·tanh(z/c)
        logits = ops.softcap(logits, cfg.logit_softcap)
    return rows_split(logits)


# --- sizes ----------------------------------------------------------------------------------


def param_layout(model: GPT | GPTConfig):
    """Every parameter's declaration (jaxgpt.layout.Declared around its ShapeDtypeStruct), in
    the params' tree: what shardings, groups, Muon's axes and the quantisation derive from.
    Nothing is computed (jax.eval_shape of Flax's init, traced once per config and compute);
    refused for an undeclared parameter."""
    model = GPT(model) if isinstance(model, GPTConfig) else model
    return jax.tree.map(lambda leaf: leaf, _declared(model.cfg, model.compute), is_leaf=layout.is_declared)


@functools.lru_cache(maxsize=16)
def _declared(cfg: GPTConfig, compute: ComputeConfig):
    """The declarations, traced once per config and compute in a process; within programs.keeping,
    once per code and settings (kept beside the compiled programs)."""
    return programs.kept_value(repr(("declared", cfg, compute)), lambda: _traced_declarations(cfg, compute))


def _traced_declarations(cfg: GPTConfig, compute: ComputeConfig):
    model = GPT(cfg, compute)
    tokens = jax.ShapeDtypeStruct((1, cfg.block_size), jnp.int32)  # a whole row, as training's init: any kernel
    declared = jax.eval_shape(lambda t: nn.Module.init(model, jax.random.key(0), t)["params"], tokens)
    layout.check(declared)
    return declared


def param_shapes(model: GPT | GPTConfig) -> dict:
    """The params' shapes and dtypes, as GPT.init makes them in the model's layout and param_dtype:
    param_layout's values (nothing is computed)."""
    return jax.tree.map(lambda leaf: leaf.value, param_layout(model), is_leaf=layout.is_declared)


def param_count(cfg: GPTConfig) -> int:
    """The number of parameters, counted on the initialised shapes."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(param_shapes(cfg)))


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weight matmuls (forward 2N, backward 4N) plus
    12·n_layer·n_head·head_dim·seq_len for QKᵀ and AV (a layer of paired_heads counts twice: its H/2
    sequences of 2T places hold 2·H·T² scores). N counts parameters used in matmuls: all but
    the lookup tables (their declared group: lookups cost no FLOPs), the token table counted back
    when no unembedding of its own is declared (tied: logits = x Eᵀ)."""
    declared = jax.tree.leaves(param_layout(cfg), is_leaf=layout.is_declared)
    sizes = [(leaf.group, leaf.names, math.prod(leaf.value.shape)) for leaf in declared]
    n = sum(size for group, _, size in sizes if group != "embed")
    if not any(group == "head" for group, _, _ in sizes):
        n += sum(size for group, names, size in sizes if group == "embed" and names == ("vocab", "embed"))
    span = seq_len if cfg.window is None else min(seq_len, cfg.window)  # the keys a query reads, at most
    return 6 * n + 12 * (cfg.n_layer + len(cfg.paired_heads)) * cfg.n_head * cfg.head_dim * span
