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

    def mha(x, q, layer):
        qh, kh, vh = project(x, q)
        if cfg.qk_norm:  # each head's q and k over its D values
            qh, kh = rms_norm(qh, q["q_norm"]["scale"], cfg.norm_eps), rms_norm(kh, q["k_norm"]["scale"], cfg.norm_eps)
        paired = layer in {i % cfg.n_layer for i in cfg.paired_heads}
        if cfg.positions == "rope" and paired:  # head 2j+i of token t at place 2t + i of its pair's sequence
            qh, kh = (np.stack([rope(a[:, :, h:h + 1], 2 * positions + h % 2, cfg.rope_base)[:, :, 0]
                                for h in range(H)], axis=2) for a in (qh, kh))
        elif cfg.positions == "rope":
            qh, kh = rope(qh, positions, cfg.rope_base), rope(kh, positions, cfg.rope_base)
        if cfg.key_offset:
            kh = key_offset(kh, positions)
        mask = np.tril(np.ones((T, T), bool))
        if cfg.window is not None:  # local: 0 ≤ t − s < window
            mask &= np.triu(np.ones((T, T), bool), k=-(cfg.window - 1))
        bias = None
        if cfg.positions == "alibi":
            i, j = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
            bias = np.stack([-m * (i - j) for m in alibi_slopes(H)])[None]
        if cfg.attention == "linear":
            ctx = linear_attention_recurrent(qh, kh, vh, cfg.linear_feature)
        elif paired:
            ctx = paired_attention(qh, kh, vh)
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
    states = [x]  # h_0 (the embeddings), then each block's output: what the dense skips weigh
    for layer in range(cfg.n_layer):
        q = p[f"h_{layer}"]
        source = cfg.n_layer - 1 - layer
        if cfg.unet_skips and source < min(layer, cfg.n_layer // 2):  # + w_i h_{i+1}, h_{i+1} block i's output
            x = x + p["unet"][f"w_{source}"] * states[source + 1]
        if cfg.dense_skips and layer >= 1:  # + Σ_{j<ℓ} a_ℓj h_j, from the last state h_ℓ = states[ℓ]
            x = x + dense_skips(states, p["dense_skips"], layer, cfg.norm_eps)
        if cfg.parallel_block:
            h = norm(x, q["ln_1"])
            x = x + mha(h, q["attn"], layer) + ffn(h, q["mlp"])
        elif cfg.norm_position == "pre":
            y = x + mha(norm(x, q["ln_1"]), q["attn"], layer)
            x = y + ffn(norm(y, q["ln_2"]), q["mlp"])
        else:
            y = norm(x + mha(x, q["attn"], layer), q["ln_1"])
            x = norm(y + ffn(y, q["mlp"]), q["ln_2"])
        states.append(x)
    x = norm(x, p["ln_f"])
    W_U = E.T if cfg.tie_embeddings else p["lm_head"]["kernel"]
    logits = x @ W_U + p["logits_bias"] if cfg.logits_bias else x @ W_U
    if cfg.logit_softcap is not None:
        c = cfg.logit_softcap
        logits = c * np.tanh(logits / c)
    return logits


def dense_skips(states, p, layer, eps):
    """Σ_{j<ℓ} a_ℓj(t) h_j(t) for layer ℓ, token by token, with h_ℓ = states[ℓ] its last hidden state and
    a_ℓj(t) = Σ_k W2_ℓ[k,j] GELU(Σ_i W1_ℓ[i,k] h_ℓ,i(t) / √(mean_i h_ℓ,i(t)² + ε)) + b_ℓ[j], GELU exact."""
    w1, w2, b = p[f"w1_{layer}"], p[f"w2_{layer}"], p[f"b_{layer}"]
    last = states[layer]
    B, T, d = last.shape
    out = np.zeros((B, T, d))
    for bi in range(B):
        for t in range(T):
            h = last[bi, t]
            rms = math.sqrt(sum(v * v for v in h) / d + eps)
            u = [sum(h[i] / rms * w1[i, k] for i in range(d)) for k in range(w1.shape[1])]
            g = [v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in u]
            for j in range(layer):
                a = sum(g[k] * w2[k, j] for k in range(len(g))) + b[j]
                out[bi, t] += a * states[j][bi, t]
    return out


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


def key_offset(k, positions, segments=None):
    """k'[b,s,h] = (k[b,s,h,:D/2], k[b,s−1,h,D/2:]) where entry s−1 is the token at position p_s − 1 of the
    same segment, else k[b,s,h] as it is, entry by entry."""
    out = k.copy()
    B, S, _, D = k.shape
    segments = np.zeros((B, S), int) if segments is None else segments
    for b in range(B):
        for s in range(1, S):
            if positions[b, s - 1] == positions[b, s] - 1 and segments[b, s - 1] == segments[b, s]:
                out[b, s, :, D // 2:] = k[b, s - 1, :, D // 2:]
    return out


def paired_attention(q, k, v):
    """Heads 2j and 2j+1 as one sequence of 2T places, head 2j+i of token t at place 2t+i: the query at place
    2t+i sees the keys at places 2s+i' ≤ 2t+i, of both heads; out[b,t,2j+i] = Σ softmax(q·k/√D) v over them."""
    B, T, H, D = q.shape
    out = np.zeros((B, T, H, D))
    for b in range(B):
        for j in range(H // 2):
            for t in range(T):
                for i in (0, 1):
                    seen = [(s, 2 * j + i2) for s in range(T) for i2 in (0, 1) if 2 * s + i2 <= 2 * t + i]
                    scores = np.array([q[b, t, 2 * j + i] @ k[b, s, h] / math.sqrt(D) for s, h in seen])
                    weights = softmax(scores)
                    out[b, t, 2 * j + i] = sum(w * v[b, s, h] for w, (s, h) in zip(weights, seen, strict=True))
    return out


def bigram_hash(before, token, table_size):
    """((36313·x_t) xor (27191·x_{t−1}) mod 2³²) mod (M − 1), in Python's integers."""
    return (((36313 * token) % 2**32) ^ ((27191 * before) % 2**32)) % (table_size - 1)


def trigram_hash(before2, before, token, table_size):
    """m = (0x9E3779B1·x_t xor 0x85EBCA77·x_{t−1} xor 0xC2B2AE3D·x_{t−2}) mod 2³², then (m xor ⌊m / 2¹⁶⌋) mod
    (M − 1), in Python's integers."""
    m = ((0x9E3779B1 * token) % 2**32) ^ ((0x85EBCA77 * before) % 2**32) ^ ((0xC2B2AE3D * before2) % 2**32)
    return (m ^ (m // 2**16)) % (table_size - 1)


def previous_token_embedding(cfg, p, tokens, positions=None, segments=None):
    """E[x_t], plus the smear λ·σ(w·E[x_t][:g])·E[x_{t−1}], the bigram row B[h(x_{t−1}, x_t)] (row M − 1
    without a token before) and the trigram row C[h(x_{t−2}, x_{t−1}, x_t)] (row M' − 1 without two), token
    by token; x_{t−1} is the token before iff it is at position p_t − 1 of the same segment, x_{t−2} the
    token two before iff it is at position p_t − 2 of the same segment and x_{t−1} is."""
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
            has2 = has and t > 1 and positions[b, t - 2] == positions[b, t] - 2 and segments[b, t - 2] == segments[b, t]
            if cfg.trigram_table:
                M = cfg.trigram_table
                row = trigram_hash(int(tokens[b, t - 2]), before, token, M) if has2 else M - 1
                x[b, t] += p["previous"]["trigram"][row]
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
