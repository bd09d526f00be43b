"""GPTConfig: the hyperparameters of the model, validated when made."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "none")
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post")
ACTIVATIONS = ("gelu", "gelu_exact", "relu", "swiglu", "geglu")
ATTENTIONS = ("explicit", "blocked", "xla", "cudnn")
DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A GPT's shape and choices. Defaults are GPT-2's: learned positions, pre-norm LayerNorm,
    tanh GELU, biases, and the unembedding tied to the token embedding."""

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    d_ff: Optional[int] = None  # hidden width of the FFN; None means 4·d_model
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
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    # explicit = ops.attention; blocked = the same in query blocks of 64 that skip the keys the
    # causal mask hides (training and prefill); xla / cudnn = jax.nn.dot_product_attention
    attention: str = "explicit"
    remat: bool = False  # recompute attention and elementwise ops in the backward pass: less memory

    def __post_init__(self):
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name}={value!r}: must be a positive integer")
        for name, valid in (
            ("positions", POSITIONS),
            ("norm", NORMS),
            ("norm_position", NORM_POSITIONS),
            ("activation", ACTIVATIONS),
            ("attention", ATTENTIONS),
            ("dtype", DTYPES),
            ("param_dtype", DTYPES),
        ):
            value = getattr(self, name)
            if value not in valid:
                raise ValueError(f"GPTConfig.{name}={value!r}: must be one of {', '.join(valid)}")
        for name in ("parallel_block", "bias", "tie_embeddings", "remat"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r}: must be True or False")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r}: must be in [0, 1)")
        if not self.norm_eps > 0:
            raise ValueError(f"GPTConfig.norm_eps={self.norm_eps!r}: must be positive")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}: "
                f"choose n_head among the divisors of d_model"
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(
                f"GPTConfig.positions='rope' needs an even head size, but d_model/n_head = "
                f"{self.d_model}/{self.n_head} = {self.head_dim}: choose d_model and n_head so it is even"
            )
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"GPTConfig.positions='sinusoidal' needs an even d_model, got d_model={self.d_model}")
        if self.parallel_block and self.norm_position == "post":
            raise ValueError(
                "GPTConfig.parallel_block=True with norm_position='post': the parallel block is "
                "pre-norm (X + MHA(LN(X)) + FFN(LN(X))); set norm_position='pre'"
            )
        if self.attention == "cudnn" and not _has_gpu():
            raise ValueError(
                f"GPTConfig.attention='cudnn' needs a CUDA GPU, but JAX sees only "
                f"{jax.default_backend()} devices: use attention='xla' or 'explicit'"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> "GPTConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "GPTConfig":
        """Build from a plain dict (e.g. a saved run's config); unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"GPTConfig has no field(s) {', '.join(unknown)}; valid fields: {', '.join(sorted(known))}")
        return cls(**values)


def _has_gpu() -> bool:
    try:
        return any(device.platform == "gpu" for device in jax.devices())
    except RuntimeError:
        return False
