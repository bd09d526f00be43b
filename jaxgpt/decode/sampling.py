"""Sampling from a GPT: the next-token maths as pure functions, and a jitted `generate`
(and its step-by-step form `stream`) that decodes a batch of prompts with the KV cache.

Each new token is drawn from the model's distribution over the next token given the
sequence so far, filtered in this order:

    z = logits(crop(x)) / τ               temperature τ (τ = 0: greedy, x_{n+1} = argmax z)
    z = z outside the k largest → −∞      top-k
    z = z outside the nucleus → −∞        top-p: the smallest set of most likely tokens
                                          whose probability under softmax(z) reaches p
    x_{n+1} ~ softmax(z)

crop(x) is the last block_size tokens of x; `jaxgpt.decode.logits` says what it costs and how
the cache makes each new token cheap. How to draw is a `SamplingOptions`, given to
`generate` and `stream` as one object or as its fields by keyword.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ComputeConfig, GPTConfig, is_int, is_number
from jaxgpt.decode.logits import check_reach, is_concrete, next_logits, prompt_batch, start_cache
from jaxgpt.model import GPT
from jaxgpt.quantize import check_params

# --- the sampling maths: pure functions of logits (V,) or (..., V) ---------------------------


def apply_temperature(logits, temperature):
    """z / τ for τ > 0: τ < 1 sharpens the distribution, τ > 1 flattens it."""
    return logits / temperature


def top_k_filter(logits, k: int):
    """Keep exactly the k largest logits (ties go to the lower token id); the rest → −∞."""
    k = min(k, logits.shape[-1])
    # lax.top_k puts the lower index first among equals, but orders −0 below +0: one value here
    _, kept = jax.lax.top_k(jnp.where(logits == 0, jnp.zeros_like(logits), logits), k)
    keep = jnp.put_along_axis(jnp.zeros(logits.shape, bool), kept, True, axis=-1, inplace=False)
    return jnp.where(keep, logits, -jnp.inf)


def top_p_filter(logits, p):
    """Keep the smallest set of most likely tokens whose probability under softmax(logits)
    reaches p (the nucleus); the rest → −∞. A token is kept iff the tokens more likely than
    it hold less than p. Among equally likely tokens the lower id counts as more likely."""
    probs = jax.nn.softmax(logits, axis=-1)
    sorted_probs, order = jax.lax.top_k(probs, probs.shape[-1])
    mass = jnp.cumsum(sorted_probs, axis=-1)
    mass_before = jnp.concatenate([jnp.zeros_like(mass[..., :1]), mass[..., :-1]], axis=-1)
    keep = jnp.put_along_axis(jnp.zeros(logits.shape, bool), order, mass_before < p, axis=-1, inplace=False)
    return jnp.where(keep, logits, -jnp.inf)


def filter_logits(logits, temperature, top_k: int | None = None, top_p=None):
    """Temperature, then top-k, then top-p: the logits that a sample is drawn from (τ > 0)."""
    logits = apply_temperature(logits, temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    return logits


def sample_token(key, logits, temperature=1.0, top_k: int | None = None, top_p=None):
    """One token x ~ softmax(filter_logits(logits)) for logits (V,); argmax when τ = 0.

    temperature and top_p may be traced values; top_k is a static int (or None)."""
    return sample_at(jax.random.uniform(key), logits, temperature, top_k, top_p)


def sample_at(u, logits, temperature=1.0, top_k: int | None = None, top_p=None):
    """`sample_token` with its randomness given as u ~ U[0, 1): the token x whose interval
    [F(x−1), F(x)) holds u·F(V), F the running sum of softmax(filter_logits(logits)) (inverse
    transform sampling; filtered tokens have empty intervals). One number per draw, so all
    of a generation's can be drawn before its loop."""
    temperature = jnp.asarray(temperature, jnp.float32)
    random = temperature > 0
    filtered = filter_logits(logits, jnp.where(random, temperature, 1.0), top_k, top_p)
    cumulative = jnp.cumsum(jax.nn.softmax(filtered, axis=-1), axis=-1)
    drawn = jnp.sum(cumulative <= u * cumulative[-1])
    return jnp.where(random, drawn, jnp.argmax(logits)).astype(jnp.int32)


