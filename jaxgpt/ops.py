"""The mathematics of a GPT as pure functions of arrays.

One function per equation, no parameters and no Flax: `model.py` owns the parameters and
composes these. Shape letters: B batch, T query positions, S key positions, H heads,
D head size, d model width, V vocabulary.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

# --- linear maps ------------------------------------------------------------------------


def linear(x, w):
    """y = x W for x (..., n) and W (n, m): 'Nn,nm->Nm' over all leading positions N."""
    return dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """jax.lax.dot_general, and on a CPU, for the plain contraction y = x W (lhs's last k axes
    against rhs's first k, no batch axes), `_cpu_matmul` of the two flattened to matrices.

    The platform is chosen when the program is lowered, so a program lowered for a GPU or TPU
    (even on a CPU host) is XLA's own dot_general and gradient. The model's float weight
    matmuls reach it through `linear` (model.Linear and the tied unembedding)."""
    library = functools.partial(jax.lax.dot_general, dimension_numbers=dimension_numbers, precision=precision,
                                preferred_element_type=preferred_element_type)
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    k = len(lhs_contract)
    plain = (not lhs_batch and not rhs_batch and tuple(lhs_contract) == tuple(range(lhs.ndim - k, lhs.ndim))
             and tuple(rhs_contract) == tuple(range(k)))
    if not plain:
        return library(lhs, rhs)

    def on_cpu(lhs, rhs):
        rows, inner = lhs.shape[:lhs.ndim - k], lhs.shape[lhs.ndim - k:]
        x = lhs.reshape(math.prod(rows), math.prod(inner))
        w = rhs.reshape(math.prod(inner), math.prod(rhs.shape[k:]))
        return _cpu_matmul(x, w, precision, preferred_element_type).reshape(*rows, *rhs.shape[k:])

    return jax.lax.platform_dependent(lhs, rhs, cpu=on_cpu, default=library)


# CPU only: with this gradient the CPU recipe's train step (configs/shakespeare_char_cpu.py,
# 12×64 tokens on 2 devices) takes 0.52× the time it takes with XLA's own gradient of x @ w
# (median ratio of 9 interleaved pairs of 100 steps; 0.47× in another run of 7) on a 2-core
# Intel Xeon. No other backend has been measured, so the others use XLA's.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cpu_matmul(x, w, precision, preferred_element_type):
    """Y = X W for X (N, n) and W (n, m)."""
    return jax.lax.dot(x, w, precision=precision, preferred_element_type=preferred_element_type)


def _cpu_matmul_forward(x, w, precision, preferred_element_type):
    return _cpu_matmul(x, w, precision, preferred_element_type), (x, w)


def _cpu_matmul_backward(precision, preferred_element_type, residuals, dy):
    """∂L/∂X = dY Wᵀ and ∂L/∂W = Xᵀ dY, with dY materialised first: XLA on a CPU otherwise
    fuses the producer of dY (e.g. the GELU backward) into a transposed copy that runs
    several times slower than the matmuls themselves."""
    x, w = residuals
    dy = jax.lax.optimization_barrier(dy)
    dx = jnp.matmul(dy, w.T, precision=precision, preferred_element_type=x.dtype)
    dw = jnp.matmul(x.T, dy, precision=precision, preferred_element_type=w.dtype)
    return dx, dw


_cpu_matmul.defvjp(_cpu_matmul_forward, _cpu_matmul_backward)


# --- masks and attention ---------------------------------------------------------------


def position_mask(q_positions, k_positions):
    """M[..., t, s] = (k_pos[s] ≤ q_pos[t]): a query sees keys at its own position or earlier."""
    return k_positions[..., None, :] <= q_positions[..., :, None]


def segment_mask(q_segments, k_segments):
    """M[..., t, s] = (seg_k[s] = seg_q[t]): a query sees only keys of its own segment, so
    examples packed in one row never attend to each other."""
    return k_segments[..., None, :] == q_segments[..., :, None]


def window_mask(q_positions, k_positions, window: int):
    """M[..., t, s] = (q_pos[t] − k_pos[s] < w): a query sees only the w − 1 positions before
    its own (and later ones, which the causal mask hides): a sliding window."""
    return q_positions[..., :, None] - k_positions[..., None, :] < window


def causal_mask(n):
    """M[i, j] = (j ≤ i): True on and below the diagonal, shape (n, n)."""
    positions = jnp.arange(n)
    return position_mask(positions, positions)


def attention_weights(q, k, mask=None, bias=None):
    """A = softmax(QKᵀ/√d_k + bias + M), with M = −∞ where mask is False; 'BTHD,BSHD->BHTS'.

    mask and bias broadcast to (B, H, T, S). Scores and softmax are computed in float32.
    """
    scores = jnp.einsum("BTHD,BSHD->BHTS", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1)


def attend(weights, v):
    """Context vectors C = A V, 'BHTS,BSHD->BTHD'."""
    return jnp.einsum("BHTS,BSHD->BTHD", weights.astype(v.dtype), v)


def attention(q, k, v, mask=None, bias=None):
    """Multi-head attention softmax(QKᵀ/√d_k + M) V for q (B,T,H,D), k and v (B,S,H,D) → (B,T,H,D)."""
    return attend(attention_weights(q, k, mask, bias), v)


def share_kv_heads(kv, n_head):
    """Grouped-query attention: K_h = K_{⌊h/g⌋}, g = n_head/n_kv_head, for kv (B,S,H_kv,D) → (B,S,H,D):
    each of the H_kv key/value heads serves g consecutive query heads."""
    return jnp.repeat(kv, n_head // kv.shape[-2], axis=-2)


# --- linear attention ------------------------------------------------------------------

LINEAR_EPS = 1e-6  # keeps φ(q)ᵀz + ε > 0: with φ = relu, φ(q)ᵀz can be exactly 0


def elu_plus_one(x):
    """φ(x) = elu(x) + 1 (> 0 everywhere)."""
    return jax.nn.elu(x) + 1.0


FEATURE_MAPS = {"elu+1": elu_plus_one, "relu": jax.nn.relu}


def linear_attention(fq, fk, v, mask, state=None):
    """Linear attention, the parallel causal form: for features fq = φ(Q) (B,T,H,D), fk = φ(K)
    and v (B,S,H_kv,E), out_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + ε) with S_t = Σ_{s≤t} φ(k_s) v_sᵀ and
    z_t = Σ_{s≤t} φ(k_s), computed as (A V) / (A 1 + ε), A = (φ(Q) φ(K)ᵀ) ⊙ M, 'BTHD,BSHD->BHTS'.

    `state` = (S₀ (B,H_kv,D,E), z₀ (B,H_kv,D)) sums over earlier tokens (decoding): the numerator
    gains φ(q_t)ᵀ S₀ and the denominator φ(q_t)ᵀ z₀. Sums are in float32."""
    n_head = fq.shape[2]
    fk, v = share_kv_heads(fk, n_head), share_kv_heads(v, n_head)
    scores = jnp.einsum("BTHD,BSHD->BHTS", fq, fk, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores, 0.0)
    numerator = jnp.einsum("BHTS,BSHE->BTHE", scores, v.astype(jnp.float32))
    denominator = scores.sum(axis=-1).transpose(0, 2, 1)  # (B, T, H)
    if state is not None:
        S, z = (jnp.repeat(part, n_head // part.shape[1], axis=1) for part in state)
        numerator = numerator + jnp.einsum("BTHD,BHDE->BTHE", fq.astype(jnp.float32), S)
        denominator = denominator + jnp.einsum("BTHD,BHD->BTH", fq.astype(jnp.float32), z)
    return (numerator / (denominator[..., None] + LINEAR_EPS)).astype(v.dtype)


def linear_attention_state(fk, v, absorb, state):
    """The state after the tokens with absorb (B,S) True: S' = S + Σ_s φ(k_s) v_sᵀ, z' = z + Σ_s φ(k_s),
    for fk (B,S,H_kv,D), v (B,S,H_kv,E) and state (S (B,H_kv,D,E), z (B,H_kv,D)), in float32."""
    fk = jnp.where(absorb[:, :, None, None], fk.astype(jnp.float32), 0.0)
    S, z = state
    return S + jnp.einsum("BSGD,BSGE->BGDE", fk, v.astype(jnp.float32)), z + fk.sum(axis=1)


# --- normalisation ----------------------------------------------------------------------


def layer_norm(x, scale, bias=None, eps=1e-5):
    """LN(x) = γ ⊙ (x − μ)/√(σ² + ε) + β over the last axis, σ² the biased variance."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(axis=-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype)


