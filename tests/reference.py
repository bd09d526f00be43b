"""Float64 NumPy evaluations of the GPT equations, written independently of jaxgpt.ops.

Loops and explicit formulas, no vectorised tricks: slow and plain, so they are easy to
check by eye against the equations in docs/MATH.md.
"""

import math

import numpy as np


def softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def attention(q, k, v, mask=None, bias=None):
    """Head by head: out[b,:,h] = softmax(q k^T/√D + bias + M) v, with M = −∞ where mask is False."""
    B, T, H, D = q.shape
    S = k.shape[1]
    out = np.zeros((B, T, H, D))
    for b in range(B):
        for h in range(H):
            scores = q[b, :, h, :] @ k[b, :, h, :].T / math.sqrt(D)
            if bias is not None:
                scores = scores + np.broadcast_to(bias, (B, H, T, S))[b, h]
            if mask is not None:
                scores = np.where(np.broadcast_to(mask, (B, H, T, S))[b, h], scores, -np.inf)
            out[b, :, h, :] = softmax(scores) @ v[b, :, h, :]
    return out


def layer_norm(x, scale, bias=None, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = scale * (x - mean) / np.sqrt(var + eps)
    return y if bias is None else y + bias


def rms_norm(x, scale, eps):
    return scale * x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gelu_exact(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def silu(x):
    return x / (1 + np.exp(-x))


def activation(name, h):
    half = h.shape[-1] // 2
    a, b = h[..., :half], h[..., half:]
    return {
        "gelu": lambda: gelu_tanh(h),
        "gelu_exact": lambda: gelu_exact(h),
        "relu": lambda: np.maximum(h, 0),
        "relu2": lambda: np.maximum(h, 0) ** 2,
        "silu": lambda: silu(h),
        "swiglu": lambda: silu(a) * b,
        "geglu": lambda: gelu_tanh(a) * b,
        "glu": lambda: b / (1 + np.exp(-a)),
    }[name]()


def sinusoidal(n, d):
    pe = np.zeros((n, d))
    for i in range(n):
        for j in range(d // 2):
            angle = i / 10000 ** (2 * j / d)
            pe[i, 2 * j], pe[i, 2 * j + 1] = math.sin(angle), math.cos(angle)
    return pe


def rope(x, positions, base=10000.0):
    """Rotate each (x_{2j}, x_{2j+1}) at position p by the 2×2 rotation of angle p·base^(−2j/D)."""
    out = np.empty_like(x)
    B, T, H, D = x.shape
    for b in range(B):
        for t in range(T):
            p = positions[b, t]
            for j in range(D // 2):
                theta = p * base ** (-2 * j / D)
                c, s = math.cos(theta), math.sin(theta)
                rotation = np.array([[c, -s], [s, c]])
                out[b, t, :, 2 * j: 2 * j + 2] = x[b, t, :, 2 * j: 2 * j + 2] @ rotation.T
    return out


def linear_attention_recurrent(q, k, v, feature, eps=1e-6):
    """out_t = φ(q_t)ᵀS_t / (φ(q_t)ᵀz_t + ε), S_t = S_{t−1} + φ(k_t)v_tᵀ, z_t = z_{t−1} + φ(k_t), token
    by token, for q, k, v (B, T, H, D) in float64."""
    phi = (lambda x: np.where(x > 0, x + 1, np.exp(x))) if feature == "elu+1" else (lambda x: np.maximum(x, 0))
    fq, fk = phi(q), phi(k)
    B, T, H, D = q.shape
    S, z = np.zeros((B, H, D, v.shape[-1])), np.zeros((B, H, D))
    out = np.zeros((B, T, H, v.shape[-1]))
    for t in range(T):
        S = S + fk[:, t, :, :, None] * v[:, t, :, None, :]
        z = z + fk[:, t]
        out[:, t] = np.einsum("bhd,bhde->bhe", fq[:, t], S) / (np.einsum("bhd,bhd->bh", fq[:, t], z)[..., None] + eps)
    return out


def alibi_slopes(n_head):
    p = 2 ** int(math.floor(math.log2(n_head)))
    slopes = [2 ** (-8 * h / p) for h in range(1, p + 1)]
    return slopes + [2 ** (-8 * h / (2 * p)) for h in range(1, 2 * p + 1, 2)][: n_head - p]


def gpt_forward(cfg, params, tokens):
    """logits = LN_f(Blocks(E[x] + P)) W_U in float64, following the GPTConfig's choices."""
    p = _to_float64(params)
    B, T = tokens.shape
    H, d = cfg.n_head, cfg.d_model
    positions = np.tile(np.arange(T), (B, 1))

    def norm(x, q):
        if cfg.norm == "layernorm":
            return layer_norm(x, q["scale"], q.get("bias"), cfg.norm_eps)
        return rms_norm(x, q["scale"], cfg.norm_eps)

    def dense(x, q):
        y = np.tensordot(x, q["kernel"], axes=1)
        return y + q["bias"] if "bias" in q else y

    def project(x, q):
        """Q (B,T,H,D), and K, V with each query head h given key/value head ⌊h/g⌋, g = H/H_kv."""
        if "c_attn" in q:
            qkv = np.einsum("btd,dchk->cbthk", x, q["c_attn"]["kernel"])
            if "bias" in q["c_attn"]:
                qkv = qkv + q["c_attn"]["bias"][:, None, None]
            return qkv
        qh = np.einsum("btd,dhk->bthk", x, q["q_proj"]["kernel"])
        kv = np.einsum("btd,dchk->cbthk", x, q["kv_proj"]["kernel"])
        if "bias" in q["q_proj"]:
            qh, kv = qh + q["q_proj"]["bias"], kv + q["kv_proj"]["bias"][:, None, None]
        group = H // cfg.n_kv_head
        kh = np.stack([kv[0][:, :, h // group] for h in range(H)], axis=2)
        vh = np.stack([kv[1][:, :, h // group] for h in range(H)], axis=2)
        return qh, kh, vh

    def mha(x, q):
        qh, kh, vh = project(x, q)
        if cfg.qk_norm:  # each head's q and k over its D values
            qh, kh = rms_norm(qh, q["q_norm"]["scale"], cfg.norm_eps), rms_norm(kh, q["k_norm"]["scale"], cfg.norm_eps)
        if cfg.positions == "rope":
            qh, kh = rope(qh, positions, cfg.rope_base), rope(kh, positions, cfg.rope_base)
        mask = np.tril(np.ones((T, T), bool))
        if cfg.window is not None:  # local: 0 ≤ t − s < window
            mask &= np.triu(np.ones((T, T), bool), k=-(cfg.window - 1))
        bias = None
        if cfg.positions == "alibi":
            i, j = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
            bias = np.stack([-m * (i - j) for m in alibi_slopes(H)])[None]
        if cfg.attention == "linear":
            ctx = linear_attention_recurrent(qh, kh, vh, cfg.linear_feature)
        else:
            ctx = attention(qh, kh, vh, mask, bias)
        if cfg.attn_gate:
            ctx = gate_heads(ctx, x, q["gate"], q["gate_bias"])
        out = np.einsum("bthk,hkd->btd", ctx, q["c_proj"]["kernel"])
        return out + q["c_proj"]["bias"] if "bias" in q["c_proj"] else out

    def ffn(x, q):
        h = activation(cfg.activation, dense(x, q["c_fc"]))
        for i in range(2, cfg.ffn_layers + 1):
            h = activation(cfg.activation, dense(h, q[f"c_fc_{i}"]))
        return dense(h, q["c_proj"])

    E = p["wte"]["embedding"]
    x = previous_token_embedding(cfg, p, tokens)
    if cfg.positions == "learned":
        x = x + p["wpe"]["embedding"][:T]
    elif cfg.positions == "sinusoidal":
        x = x + sinusoidal(T, d)
    for layer in range(cfg.n_layer):
        q = p[f"h_{layer}"]
        if cfg.parallel_block:
            h = norm(x, q["ln_1"])
            x = x + mha(h, q["attn"]) + ffn(h, q["mlp"])
        elif cfg.norm_position == "pre":
            y = x + mha(norm(x, q["ln_1"]), q["attn"])
            x = y + ffn(norm(y, q["ln_2"]), q["mlp"])
        else:
            y = norm(x + mha(x, q["attn"]), q["ln_1"])
            x = norm(y + ffn(y, q["mlp"]), q["ln_2"])
    x = norm(x, p["ln_f"])
    W_U = E.T if cfg.tie_embeddings else p["lm_head"]["kernel"]
    logits = x @ W_U + p["logits_bias"] if cfg.logits_bias else x @ W_U
    if cfg.logit_softcap is not None:
        c = cfg.logit_softcap
        logits = c * np.tanh(logits / c)
    return logits


def gate_heads(ctx, x, w, b):
    """ctx[b,t,h] times g = σ(Σ_i x[b,t,i] w[i,h] + b[h]) over the first G = len(w) features of the
    attention's input x, token by token and head by head."""
    out = ctx.copy()
    B, T, H, _ = ctx.shape
    for bi in range(B):
        for t in range(T):
            for h in range(H):
                z = sum(x[bi, t, i] * w[i, h] for i in range(w.shape[0])) + b[h]
                out[bi, t, h] = ctx[bi, t, h] / (1 + math.exp(-z))
    return out


def bigram_hash(before, token, table_size):
    """((36313·x_t) xor (27191·x_{t−1}) mod 2³²) mod (M − 1), in Python's integers."""
    return (((36313 * token) % 2**32) ^ ((27191 * before) % 2**32)) % (table_size - 1)


def previous_token_embedding(cfg, p, tokens, positions=None, segments=None):
    """E[x_t], plus the smear λ·σ(w·E[x_t][:g])·E[x_{t−1}] and the bigram row B[h(x_{t−1}, x_t)] (row M − 1
    without a token before), token by token; x_{t−1} is the token before iff it is at position p_t − 1 of
    the same segment."""
    E = p["wte"]["embedding"]
    B, T = tokens.shape
    positions = np.tile(np.arange(T), (B, 1)) if positions is None else positions
    segments = np.zeros((B, T), int) if segments is None else segments
    x = E[tokens].copy()
    for b in range(B):
        for t in range(T):
            has = t > 0 and positions[b, t - 1] == positions[b, t] - 1 and segments[b, t - 1] == segments[b, t]
            token, before = int(tokens[b, t]), int(tokens[b, t - 1]) if has else None
            if cfg.smear and has:
                w, lam = p["previous"]["smear_gate"], p["previous"]["smear_lambda"]
                gate = 1 / (1 + math.exp(-float(E[token][:len(w)] @ w)))
                x[b, t] += lam * gate * E[before]
            if cfg.bigram_table:
                row = bigram_hash(before, token, cfg.bigram_table) if has else cfg.bigram_table - 1
                x[b, t] += p["previous"]["bigram"][row]
    return x


def multi_token_loss(logits, targets, mask, segments, weights, count):
    """(1/count) Σ_i Σ_k w_k m_{i+k−1} [i+k−1 < T, same segment] (−log softmax(z_i)[y_{i+k−1}]), loop by loop."""
    B, T, _ = logits.shape
    total = 0.0
    for b in range(B):
        for i in range(T):
            log_p = logits[b, i] - logits[b, i].max()
            log_p = log_p - math.log(np.exp(log_p).sum())
            for k, w in enumerate(weights):
                j = i + k
                if j < T and mask[b, j] and segments[b, j] == segments[b, i]:
                    total -= w * log_p[targets[b, j]]
    return total / count


def _to_float64(tree):
    if isinstance(tree, dict):
        return {k: _to_float64(v) for k, v in tree.items()}
    return np.asarray(tree, np.float64)