# --- the options ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """How `generate` and `stream` draw; checked when made (a one-line ValueError for an
    impossible value), and against the model's vocabulary by `check`.

    max_new_tokens: each row gets up to this many new tokens.
    temperature: τ ≥ 0, 0 for greedy. top_k, top_p: None for no filter. temperature and
      top_p may be values traced under the caller's jit (not checked: their values are not
      known yet); top_k selects a compiled program, so it is a Python int.
    eos_id: a row that draws it stops there (the EOS is kept, pad_id follows); the loop ends
      when every row has stopped.
    pad_id: what fills the prompts' padding and each row after its end.
    return_logprobs, top_logprobs=K: also record the model's log-probability of each new
      token, and the K most likely next tokens at each step (see `Generation`).
    """

    max_new_tokens: int
    temperature: float | jax.Array = 1.0
    top_k: int | None = None
    top_p: float | jax.Array | None = None
    eos_id: int | None = None
    pad_id: int = 0
    return_logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        """One-line ValueErrors for impossible values; traced temperature and top_p pass."""
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        temperature, top_k, top_p = self.temperature, self.top_k, self.top_p
        if is_concrete(temperature) and (not is_number(temperature) or not 0 <= temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number ≥ 0 (0 means greedy), got {temperature!r}")
        if top_k is not None and (not is_int(top_k) or top_k < 1):
            raise ValueError(f"top_k must be a positive integer (how many most likely tokens to keep), got {top_k!r}")
        if top_p is not None and is_concrete(top_p) and (not is_number(top_p) or not 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (the probability mass of the tokens kept), got {top_p!r}")
        if self.eos_id is not None and (not is_int(self.eos_id) or self.eos_id < 0):
            raise ValueError(f"eos_id must be a token id (an integer ≥ 0) or None, got {self.eos_id!r}")
        if not is_int(self.pad_id) or self.pad_id < 0:
            raise ValueError(f"pad_id must be a token id (an integer ≥ 0), got {self.pad_id!r}")
        if not is_int(self.top_logprobs) or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an integer ≥ 0 (how many most likely next tokens to record), "
                             f"got {self.top_logprobs!r}")

    def check(self, config: GPTConfig) -> None:
        """Raise ValueError (one line) for token ids outside config's vocabulary, or for
        more top_logprobs than it has tokens."""
        for name, token_id in (("eos_id", self.eos_id), ("pad_id", self.pad_id)):
            if token_id is not None and token_id >= config.vocab_size:
                raise ValueError(f"{name} must be a token id in 0…{config.vocab_size - 1}, got {token_id!r}")
        if self.top_logprobs > config.vocab_size:
            raise ValueError(f"top_logprobs must be an integer in 0…vocab_size={config.vocab_size}, "
                             f"got {self.top_logprobs!r}")


def _options(options: SamplingOptions | None, fields: dict) -> SamplingOptions:
    """The options, given as a SamplingOptions or as its fields by keyword (not both)."""
    if options is None:
        return SamplingOptions(**fields)
    if fields:
        raise ValueError(f"give the sampling options as a SamplingOptions or as keywords, not both: got options and "
                         f"{', '.join(fields)}")
    if not isinstance(options, SamplingOptions):
        raise ValueError(f"options must be a SamplingOptions, got {type(options).__name__}")
    return options


# --- generate ---------------------------------------------------------------------------------


@flax.struct.dataclass
class Generation:
    """What `generate` returns; `jax.device_get(result)` gives the same with NumPy arrays.

    tokens: (B, P + max_new_tokens) each row's prompt and then its new tokens; from
      lengths[b] on, pad_id. P is the longest prompt.
    lengths: (B,) prompt plus new tokens of each row (an EOS it drew included).
    prompt_lengths: (B,)
    logprobs: (B, max_new_tokens) with return_logprobs: log p(token | context) of each new
      token under the model (temperature 1, unfiltered); 0 after the row's end.
    top_ids, top_logprobs: (B, max_new_tokens, K) with top_logprobs=K: at each step the K
      most likely next tokens under the model and their log-probabilities (pad_id and 0
      after the row's end).
    """

    tokens: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    logprobs: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None

    def new_tokens(self) -> list[np.ndarray]:
        """Each row's generated tokens, as NumPy arrays."""
        tokens, lengths, starts = jax.device_get((self.tokens, self.lengths, self.prompt_lengths))
        return [row[start:end] for row, start, end in zip(tokens, starts, lengths, strict=True)]


class Step(NamedTuple):
    """One step of `stream`, NumPy arrays over the rows: the token each row drew (pad_id for
    rows that had already stopped), whether the row was still going, and the step's records
    as in `Generation` (None unless asked for)."""

    token: np.ndarray
    active: np.ndarray
    logprob: np.ndarray | None
    top_ids: np.ndarray | None
    top_logprobs: np.ndarray | None


@dataclasses.dataclass(frozen=True)
class _Program:
    """The static choices that select a compiled program (with the argument shapes)."""

    @property
    def model(self) -> GPT:
        return GPT(self.config, self.compute)

    config: GPTConfig
    compute: ComputeConfig
    max_new_tokens: int
    top_k: int | None
    use_top_p: bool
    top_logprobs: int


@flax.struct.dataclass
class _Traced:
    """The sampling options that are traced values: changing them never recompiles."""

    temperature: jax.Array
    top_p: jax.Array
    eos_id: jax.Array  # −1: none
    pad_id: jax.Array


@flax.struct.dataclass
class _State:
    """What the decoding loop carries from one step to the next."""

    step: jax.Array  # () tokens drawn so far
    tokens: jax.Array  # (B, W)
    lengths: jax.Array  # (B,)
    active: jax.Array  # (B,) not yet stopped at EOS
    uniforms: jax.Array  # (B, max_new_tokens) the randomness of each row's draw at each step
    cache: Any  # the attention form's cache (jaxgpt.attention)
    logprobs: jax.Array  # (B, max_new_tokens), always kept: cheap, and one program fewer
    top_ids: jax.Array | None
    top_logprobs: jax.Array | None


@jax.jit(static_argnames="batch_size")  # eager, the vmap would be traced anew on every call
def _row_keys(key, batch_size: int):
    """One key per row: the given ones, or fold_in(key, b) for row b. Row b's draws use
    uniform(its key, (max_new_tokens,)), so they depend only on its key and prompt, not on
    the rest of the batch."""
    if key.ndim == 0 and jnp.issubdtype(key.dtype, jnp.integer):
        key = jax.random.key(key)  # an integer seed
    elif not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # a raw uint32 key (jax.random.PRNGKey)
    if key.shape == ():
        return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(batch_size))
    return key