def rms_norm(x, scale, eps=1e-6):
    """RMSNorm(x) = γ ⊙ x/√(mean(x²) + ε) over the last axis."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(axis=-1, keepdims=True) + eps) * scale
    return y.astype(x.dtype)


# --- activations (the FFN non-linearity) ------------------------------------------------


def gelu(x):
    """GELU, tanh approximation: ½x(1 + tanh(√(2/π)(x + 0.044715x³)))."""
    return jax.nn.gelu(x, approximate=True)


def gelu_exact(x):
    """GELU(x) = x Φ(x) = ½x(1 + erf(x/√2))."""
    return jax.nn.gelu(x, approximate=False)


def relu(x):
    """ReLU(x) = max(0, x)."""
    return jax.nn.relu(x)


def relu_squared(x):
    """ReLU²(x) = max(0, x)²."""
    return jnp.square(jax.nn.relu(x))


def silu(x):
    """SiLU (Swish, β = 1): silu(x) = x σ(x), σ(x) = 1/(1 + e^(−x))."""
    return jax.nn.silu(x)


def swiglu(x):
    """SwiGLU([a, b]) = silu(a) ⊙ b, a and b the two halves of the last axis (XW and XV)."""
    a, b = jnp.split(x, 2, axis=-1)
    return jax.nn.silu(a) * b


def geglu(x):
    """GeGLU([a, b]) = gelu(a) ⊙ b, a and b the two halves of the last axis (XW and XV)."""
    a, b = jnp.split(x, 2, axis=-1)
    return gelu(a) * b


def glu(x):
    """GLU([a, b]) = σ(a) ⊙ b, a and b the two halves of the last axis (XW and XV)."""
    a, b = jnp.split(x, 2, axis=-1)
    return jax.nn.sigmoid(a) * b


# the gated ones halve their input (XW and XV side by side); the one list of each kind
GATED_ACTIVATIONS = {"swiglu": swiglu, "geglu": geglu, "glu": glu}
ACTIVATIONS = {"gelu": gelu, "gelu_exact": gelu_exact, "relu": relu, "relu2": relu_squared, "silu": silu,
               **GATED_ACTIVATIONS}

# --- positions ---------------------------------------------------------------------------


def sinusoidal_positions(n, d):
    """PE[i, 2j] = sin(i/10000^(2j/d)), PE[i, 2j+1] = cos(i/10000^(2j/d)), i = 0…n−1; shape (n, d)."""
    i = jnp.arange(n, dtype=jnp.float32)[:, None]
    two_j = jnp.arange(0, d, 2, dtype=jnp.float32)[None, :]
    angles = i / jnp.power(10000.0, two_j / d)
    pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(n, -1)
    return pe[:, :d]


def rope(x, positions, base=10000.0):
    """RoPE: rotate each pair (x_{2j}, x_{2j+1}) by the angle p·base^(−2j/D); x (B,T,H,D), positions (B,T) or (T,)."""
    d = x.shape[-1]
    inv_freq = jnp.power(base, -jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = jnp.asarray(positions, jnp.float32)[..., None, None] * inv_freq  # (B,T,1,D/2)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], d // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def alibi_slopes(n_head):
    """ALiBi head slopes m_h = 2^(−8h/H), h = 1…H; for H not a power of two, the closest
    power of two's slopes followed by every other slope of twice that many heads."""
    def geometric(n):
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    power = 2 ** math.floor(math.log2(n_head))
    slopes = geometric(power)
    if power < n_head:
        slopes += geometric(2 * power)[0::2][: n_head - power]
    return jnp.asarray(slopes, jnp.float32)


