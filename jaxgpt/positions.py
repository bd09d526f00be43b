"""Positional schemes (config.model.positions), one interface: where a scheme enters the model.

    embed(cfg, x, positions, table)         X + P: the learned table (table(rows): an embedding
                                            module the model makes) or the sinusoid
    rotate(cfg, q, k, positions, rope)      RoPE: q and k rotated by their positions with `rope`
                                            (ops.rope in compute.rope's form: platforms.forms.rope)
    bias(cfg, where)                        ALiBi: the bias on the attention scores
    ends_at_block_size                      positions past block_size do not exist
    check(cfg)                              a one-line ValueError for shapes it cannot serve
    asks                                    what it asks of a softmax kernel ('bias': ALiBi's)

A scheme overrides only the hooks it uses; the others are the identity (or no bias).
"""

from __future__ import annotations

from jaxgpt import ops


class Scheme:
    """No positional information: every hook the identity ('none')."""

    ends_at_block_size = False
    asks: tuple[str, ...] = ()  # the abilities of jaxgpt.attention.kernels.Kernel it needs

    def check(self, cfg) -> None:
        pass

    def embed(self, cfg, x, positions, table):
        return x

    def rotate(self, cfg, q, k, positions, rope):
        return q, k

    def bias(self, cfg, where):
        return None


class Learned(Scheme):
    """X + P[positions], P (block_size, d) a parameter (GPT-2)."""

    ends_at_block_size = True

    def embed(self, cfg, x, positions, table):
        return x + table(cfg.block_size)(positions)


class Sinusoidal(Scheme):
    """X + PE[positions] (ops.sinusoidal_positions)."""

    ends_at_block_size = True

    def check(self, cfg) -> None:
        if cfg.d_model % 2:
            raise ValueError(f"GPTConfig.positions='sinusoidal' needs an even d_model, got d_model={cfg.d_model}")

    def embed(self, cfg, x, positions, table):
        return x + ops.sinusoidal_positions(cfg.block_size, cfg.d_model)[positions].astype(x.dtype)


class Rope(Scheme):
    """q, k rotated pairwise by angles proportional to their positions (ops.rope, computed by `rope`)."""

    def check(self, cfg) -> None:
        if cfg.head_dim % 2:
            raise ValueError(f"GPTConfig.positions='rope' needs an even head size, but head_dim = {cfg.head_dim}: "
                             "choose an even head_dim (or d_model and n_head so that d_model/n_head is even)")

    def rotate(self, cfg, q, k, positions, rope):
        return rope(q, positions, cfg.rope_base), rope(k, positions, cfg.rope_base)


class Alibi(Scheme):
    """The scores biased by −m_h·(distance) (ops.alibi_bias_at)."""

    asks = ("bias",)

    def bias(self, cfg, where):
        return ops.alibi_bias_at(cfg.n_head, where.q_positions, where.k_positions)


SCHEMES: dict[str, Scheme] = {"learned": Learned(), "sinusoidal": Sinusoidal(), "rope": Rope(), "alibi": Alibi(),
                              "none": Scheme()}