def _start(params, prompts, prompt_lengths, row_keys, traced: _Traced, program: _Program) -> _State:
    """The buffer of prompts with room for the new tokens, the randomness of every draw, the
    records, and the cache to start from."""
    batch, width = prompts.shape[0], prompts.shape[1] + program.max_new_tokens
    positions = jnp.arange(width)[None, :]
    padded = jnp.pad(prompts.astype(jnp.int32), ((0, 0), (0, program.max_new_tokens)))
    tokens = jnp.where(positions < prompt_lengths[:, None], padded, traced.pad_id)
    records = (batch, program.max_new_tokens)
    k = program.top_logprobs
    return _State(
        step=jnp.zeros((), jnp.int32),
        tokens=tokens,
        lengths=prompt_lengths,
        active=jnp.ones((batch,), bool),
        # drawn before the loop, which then only reads them
        uniforms=jax.vmap(lambda key: jax.random.uniform(key, (program.max_new_tokens,)))(row_keys),
        cache=start_cache(params, program.model, tokens, prompt_lengths, prompts.shape[1]),
        logprobs=jnp.zeros(records, jnp.float32),
        top_ids=jnp.full((*records, k), traced.pad_id, jnp.int32) if k else None,
        top_logprobs=jnp.zeros((*records, k), jnp.float32) if k else None,
    )


def _step(params, state: _State, traced: _Traced, program: _Program):
    """Draw each active row's next token and append it; returns the new state and this
    step's records (token, whether the row was active, logprob, top ids, top logprobs). A step
    past max_new_tokens (the end of the loop's last chunk) has no active row: it changes
    nothing but the cache's slot of each row's last token, which it writes again."""
    active = state.active & (state.step < program.max_new_tokens)
    logits, cache = next_logits(params, program.model, state.cache, state.tokens, state.lengths, active, state.step)
    state = state.replace(cache=cache)
    top_p = traced.top_p if program.use_top_p else None
    draw = jax.vmap(lambda u, row: sample_at(u, row, traced.temperature, program.top_k, top_p))
    step = jnp.minimum(state.step, program.max_new_tokens - 1)  # a masked step's draw is not used
    token = jnp.where(active, draw(state.uniforms[:, step], logits), traced.pad_id)
    rows = jnp.arange(token.shape[0])
    tokens = state.tokens.at[rows, state.lengths].set(token, mode="drop")

    log_probs = jax.nn.log_softmax(logits, axis=-1)
    logprob = jnp.where(active, jnp.take_along_axis(log_probs, token[:, None], axis=1)[:, 0], 0.0)
    column = state.step  # past max_new_tokens (a masked step) no column: its writes are dropped
    records = {"logprobs": state.logprobs.at[:, column].set(logprob, mode="drop")}
    top_ids = top_logprobs = None
    if program.top_logprobs:
        values, ids = jax.lax.top_k(log_probs, program.top_logprobs)
        top_ids = jnp.where(active[:, None], ids, traced.pad_id)
        top_logprobs = jnp.where(active[:, None], values, 0.0)
        records["top_ids"] = state.top_ids.at[:, column].set(top_ids, mode="drop")
        records["top_logprobs"] = state.top_logprobs.at[:, column].set(top_logprobs, mode="drop")

    state = state.replace(
        step=state.step + 1,
        tokens=tokens,
        lengths=state.lengths + active,
        active=active & (token != traced.eos_id),
        **records,
    )
    return state, (token, active, logprob, top_ids, top_logprobs)