def alibi_bias_at(n_head, q_positions, k_positions):
    """ALiBi bias b[h, t, s] = −m_h (q_pos[t] − k_pos[s]); positions (..., T) and (..., S) → (..., H, T, S)."""
    distance = q_positions[..., :, None] - k_positions[..., None, :]
    slopes = alibi_slopes(n_head)[:, None, None]
    return -slopes * distance[..., None, :, :].astype(jnp.float32)


def alibi_bias(n_head, n):
    """ALiBi bias b[h, i, j] = −m_h (i − j) for a sequence of n positions; shape (H, n, n)."""
    positions = jnp.arange(n)
    return alibi_bias_at(n_head, positions, positions)


# --- regularisation -----------------------------------------------------------------------


def dropout(x, rate, key):
    """Dropout: x ⊙ m/(1−p), m_i ~ Bernoulli(1−p): each element zeroed with probability p.

    m is jax.random.bernoulli's. Under JAX's partitionable threefry (its default,
    jax_threefry_partitionable) an element's bits depend only on the key and the element's
    index, so a sharded x's mask is drawn by each device for its own shard, and it is the
    same mask as on one device."""
    if rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


# --- logits ------------------------------------------------------------------------------


def softcap(logits, cap):
    """Soft-capped logits c·tanh(z/c): close to z where |z| ≪ c, never beyond ±c."""
    return cap * jnp.tanh(logits / cap)


