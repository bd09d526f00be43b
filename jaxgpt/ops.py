"""The mathematics of a GPT as pure functions of arrays.

One function per equation, in the form it reads, no parameters and no Flax: `model.py` owns
the parameters and composes these. The same functions computed another way where a backend
measured faster (a matmul's gradient, RoPE by lanes, the int8 product) are
`jaxgpt.platforms.forms`, chosen by the compute config. Shape letters: B batch, T query
positions, S key positions, H heads, D head size, d model width, V vocabulary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# --- linear maps ------------------------------------------------------------------------


def linear(x, w):
    """y = x W for x (..., n) and W (n, m): 'Nn,nm->Nm' over all leading positions N."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


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


def gate_heads(context, x, w, b):
    """C_h ← σ(x[:G] W_g + b_g)_h · C_h: each head's context (..., H, D) at each token scaled by a gate in
    (0, 1) read from the first G features of that token's attention input x (..., d), W_g (G, H), b_g (H,)."""
    gate = jax.nn.sigmoid(linear(x[..., :w.shape[0]], w.astype(x.dtype)) + b.astype(x.dtype))
    return context * gate[..., None].astype(context.dtype)


def share_kv_heads(kv, n_head):
    """Grouped-query attention: K_h = K_{⌊h/g⌋}, g = n_head/n_kv_head, for kv (B,S,H_kv,D) → (B,S,H,D):
    each of the H_kv key/value heads serves g consecutive query heads."""
    return jnp.repeat(kv, n_head // kv.shape[-2], axis=-2)


def follows(positions, segments=None):
    """f_s = [p_{s−1} = p_s − 1 and seg_{s−1} = seg_s] for s ≥ 1, f_0 = False: whether entry s − 1 of a row
    holds the token just before entry s's, of the same example (jaxgpt.previous's rule); positions (B, S)
    or (1, S), segments (B, S) or None → (B, S)."""
    inside = positions[:, :-1] == positions[:, 1:] - 1
    if segments is not None:
        inside = inside & (segments[:, :-1] == segments[:, 1:])
    return jnp.concatenate([jnp.zeros((inside.shape[0], 1), bool), inside], axis=1)


def offset_keys(k, k_before, has_before):
    """The partial key offset: k'_s = (k_s[:D/2], k_before_s[D/2:]) where has_before_s, else k_s: each key's
    second half of channels taken from the key of the token before it, for k, k_before (B,S,H,D) (k_before_s:
    the key of the token before s's) and has_before (B,S) (whether s has one)."""
    half = k.shape[-1] // 2
    second = jnp.where(has_before[:, :, None, None], k_before[..., half:], k[..., half:])
    return jnp.concatenate([k[..., :half], second.astype(k.dtype)], axis=-1)


def pair_heads(x):
    """Paired heads' one sequence: y[b, 2t+i, j] = x[b, t, 2j+i] for i ∈ {0, 1}, x (B,T,H,D) → (B,2T,H/2,D):
    heads 2j and 2j+1 interleaved token by token."""
    B, T, H, D = x.shape
    return x.reshape(B, T, H // 2, 2, D).swapaxes(2, 3).reshape(B, 2 * T, H // 2, D)


def unpair_heads(y):
    """pair_heads's inverse: x[b, t, 2j+i] = y[b, 2t+i, j], y (B,2T,H/2,D) → (B,T,H,D)."""
    B, T2, J, D = y.shape
    return y.reshape(B, T2 // 2, 2, J, D).swapaxes(2, 3).reshape(B, T2 // 2, 2 * J, D)


def pair_positions(positions):
    """The positions of pair_heads's sequence: 2p + i at place 2t+i, for positions p (B,T) → (B,2T)."""
    doubled = 2 * positions[:, :, None] + jnp.arange(2, dtype=positions.dtype)
    return doubled.reshape(positions.shape[0], -1)


def pair_segments(segments):
    """The segments of pair_heads's sequence: seg_t at places 2t and 2t+1, (B,T) → (B,2T)."""
    return jnp.repeat(segments, 2, axis=1)


def unpair_weights(weights):
    """Paired heads' weights a_j[2t+i, 2s+i'] (B,H/2,2T,2S) read per head and token: w_{2j+i}[t, s] =
    Σ_{i'} a_j[2t+i, 2s+i'], the weight query head 2j+i at token t gives token s's keys (either head's):
    (B,H,T,S), each row summing to 1 as the plain heads' do."""
    B, J, T2, S2 = weights.shape
    per_token = weights.reshape(B, J, T2 // 2, 2, S2 // 2, 2).sum(axis=-1)
    return per_token.swapaxes(2, 3).reshape(B, 2 * J, T2 // 2, S2 // 2)


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
    """RoPE: rotate each pair (x_{2j}, x_{2j+1}) by the angle θ_j = p·base^(−2j/D); x (B,T,H,D), positions (B,T)
    or (T,): y_{2j} = x_{2j} cos θ_j − x_{2j+1} sin θ_j, y_{2j+1} = x_{2j+1} cos θ_j + x_{2j} sin θ_j.
    Computed on the (…, D/2, 2) pairs, in float32, and returned in x's dtype."""
    d = x.shape[-1]
    angles = rope_angles(positions, d, base)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], d // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def rope_angles(positions, d: int, base: float):
    """θ_j = p·base^(−2j/D) of each pair j = 0…D/2−1 at each position p: (B,T,1,D/2) for positions (B,T)."""
    pair = jnp.arange(d // 2)
    inv_freq = jnp.power(base, -(2 * pair).astype(jnp.float32) / d)
    return jnp.asarray(positions, jnp.float32)[..., None, None] * inv_freq


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