def _going(state: _State, program: _Program):
    return (state.step < program.max_new_tokens) & jnp.any(state.active)


# The steps the decoding loop takes between two looks at whether any row is still going. A
# loop whose end depends on values (EOS) makes the host wait for the device at each look
# (on a GPU, the body's launch waits for the predicate's copy); steps of a fixed count run
# without. The last chunk's steps past max_new_tokens, or after every row stopped, change nothing.
CHUNK = 16


def _chunk(params, state: _State, traced: _Traced, program: _Program) -> _State:
    """min(CHUNK, max_new_tokens) steps, a loop of known trip count."""
    steps = min(CHUNK, program.max_new_tokens)
    return jax.lax.fori_loop(0, steps, lambda _, s: _step(params, s, traced, program)[0], state)


@jax.jit(static_argnames="program")
def _generate_program(params, prompts, prompt_lengths, row_keys, traced: _Traced, program: _Program) -> Generation:
    state = _start(params, prompts, prompt_lengths, row_keys, traced, program)
    state = jax.lax.while_loop(lambda s: _going(s, program), lambda s: _chunk(params, s, traced, program), state)
    return Generation(tokens=state.tokens, lengths=state.lengths, prompt_lengths=prompt_lengths,
                      logprobs=state.logprobs, top_ids=state.top_ids, top_logprobs=state.top_logprobs)


def _prepare(config, compute, prompts, key, prompt_lengths, options: SamplingOptions):
    """Check the arguments and put them in the form the compiled programs take: (prompts,
    prompt lengths, a key per row, the longest prompt or None, the traced options, the program)."""
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    compute = ComputeConfig() if compute is None else compute
    if not isinstance(compute, ComputeConfig):
        raise ValueError(f"compute must be a ComputeConfig, got {type(compute).__name__}")
    options.check(config)
    prompts, prompt_lengths, longest = prompt_batch(config, prompts, prompt_lengths, options.pad_id)
    check_reach(config, prompts, longest, options.max_new_tokens)
    _check_key(key, prompts.shape[0])
    row_keys = _row_keys(key, prompts.shape[0])  # so that one program serves one key and a key per row
    return prompts, prompt_lengths, row_keys, longest, *_choices(config, compute, options)


def _choices(config, compute, options: SamplingOptions) -> tuple[_Traced, _Program]:
    """The options as the program takes them: (the traced ones, the static ones)."""
    top_k = options.top_k
    program = _Program(
        config=config,
        compute=compute,
        max_new_tokens=options.max_new_tokens,
        top_k=None if top_k is None or top_k >= config.vocab_size else top_k,  # keeping all: no filter
        use_top_p=options.top_p is not None,
        top_logprobs=options.top_logprobs,
    )
    traced = _Traced(
        temperature=_scalar(options.temperature, np.float32),
        top_p=_scalar(1.0 if options.top_p is None else options.top_p, np.float32),
        eos_id=_scalar(-1 if options.eos_id is None else options.eos_id, np.int32),
        pad_id=_scalar(options.pad_id, np.int32),
    )
    return traced, program


def lower_generate(params, config: GPTConfig, prompts, prompt_lengths, row_keys, options: SamplingOptions,
                   compute: ComputeConfig | None = None):
    """generate's program lowered, not run, for arguments given as jax.ShapeDtypeStructs with
    their shardings (params; prompts (B, P) int32, P a bucket's width; prompt_lengths (B,);
    row_keys (B,) keys): how jaxgpt.compile compiles it for a TPU topology."""
    traced, program = _choices(config, ComputeConfig() if compute is None else compute, options)
    return _generate_program.lower(params, prompts, prompt_lengths, row_keys, traced, program)