# --- loss ---------------------------------------------------------------------------------


def cross_entropy(logits, targets, mask=None, count=None):
    """L = −(1/N) Σ_i m_i log softmax(logits_i)[y_i]: the mean over the targets where the mask
    m is True (all of them without one). N = Σ_i m_i, or `count` when given: the masked targets
    of a whole batch these logits are a part of, so the losses of its parts add up to its
    mean (gradient accumulation weighs every target alike, however the mask falls)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    mask = jnp.ones(nll.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    count = mask.sum() if count is None else count
    return (nll * mask).sum() / jnp.maximum(count, 1.0)


def target_scores(logits, targets):
    """(log softmax(z_i)[y_i] = z_i[y_i] − log Σ_v exp(z_i[v]), [y_i = argmax_v z_i[v]]) of each
    target y_i, for logits z (..., V) and targets (...): its log-probability, and whether it is the
    likeliest token. Computed in float32."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == targets


def target_logit(logits, targets):
    """z[y] = Σ_v z[v]·[v = y] for logits z (..., V), targets y (...): a reduction XLA fuses with the others
    that read z. In the chunked loss a gather had XLA write each chunk's logits in float32 too (GPT-2 small,
    v5e: 2.54 → 1.89 GB accessed a 2048-token chunk); a CPU evaluates a whole batch 6% faster by gather."""
    return jnp.where(jnp.arange(logits.shape[-1]) == targets[..., None], logits, 0.0).sum(axis=-1)


def perplexity(loss):
    """PPL = exp(L)."""
    return jnp.exp(loss)


# --- the loss a chunk of tokens at a time ----------------------------------------------------
# logits_fn(weights, h) → z: the logits (n, V), float32, of hidden states h (n, d) under the unembedding's
# weights (a pytree). Neither pass ever holds the (N, V) logits of all N tokens: only one chunk's.


def as_chunks(x, chunk: int, fill=0):
    """x (N, …) as (M, chunk, …), M = ⌈N/chunk⌉, padded with `fill` to M·chunk rows: chunk j
    holds the rows a·M + j (a = 0…chunk−1), every M-th row from the j-th. Rows split over
    devices in order stay so: each chunk takes chunk/devices rows of every device's share."""
    M = -(-x.shape[0] // chunk)
    x = jnp.pad(x, [(0, M * chunk - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
    return x.reshape(chunk, M, *x.shape[1:]).swapaxes(0, 1)


def from_chunks(x, n: int):
    """The inverse of as_chunks: x (M, chunk, …) → its first n rows (n, …) in their order."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])[:n]


def chunked_target_scores(logits_fn, weights, hidden, targets, *, chunk: int):
    """target_scores of the logits z = logits_fn(weights, h) of hidden states (..., d), chunk
    tokens at a time: (log p(y_i), [y_i = argmax z_i]) of each target (...), forward only."""
    n, shape = targets.size, targets.shape
    h, y = as_chunks(hidden.reshape(n, -1), chunk), as_chunks(targets.reshape(n), chunk)
    scores = jax.lax.map(lambda c: target_scores(logits_fn(weights, c[0]), c[1]), (h, y))
    return tuple(from_chunks(s, n).reshape(shape) for s in scores)


def chunked_cross_entropy(logits_fn, weights, hidden, targets, mask=None, count=None, *, chunk: int):
    """cross_entropy(logits_fn(weights, hidden), targets, mask, count), the logits computed
    `chunk` tokens at a time (the tokens padded, unmasked, to a multiple of chunk), for K targets y_ik per token:

        L = (1/N) Σ_i Σ_k m_ik (log Σ_v exp z_i[v] − z_i[y_ik]),   z_i = logits_fn(weights, h_i)

    with the gradient ∂L/∂z_i = Σ_k (m_ik/N)(softmax(z_i) − e_{y_ik}) taken back to h_i and to the
    weights through logits_fn's own derivative, chunk by chunk (the weights' terms summed in
    float32). Under differentiation the gradient is computed in the forward pass, while each
    chunk's logits exist: the same matmuls as the whole logits' (no chunk's logits computed
    twice), and the backward pass only scales it by L's cotangent. hidden (..., d), targets and
    mask (...), or (..., K) with K targets per token (multi-token prediction; K = 1 without the axis)."""
    n = hidden.size // hidden.shape[-1]
    mask = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    count = mask.sum() if count is None else count
    return _chunked_loss(logits_fn, chunk, weights, hidden.reshape(n, -1), targets.reshape(n, -1), mask.reshape(n, -1),
                         jnp.maximum(count, 1.0).astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_loss(logits_fn, chunk, weights, hidden, targets, mask, count):
    """L of hidden (N, d), targets and mask (N, K) (chunked_cross_entropy), forward only."""
    def step(total, c):
        h, y, m = c
        z = logits_fn(weights, h)
        return total + (m * (jax.nn.logsumexp(z, axis=-1)[:, None] - target_logit(z[:, None], y))).sum(), None

    chunks = tuple(as_chunks(x, chunk) for x in (hidden, targets, mask))
    return jax.lax.scan(step, jnp.zeros((), jnp.float32), chunks)[0] / count


def _chunked_loss_forward(logits_fn, chunk, weights, hidden, targets, mask, count):
    """(L, (∂L/∂weights, ∂L/∂hidden)): each chunk's logits z, their gradient Σ_k (m_ik/N)(softmax(z_i) − e_{y_ik})
    and its pullback through logits_fn, in one pass."""
    def step(carry, c):
        total, grad_w = carry
        h, y, m = c
        z, pullback = jax.vjp(logits_fn, weights, h)
        lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
        dz = ((jnp.exp(z - lse)[:, None] - jax.nn.one_hot(y, z.shape[-1], dtype=z.dtype)) * m[..., None]).sum(1)
        dw, dh = pullback(dz)
        grad_w = jax.tree.map(lambda sum_w, part: sum_w + part.astype(jnp.float32), grad_w, dw)
        return (total + (m * (lse - target_logit(z[:, None], y))).sum(), grad_w), dh

    chunks = tuple(as_chunks(x, chunk) for x in (hidden, targets, mask / count))
    zeros = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), weights)
    (total, grad_w), grad_h = jax.lax.scan(step, (jnp.zeros((), jnp.float32), zeros), chunks)
    grad_w = jax.tree.map(lambda g, w: g.astype(w.dtype), grad_w, weights)
    return total, (grad_w, from_chunks(grad_h, hidden.shape[0]))


def _chunked_loss_backward(logits_fn, chunk, grads, cotangent):
    """The gradients of the forward pass times L's cotangent; none for the targets, mask and count."""
    scaled = jax.tree.map(lambda g: (cotangent * g).astype(g.dtype), grads)
    return *scaled, None, None, None


_chunked_loss.defvjp(_chunked_loss_forward, _chunked_loss_backward)


# --- weight-only int8 quantisation (inference) ---------------------------------------------
# A matrix is kept outputs first, W (*out, *in), as the token embedding E (V, d) already is
# for the unembedding: each output channel o is one contiguous row W_o.

INT8_MAX = 127


def quantize(w, n_in: int = 1):
    """Symmetric per-output-channel int8 quantisation of W (*out, *in), its last n_in axes the
    inputs: s_o = max_i |W_oi| / 127 (1 for an all-zero channel), q_oi = round(W_oi / s_o) ∈
    [−127, 127]. Returns (q int8 (*out, *in), s float32 (*out)): |q_oi·s_o − W_oi| ≤ s_o/2."""
    w32 = w.astype(jnp.float32)
    inputs = tuple(range(w.ndim - n_in, w.ndim))
    peak = jnp.max(jnp.abs(w32), axis=inputs)
    scale = jnp.where(peak > 0, peak / INT8_MAX, 1.0)
    q = jnp.round(w32 / scale.reshape(*scale.shape, *(1,) * n_in))
    return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def dequantize(q, scale):
    """W_oi ≈ q_oi · s_o for q (*out, *in) and s (*out), in float32."""
    return q.astype(jnp.float32) * scale.reshape(*scale.shape, *(1,) * (q.ndim - scale.ndim)).astype(jnp.float32)


# The int8 elements of one chunk of rows that one fused product reads on a CPU (4 MiB): GPT-2
# small's decoding step took 14.9 ms with it, 16.1 ms with 1 MiB chunks and 27.4 ms in float32
# (2-core Intel Xeon, differences of 32- and 160-token greedy runs).
INT8_CHUNK_ELEMENTS = 1 << 22


def int8_linear(x, q, scale):
    """y = x Wᵀ with W = dequantize(q, s), for x (N, n), q (m, n), s (m,): y_o = s_o Σ_i x_i q_oi,
    'Nn,mn->Nm', accumulated in float32 and returned in x's dtype.

    On a CPU, XLA converts a whole int8 operand of a dot to float32 before the dot, so each
    decoding step would write and read a float32 copy of every matrix. Here a loop takes the
    rows a chunk at a time, and for one row of x XLA fuses the chunk's conversion into a
    matrix-vector product that reads the int8 bytes themselves. The loop keeps x a
    parameter of that product: unrolled, XLA would fuse x's producers (the norm before a
    projection) into each product and compute them again for every output element."""
    def product(x, q):  # int8 values are exact in any float dtype
        return jax.lax.dot_general(x, q.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def on_cpu(x, q):
        x, (m, n) = x.astype(jnp.float32), q.shape
        step = max(1, min(INT8_CHUNK_ELEMENTS // n, -(-m // 2)))  # two chunks at least: a loop, not one product

        def chunk_product(i, y):
            start = jnp.minimum(i * step, m - step)  # the last chunk ends at the last row
            chunk = jax.lax.dynamic_slice_in_dim(q, start, step)
            rows = (x[0] @ chunk.astype(jnp.float32).T)[None] if x.shape[0] == 1 else product(x, chunk)
            return jax.lax.dynamic_update_slice_in_dim(y, rows, start, axis=1)

        return jax.lax.fori_loop(0, -(-m // step), chunk_product, jnp.zeros((x.shape[0], m), jnp.float32))

    y = jax.lax.platform_dependent(x, q, cpu=on_cpu, default=product)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)