def _scalar(value, dtype):
    """A NumPy scalar, which the programs take as it is (jnp.asarray would compile a conversion
    program of its own), or the value traced under the caller's jit as a jnp scalar."""
    return np.asarray(value, dtype) if is_concrete(value) else jnp.asarray(value, dtype)


def _check_key(key, batch_size: int) -> None:
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return  # a seed: the key is made inside the program, which saves one of its own
    if not isinstance(key, jax.Array):
        raise ValueError(f"key must be a JAX PRNG key (jax.random.key(seed)) or an integer seed, "
                         f"got {type(key).__name__}")
    shape = key.shape if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key.shape[:-1]
    if shape not in ((), (batch_size,)):
        raise ValueError(f"key must be one PRNG key or one per row ({batch_size},), got keys of shape {shape}")


def generate(params, config: GPTConfig, prompts, key, options: SamplingOptions | None = None, *,
             prompt_lengths=None, compute: ComputeConfig | None = None, **option_fields) -> Generation:
    """Continue each prompt by up to max_new_tokens tokens drawn as the module docstring says.

    prompts: a list of token-id sequences (lengths may differ; each is padded up to a length
      bucket, so a few compiled programs serve all prompts), or a (B, P) integer array with
      `prompt_lengths` (B,) when the rows are not all P long (works under jax.jit).
    key: one PRNG key (row b draws with fold_in(key, b)), an integer seed (the key
      jax.random.key(seed)), or a (B,) array of keys, one per row.
    options: a `SamplingOptions`, or instead its fields as keywords
      (`generate(params, cfg, prompts, key, max_new_tokens=20, temperature=0.8)`).
    compute: how the model runs here (kernel, compute dtype; default float32 and the
      explicit kernel): any compute config samples any run. params are used as given: make
      them once beforehand in compute's param dtype and weights (load_run(..., compute=...)
      or jaxgpt.quantize.params_for).

    One compiled program per batch size, prompt bucket and static choice (max_new_tokens,
    top_k, whether top_p is used, top_logprobs); temperature, top_p, eos_id and
    pad_id are traced, so changing them does not recompile.
    """
    options = _options(options, option_fields)
    prompts, prompt_lengths, row_keys, longest, traced, program = _prepare(config, compute, prompts, key,
                                                                           prompt_lengths, options)
    check_params(params, program.compute)
    result = _generate_program(params, prompts, prompt_lengths, row_keys, traced, program)
    if not options.return_logprobs:
        result = result.replace(logprobs=None)
    if longest is not None and longest < prompts.shape[1]:  # drop the bucket's padding
        width = longest + options.max_new_tokens
        result = result.replace(tokens=result.tokens[:, :width])
    return result


_start_program = jax.jit(_start, static_argnames="program")
_step_program = jax.jit(_step, static_argnames="program")


def stream(params, config: GPTConfig, prompts, key, options: SamplingOptions | None = None, *,
           prompt_lengths=None, compute: ComputeConfig | None = None, **option_fields) -> Iterator[Step]:
    """`generate` one step at a time: yields a `Step` as soon as each token is drawn. Same
    arguments and the same tokens as `generate` (whose loop body is the compiled step)."""
    options = _options(options, option_fields)
    prompts, prompt_lengths, row_keys, _, traced, program = _prepare(config, compute, prompts, key, prompt_lengths,
                                                                     options)
    check_params(params, program.compute)
    return _steps(params, prompts, prompt_lengths, row_keys, traced, program, options.return_logprobs)


def _steps(params, prompts, prompt_lengths, row_keys, traced: _Traced, program: _Program,
           return_logprobs: bool) -> Iterator[Step]:
    """The steps of `stream`, a generator apart so that `stream` checks its arguments when called."""
    state = _start_program(params, prompts, prompt_lengths, row_keys, traced, program)
    # Commit the state where it is, as the step's outputs will be: otherwise the second step
    # would compile again for arrays that differ only in being committed to their device.
    state = jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)
    while bool(_going(state, program)):
        state, records = _step_program(params, state, traced, program)
        token, active, logprob, top_ids, top_logprobs = jax.device_get(records)
        yield Step(token=token, active=active, logprob=logprob if return_logprobs else None, top_ids=top_ids,
                   top_logprobs=top_logprobs)
