"""Sampling from a GPT: the next-token maths as pure functions, a jitted `generate` that
decodes with the KV cache, beam search, and a run directory loaded for notebooks and
`sample.py`.

Each new token is drawn from the model's distribution over the next token given the
sequence so far, filtered in this order:

    z = logits(crop(x)) / τ               temperature τ (τ = 0: greedy, x_{n+1} = argmax z)
    z = z outside the k largest → −∞      top-k
    z = z outside the nucleus → −∞        top-p: the smallest set of most likely tokens
                                          whose probability under softmax(z) reaches p
    x_{n+1} ~ softmax(z)

crop(x) is the last block_size tokens of x, at positions 0 … block_size−1: the model never
sees more, and a sequence longer than the context continues exactly as recomputing the
cropped context for every token would (nanoGPT's sample.py).

What a new token costs:

- While the sequence fits in the context (n ≤ block_size): one position through the model.
  The prompts are prefilled in one parallel pass, then each step feeds only the newest
  token, whose keys and values join the cache; attention reads the cached ones.
- Past the context (n > block_size): one parallel pass over the block_size tokens of the
  window, for every `positions` option, because cropping changes every hidden state of the
  window. With learned or sinusoidal positions every token moves to a new position, so even
  the first layer's keys change. With rope the first layer's keys could be re-rotated and
  with alibi or none they do not change at all (scores depend on distances only), but from
  the second layer on every key and value is a function of all the tokens before it in the
  window, and the window has just lost its first token. A rolling cache that keeps the old
  keys would be cheaper, but it is a different model (its keys still carry the dropped
  token), so it is not used. The pass costs about block_size cached steps of arithmetic,
  done as one batch of matrix products. It also refills the cache, so that once the rows
  past the context have stopped, the others go on from the cache.
- When generation can go past the context at all (prompt bucket + max_new_tokens >
  block_size), that window pass is also the prefill: one compiled pass fewer, for a first
  token that costs what each token past the context costs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt import tokenizers
from jaxgpt.checkpoint import Checkpoints
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT, KVCache, init_cache

# --- the sampling maths: pure functions of logits (V,) or (..., V) ---------------------------


def apply_temperature(logits, temperature):
    """z / τ for τ > 0: τ < 1 sharpens the distribution, τ > 1 flattens it."""
    return logits / temperature


def top_k_filter(logits, k: int):
    """Keep exactly the k largest logits (ties go to the lower token id); the rest → −∞."""
    k = min(k, logits.shape[-1])
    _, kept = jax.lax.top_k(logits, k)  # lax.top_k puts the lower index first among equals
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


def filter_logits(logits, temperature, top_k: Optional[int] = None, top_p=None):
    """Temperature, then top-k, then top-p: the logits that a sample is drawn from (τ > 0)."""
    logits = apply_temperature(logits, temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    return logits


def sample_token(key, logits, temperature=1.0, top_k: Optional[int] = None, top_p=None):
    """One token x ~ softmax(filter_logits(logits)) for logits (V,); argmax when τ = 0.

    temperature and top_p may be traced values; top_k is a static int (or None)."""
    return sample_at(jax.random.uniform(key), logits, temperature, top_k, top_p)


def sample_at(u, logits, temperature=1.0, top_k: Optional[int] = None, top_p=None):
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


def check_sampling_options(temperature=1.0, top_k=None, top_p=None) -> None:
    """Raise ValueError (one line, what is wrong and what is allowed) for impossible options."""
    if not _is_number(temperature) or not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number ≥ 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer (how many most likely tokens to keep), got {top_k!r}")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (the probability mass of the tokens kept), got {top_p!r}")


# --- the model's next-token logits: from the cache, or by recomputing the cropped context ----


def _last_tokens(tokens, lengths):
    """Each row's newest token, (B, 1)."""
    return jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)


def _recomputed_logits(params, cfg: GPTConfig, tokens, lengths, width: int, cache_length: int):
    """Next-token logits (B, V) by one pass over each row's last `width` tokens (its whole
    sequence, left-aligned, when shorter: the causal mask hides what follows it), and a
    fresh cache holding those tokens (valid to go on from for the rows that fit in it; the
    others were cropped). Serves as the prefill and as the step past the context."""
    starts = jnp.maximum(lengths - width, 0)
    windows = jax.vmap(lambda row, start: jax.lax.dynamic_slice(row, (start,), (width,)))(tokens, starts)
    logits, cache = GPT(cfg).apply({"params": params}, windows, init_cache(cfg, tokens.shape[0], cache_length))
    return jnp.take_along_axis(logits, (lengths - starts - 1)[:, None, None], axis=1)[:, 0], cache


def _cached_logits(params, cfg: GPTConfig, cache: KVCache, tokens, lengths):
    """Next-token logits (B, V) by feeding each row's newest token at its position: the cache
    holds the ones before it (and perhaps it too: writing it again changes nothing). Rows
    that stopped growing are clamped inside the cache (their output is not used)."""
    cache = cache.replace(index=jnp.minimum(lengths - 1, cache.max_length - 1))
    logits, cache = GPT(cfg).apply({"params": params}, _last_tokens(tokens, lengths), cache)
    return logits[:, 0], cache


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
    logprobs: Optional[jax.Array] = None
    top_ids: Optional[jax.Array] = None
    top_logprobs: Optional[jax.Array] = None

    def new_tokens(self) -> list[np.ndarray]:
        """Each row's generated tokens, as NumPy arrays."""
        tokens, lengths, starts = jax.device_get((self.tokens, self.lengths, self.prompt_lengths))
        return [row[start:end] for row, start, end in zip(tokens, starts, lengths)]


class Step(NamedTuple):
    """One step of `stream`, NumPy arrays over the rows: the token each row drew (pad_id for
    rows that had already stopped), whether the row was still going, and the step's records
    as in `Generation` (None unless asked for)."""

    token: np.ndarray
    active: np.ndarray
    logprob: Optional[np.ndarray]
    top_ids: Optional[np.ndarray]
    top_logprobs: Optional[np.ndarray]


@dataclasses.dataclass(frozen=True)
class _Program:
    """The static choices that select a compiled program (with the argument shapes)."""

    config: GPTConfig
    max_new_tokens: int
    top_k: Optional[int]
    use_top_p: bool
    top_logprobs: int


@flax.struct.dataclass
class _Options:
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
    cache: KVCache
    logprobs: jax.Array  # (B, max_new_tokens), always kept: cheap, and one program fewer
    top_ids: Optional[jax.Array]
    top_logprobs: Optional[jax.Array]


@jax.jit(static_argnames="batch_size")  # eager, the vmap would be traced anew on every call
def _row_keys(key, batch_size: int):
    """One key per row: the given ones, or fold_in(key, b) for row b. Row b's draws use
    uniform(its key, (max_new_tokens,)), so they depend only on its key and prompt, not on
    the rest of the batch."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # a raw uint32 key (jax.random.PRNGKey)
    if key.shape == ():
        return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(batch_size))
    return key


def _start(params, prompts, prompt_lengths, row_keys, options: _Options, program: _Program) -> _State:
    """The buffer of prompts with room for the new tokens, the randomness of every draw, the
    records, and the cache to start from."""
    batch, width = prompts.shape[0], prompts.shape[1] + program.max_new_tokens
    positions = jnp.arange(width)[None, :]
    padded = jnp.pad(prompts.astype(jnp.int32), ((0, 0), (0, program.max_new_tokens)))
    tokens = jnp.where(positions < prompt_lengths[:, None], padded, options.pad_id)
    records = (batch, program.max_new_tokens)
    k = program.top_logprobs
    return _State(
        step=jnp.zeros((), jnp.int32),
        tokens=tokens,
        lengths=prompt_lengths,
        active=jnp.ones((batch,), bool),
        # drawn before the loop, which then only reads them
        uniforms=jax.vmap(lambda key: jax.random.uniform(key, (program.max_new_tokens,)))(row_keys),
        cache=_start_cache(params, program.config, tokens, prompt_lengths, prompts.shape[1]),
        logprobs=jnp.zeros(records, jnp.float32),
        top_ids=jnp.zeros((*records, k), jnp.int32) if k else None,
        top_logprobs=jnp.zeros((*records, k), jnp.float32) if k else None,
    )


def _start_cache(params, cfg: GPTConfig, tokens, lengths, prompt_width: int) -> KVCache:
    """The cache to start decoding from. When every sequence fits in the context (buffer
    width ≤ block_size) the prompts are prefilled now; otherwise it starts empty and the
    first step's pass over the context windows fills it (one compiled pass fewer; that
    first step costs one window pass, as does every step past the context)."""
    width = tokens.shape[1]
    if width > cfg.block_size:
        return init_cache(cfg, tokens.shape[0], cfg.block_size)
    return _recomputed_logits(params, cfg, tokens, lengths, prompt_width, width)[1]


def _next_logits(params, cfg: GPTConfig, cache: KVCache, tokens, lengths, active, step):
    """Every row's next-token logits (B, V) and the cache: from the cache (one position per
    row) when every active row fits in the context and the cache is filled, else by one
    pass over each row's cropped context, which refills the cache."""
    from_cache = lambda: _cached_logits(params, cfg, cache, tokens, lengths)  # noqa: E731
    if tokens.shape[1] <= cfg.block_size:  # every sequence fits, and _start_cache prefilled the prompts
        return from_cache()
    fits = (step > 0) & jnp.all(~active | (lengths <= cfg.block_size))
    window = cfg.block_size
    return jax.lax.cond(fits, from_cache, lambda: _recomputed_logits(params, cfg, tokens, lengths, window, window))


def _step(params, state: _State, options: _Options, program: _Program):
    """Draw each active row's next token and append it; returns the new state and this
    step's records (token, whether the row was active, logprob, top ids, top logprobs)."""
    logits, cache = _next_logits(params, program.config, state.cache, state.tokens, state.lengths, state.active,
                                 state.step)
    state = state.replace(cache=cache)
    top_p = options.top_p if program.use_top_p else None
    draw = jax.vmap(lambda u, row: sample_at(u, row, options.temperature, program.top_k, top_p))
    active = state.active
    token = jnp.where(active, draw(state.uniforms[:, state.step], logits), options.pad_id)
    rows = jnp.arange(token.shape[0])
    tokens = state.tokens.at[rows, state.lengths].set(token, mode="drop")

    log_probs = jax.nn.log_softmax(logits, axis=-1)
    logprob = jnp.where(active, jnp.take_along_axis(log_probs, token[:, None], axis=1)[:, 0], 0.0)
    records = {"logprobs": state.logprobs.at[:, state.step].set(logprob)}
    top_ids = top_logprobs = None
    if program.top_logprobs:
        values, ids = jax.lax.top_k(log_probs, program.top_logprobs)
        top_ids = jnp.where(active[:, None], ids, options.pad_id)
        top_logprobs = jnp.where(active[:, None], values, 0.0)
        records["top_ids"] = state.top_ids.at[:, state.step].set(top_ids)
        records["top_logprobs"] = state.top_logprobs.at[:, state.step].set(top_logprobs)

    state = state.replace(
        step=state.step + 1,
        tokens=tokens,
        lengths=state.lengths + active,
        active=active & (token != options.eos_id),
        **records,
    )
    return state, (token, active, logprob, top_ids, top_logprobs)


def _going(state: _State, program: _Program):
    return (state.step < program.max_new_tokens) & jnp.any(state.active)


@jax.jit(static_argnames="program")
def _generate_program(params, prompts, prompt_lengths, row_keys, options: _Options, program: _Program) -> Generation:
    state = _start(params, prompts, prompt_lengths, row_keys, options, program)
    state = jax.lax.while_loop(lambda s: _going(s, program), lambda s: _step(params, s, options, program)[0], state)
    return Generation(tokens=state.tokens, lengths=state.lengths, prompt_lengths=prompt_lengths,
                      logprobs=state.logprobs, top_ids=state.top_ids, top_logprobs=state.top_logprobs)


def _prepare(config, prompts, key, prompt_lengths, max_new_tokens, temperature, top_k, top_p, eos_id, pad_id,
             top_logprobs):
    """Check the arguments and put them in the form the compiled programs take."""
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    # Traced values (under the caller's jit) cannot be checked here.
    check_sampling_options(temperature if _is_concrete(temperature) else 1.0, top_k,
                           top_p if _is_concrete(top_p) else None)
    for name, token_id in (("eos_id", eos_id), ("pad_id", pad_id)):
        if token_id is not None and (not _is_int(token_id) or not 0 <= token_id < config.vocab_size):
            raise ValueError(f"{name} must be a token id in 0…{config.vocab_size - 1}, got {token_id!r}")
    if not _is_int(top_logprobs) or not 0 <= top_logprobs <= config.vocab_size:
        raise ValueError(f"top_logprobs must be an integer in 0…vocab_size={config.vocab_size}, got {top_logprobs!r}")
    prompts, prompt_lengths, longest = _prompt_batch(config, prompts, prompt_lengths, pad_id)
    _check_key(key, prompts.shape[0])
    row_keys = _row_keys(key, prompts.shape[0])  # so that one program serves one key and a key per row
    program = _Program(
        config=config,
        max_new_tokens=max_new_tokens,
        top_k=None if top_k is None or top_k >= config.vocab_size else top_k,  # keeping all: no filter
        use_top_p=top_p is not None,
        top_logprobs=top_logprobs,
    )
    options = _Options(
        temperature=jnp.asarray(temperature, jnp.float32),
        top_p=jnp.asarray(1.0 if top_p is None else top_p, jnp.float32),
        eos_id=jnp.asarray(-1 if eos_id is None else eos_id, jnp.int32),
        pad_id=jnp.asarray(pad_id, jnp.int32),
    )
    return prompts, prompt_lengths, row_keys, longest, options, program


def generate(params, config: GPTConfig, prompts, key, *, max_new_tokens: int, temperature=1.0,
             top_k: Optional[int] = None, top_p=None, eos_id: Optional[int] = None, return_logprobs: bool = False,
             top_logprobs: int = 0, prompt_lengths=None, pad_id: int = 0) -> Generation:
    """Continue each prompt by up to max_new_tokens tokens drawn as the module docstring says.

    prompts: a list of token-id sequences (lengths may differ; each is padded up to a length
      bucket, so a few compiled programs serve all prompts), or a (B, P) integer array with
      `prompt_lengths` (B,) when the rows are not all P long (works under jax.jit).
    key: one PRNG key (row b draws with fold_in(key, b)) or a (B,) array of keys, one per row.
    temperature: τ ≥ 0, 0 for greedy. top_k, top_p: None for no filter.
    eos_id: a row that draws it stops there (the EOS is kept, pad_id follows); the loop ends
      when every row has stopped.
    return_logprobs, top_logprobs=K: also record the model's log-probability of each new
      token, and the K most likely next tokens at each step (see `Generation`).

    One compiled program per batch size, prompt bucket and static choice (max_new_tokens,
    top_k, whether top_p is used, top_logprobs); temperature, top_p, eos_id and
    pad_id are traced, so changing them does not recompile.
    """
    prompts, prompt_lengths, row_keys, longest, options, program = _prepare(
        config, prompts, key, prompt_lengths, max_new_tokens, temperature, top_k, top_p, eos_id, pad_id,
        top_logprobs)
    result = _generate_program(params, prompts, prompt_lengths, row_keys, options, program)
    if not return_logprobs:
        result = result.replace(logprobs=None)
    if longest is not None and longest < prompts.shape[1]:  # drop the bucket's padding
        width = longest + max_new_tokens
        result = result.replace(tokens=result.tokens[:, :width])
    return result


_start_program = jax.jit(_start, static_argnames="program")
_step_program = jax.jit(_step, static_argnames="program")


def stream(params, config: GPTConfig, prompts, key, *, max_new_tokens: int, temperature=1.0,
           top_k: Optional[int] = None, top_p=None, eos_id: Optional[int] = None, return_logprobs: bool = False,
           top_logprobs: int = 0, prompt_lengths=None, pad_id: int = 0) -> Iterator[Step]:
    """`generate` one step at a time: yields a `Step` as soon as each token is drawn. Same
    arguments and the same tokens as `generate` (whose loop body is the compiled step)."""
    prompts, prompt_lengths, row_keys, _, options, program = _prepare(
        config, prompts, key, prompt_lengths, max_new_tokens, temperature, top_k, top_p, eos_id, pad_id,
        top_logprobs)
    state = _start_program(params, prompts, prompt_lengths, row_keys, options, program)
    # Commit the state where it is, as the step's outputs will be: otherwise the second step
    # would compile again for arrays that differ only in being committed to their device.
    state = jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)
    while bool(_going(state, program)):
        state, records = _step_program(params, state, options, program)
        token, active, logprob, top_ids, top_logprobs = jax.device_get(records)
        yield Step(token=token, active=active, logprob=logprob if return_logprobs else None, top_ids=top_ids,
                   top_logprobs=top_logprobs)


# --- beam search ------------------------------------------------------------------------------


@flax.struct.dataclass
class Beams:
    """What `beam_search` returns, best first: tokens (K, P + max_new_tokens) each the prompt
    and a continuation (0 from lengths[k] on), lengths (K,), and scores (K,): the
    continuation's log-probability divided by (its length)^length_penalty (−∞ for slots
    that no hypothesis reached)."""

    tokens: jax.Array
    lengths: jax.Array
    scores: jax.Array


@flax.struct.dataclass
class _BeamState:
    """What the beam search loop carries from one step to the next."""

    step: jax.Array  # () tokens added so far; every live beam has prompt length + step tokens
    tokens: jax.Array  # (K, W) live beams
    sums: jax.Array  # (K,) their log-probabilities (−∞: no beam in this slot)
    cache: Optional[KVCache]
    finished_tokens: jax.Array  # (K, W) the best hypotheses that ended with EOS
    finished_lengths: jax.Array  # (K,)
    finished_scores: jax.Array  # (K,)
    done: jax.Array  # () no live beam can beat the K finished ones any more


def _penalised(log_prob, new_length, length_penalty):
    return log_prob / new_length.astype(jnp.float32) ** length_penalty


def _keep_best(scores, *arrays, k: int):
    """The k highest scores and the matching rows of each array."""
    best, rows = jax.lax.top_k(scores, k)
    return best, *(a[rows] for a in arrays)


def _beam_step(state: _BeamState, logits, prompt_length, eos_id, length_penalty, max_new_tokens: int):
    """Extend every live beam by every token: those ending in EOS compete for the finished
    slots, the others for the K live slots. Returns the new state and each new beam's origin."""
    k, vocab = logits.shape
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    length = prompt_length + state.step  # of every live beam
    new_length = state.step + 1

    has_eos = eos_id >= 0
    ended = jnp.where(has_eos, state.sums + log_probs[:, jnp.maximum(eos_id, 0)], -jnp.inf)
    ended_tokens = state.tokens.at[:, length].set(jnp.maximum(eos_id, 0))
    finished_scores, finished_tokens, finished_lengths = _keep_best(
        jnp.concatenate([state.finished_scores, _penalised(ended, new_length, length_penalty)]),
        jnp.concatenate([state.finished_tokens, ended_tokens]),
        jnp.concatenate([state.finished_lengths, jnp.full((k,), length + 1)]),
        k=k,
    )

    extended = state.sums[:, None] + log_probs
    extended = jnp.where(jnp.arange(vocab)[None, :] == eos_id, -jnp.inf, extended)
    sums, flat = jax.lax.top_k(extended.reshape(-1), k)
    origin, token = flat // vocab, (flat % vocab).astype(jnp.int32)
    tokens = state.tokens[origin].at[:, length].set(token)

    # Log-probabilities only fall, so a live beam's best final score is its score now at the
    # shortest or the longest length still possible (which one depends on the penalty's sign).
    reachable = jnp.maximum(_penalised(sums, new_length + 1, length_penalty),
                            _penalised(sums, jnp.asarray(max_new_tokens), length_penalty))
    done = jnp.all(finished_scores > -jnp.inf) & (jnp.max(reachable) <= jnp.min(finished_scores))
    state = state.replace(step=state.step + 1, tokens=tokens, sums=sums, finished_tokens=finished_tokens,
                          finished_lengths=finished_lengths, finished_scores=finished_scores, done=done)
    return state, origin


@jax.jit(static_argnames=("config", "num_beams", "max_new_tokens"))
def _beam_search_program(params, prompt, prompt_length, eos_id, length_penalty, *, config: GPTConfig,
                         num_beams: int, max_new_tokens: int) -> Beams:
    k, width = num_beams, prompt.shape[0] + max_new_tokens
    tokens = jnp.where(jnp.arange(width) < prompt_length, jnp.pad(prompt, (0, max_new_tokens)), 0)
    tokens = jnp.tile(tokens[None], (k, 1))
    lengths = lambda step: jnp.full((k,), prompt_length + step)  # noqa: E731  every live beam has this length
    state = _BeamState(
        step=jnp.zeros((), jnp.int32),
        tokens=tokens,
        sums=jnp.full((k,), -jnp.inf).at[0].set(0.0),  # one beam to start from, not K copies
        cache=_start_cache(params, config, tokens, lengths(0), prompt.shape[0]),
        finished_tokens=tokens,
        finished_lengths=jnp.zeros((k,), jnp.int32),
        finished_scores=jnp.full((k,), -jnp.inf),
        done=jnp.zeros((), bool),
    )

    def step(s):
        logits, cache = _next_logits(params, config, s.cache, s.tokens, lengths(s.step), jnp.ones((k,), bool), s.step)
        s, origin = _beam_step(s, logits, prompt_length, eos_id, length_penalty, max_new_tokens)
        return s.replace(cache=jax.tree.map(lambda x: x[origin], cache))  # each beam takes its origin's cache

    state = jax.lax.while_loop(lambda s: (s.step < max_new_tokens) & ~s.done, step, state)

    # Live beams that reached max_new_tokens are finished hypotheses too.
    complete = state.step == max_new_tokens
    live_scores = jnp.where(complete, _penalised(state.sums, state.step, length_penalty), -jnp.inf)
    scores, tokens, lengths = _keep_best(
        jnp.concatenate([state.finished_scores, live_scores]),
        jnp.concatenate([state.finished_tokens, state.tokens]),
        jnp.concatenate([state.finished_lengths, jnp.full((k,), prompt_length + state.step)]),
        k=k,
    )
    lengths = jnp.where(scores > -jnp.inf, lengths, prompt_length)
    tokens = jnp.where(jnp.arange(width)[None, :] < lengths[:, None], tokens, 0)
    return Beams(tokens=tokens, lengths=lengths, scores=scores)


def beam_search(params, config: GPTConfig, prompt, *, num_beams: int, max_new_tokens: int,
                length_penalty: float = 1.0, eos_id: Optional[int] = None) -> Beams:
    """The num_beams most likely continuations of one prompt (a sequence of token ids).

    Each step extends every live beam by every token and keeps the num_beams best; a beam
    that draws eos_id is finished and competes on log p / (new tokens)^length_penalty
    (length_penalty > 0 favours longer continuations, < 0 shorter ones). The search stops
    at max_new_tokens, or sooner once no live beam can beat the finished ones. Past the
    context it crops like `generate`. With num_beams=1 and no eos_id this is greedy
    decoding; with num_beams ≥ V^(max_new_tokens−1) it is exhaustive.
    """
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    if not _is_int(num_beams) or num_beams < 1:
        raise ValueError(f"num_beams must be a positive integer, got {num_beams!r}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not _is_number(length_penalty):
        raise ValueError(f"length_penalty must be a number, got {length_penalty!r}")
    if eos_id is not None and (not _is_int(eos_id) or not 0 <= eos_id < config.vocab_size):
        raise ValueError(f"eos_id must be a token id in 0…{config.vocab_size - 1}, got {eos_id!r}")
    prompts, prompt_lengths, longest = _prompt_batch(config, [prompt], None, 0)
    result = _beam_search_program(params, prompts[0], prompt_lengths[0], jnp.int32(-1 if eos_id is None else eos_id),
                                  jnp.float32(length_penalty), config=config, num_beams=num_beams,
                                  max_new_tokens=max_new_tokens)
    return result.replace(tokens=result.tokens[:, :longest + max_new_tokens])


# --- prompts -------------------------------------------------------------------------------------

MIN_BUCKET = 8


def prompt_bucket(length: int) -> int:
    """The padded prompt width for prompts up to `length` tokens: the next power of two
    (at least MIN_BUCKET), so that a few compiled programs serve every prompt length."""
    return max(MIN_BUCKET, 1 << (length - 1).bit_length())


def _prompt_batch(config: GPTConfig, prompts, prompt_lengths, pad_id):
    """(prompts (B, P) int32, lengths (B,) int32, longest prompt or None for array input)."""
    if isinstance(prompts, (jax.Array, np.ndarray)):
        if prompts.ndim != 2 or not jnp.issubdtype(prompts.dtype, jnp.integer):
            raise ValueError(f"prompts as an array must be (batch, length) integers, got shape {prompts.shape} "
                             f"{prompts.dtype}")
        batch, width = prompts.shape
        lengths = jnp.full((batch,), width, jnp.int32) if prompt_lengths is None else jnp.asarray(prompt_lengths)
        if lengths.shape != (batch,):
            raise ValueError(f"prompt_lengths must have shape ({batch},), one length per prompt, got {lengths.shape}")
        if batch == 0 or width == 0:
            raise ValueError("prompts is empty: give at least one prompt of at least one token")
        if _is_concrete(prompts) and _is_concrete(lengths):
            _check_ids(config, np.asarray(prompts)[np.arange(width)[None, :] < np.asarray(lengths)[:, None]])
            if not np.all((1 <= np.asarray(lengths)) & (np.asarray(lengths) <= width)):
                raise ValueError(f"prompt_lengths must be in 1…{width} (the prompts' width), got {lengths}")
        return jnp.asarray(prompts, jnp.int32), lengths.astype(jnp.int32), None
    if prompt_lengths is not None:
        raise ValueError("prompt_lengths is for a padded (B, P) array of prompts; a list of prompts has its lengths")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id sequences (or a (B, P) array)")
    rows = []
    for b, prompt in enumerate(prompts):
        if isinstance(prompt, (int, np.integer)):
            raise ValueError("prompts must be a list of token-id sequences, one per row: for one prompt pass [prompt]")
        row = np.asarray(prompt)
        if row.ndim != 1 or row.size == 0 or not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"prompt {b} must be a non-empty sequence of token ids, got {prompt!r:.80}")
        rows.append(row)
    longest = max(len(row) for row in rows)
    padded = np.full((len(rows), prompt_bucket(longest)), pad_id, np.int64)
    for b, row in enumerate(rows):
        padded[b, :len(row)] = row
    _check_ids(config, np.concatenate(rows))
    lengths = np.array([len(row) for row in rows], np.int32)
    return jnp.asarray(padded, jnp.int32), jnp.asarray(lengths), longest


def _check_ids(config: GPTConfig, ids: np.ndarray) -> None:
    outside = (ids < 0) | (ids >= config.vocab_size)
    if outside.any():
        bad = ids[outside][0]
        raise ValueError(f"prompt token {bad} is not an id of this model's vocabulary 0…{config.vocab_size - 1}")


def _check_key(key, batch_size: int) -> None:
    if not isinstance(key, jax.Array):
        raise ValueError(f"key must be a JAX PRNG key (jax.random.key(seed)), got {type(key).__name__}")
    shape = key.shape if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key.shape[:-1]
    if shape not in ((), (batch_size,)):
        raise ValueError(f"key must be one PRNG key or one per row ({batch_size},), got keys of shape {shape}")


# --- run directories and text --------------------------------------------------------------


def load_run(run_dir, step: Optional[int] = None):
    """(params, config, tokenizer) of a training run: config.json, tokenizer.json and the
    params of the best checkpoint by validation loss (the latest if none was evaluated), or
    of `step`. Raises ValueError for a missing or malformed run directory and
    jaxgpt.checkpoint.CheckpointError when it holds no usable checkpoint."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist: pass the directory a training run wrote")
    config_path, tokenizer_path = run_dir / "config.json", run_dir / "tokenizer.json"
    for path in (config_path, tokenizer_path):
        if not path.is_file():
            raise ValueError(f"{run_dir} has no {path.name}, so it is not a complete run directory")
    try:
        config = GPTConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8"))["model"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{config_path} does not hold a model config ({type(err).__name__}: {err})") from None
    tokenizer = tokenizers.load(tokenizer_path)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"{tokenizer_path} has {tokenizer.vocab_size} tokens but the model only "
                         f"{config.vocab_size}: the tokenizer is not the one the run was trained with")
    abstract = jax.eval_shape(lambda: GPT(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"])
    checkpoints = Checkpoints(run_dir, read_only=True)
    try:
        params, _ = checkpoints.restore_params(abstract, step=step)
    finally:
        checkpoints.close()
    return params, config, tokenizer


def encode_prompt(tokenizer: tokenizers.Tokenizer, text: str) -> list[int]:
    """The token ids of a prompt; ValueError for an empty prompt or one that holds characters
    (char tokenizer) or words (word tokenizer) that the tokenizer has no token for."""
    if not text:
        raise ValueError("the prompt is empty: give at least one character for the model to continue")
    if tokenizer.count_unknown(text):
        if tokenizer.kind == "char":
            what, pieces = "characters", dict.fromkeys(c for c in text if tokenizer.count_unknown(c))
        else:
            what, pieces = "words", dict.fromkeys(w for w in text.split() if tokenizer.count_unknown(w))
        shown = ", ".join(map(repr, pieces))
        raise ValueError(f"the prompt holds {what} the tokenizer cannot encode: {shown} (it knows only the {what} of "
                         "its training text); remove or replace them")
    return tokenizer.encode(text)


def generate_text(params, config: GPTConfig, tokenizer: tokenizers.Tokenizer, prompts: str | Sequence[str],
                  seed: int = 0, *, max_new_tokens: int = 256, temperature=1.0, top_k: Optional[int] = None,
                  top_p=None, stop_at_eos: bool = True) -> str | list[str]:
    """Text in, text out: the continuation of each prompt (without the prompt), drawn with
    `generate`. One prompt gives one string, a list of prompts a list."""
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids = [encode_prompt(tokenizer, text) for text in texts]
    eos_id = tokenizer.eos_id if stop_at_eos and tokenizer.eos_id is not None else None
    result = generate(params, config, ids, jax.random.key(seed), max_new_tokens=max_new_tokens,
                      temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id)
    continuations = [tokenizer.decode(row) for row in result.new_tokens()]
    return continuations[0] if isinstance(prompts, str) else continuations


def format_next_tokens(tokenizer: tokenizers.Tokenizer, context: Sequence[int], top_ids, top_logprobs,
                       context_chars: int = 40) -> str:
    """One line: the end of the context, ↦, then the likeliest next tokens with their
    probabilities, e.g. "…The Steenrod problem for ↦ ' closed' 29%, ' spaces' 24%"."""
    text = tokenizer.decode(list(context), keep_special=True)
    shown = ("…" + text[-context_chars:] if len(text) > context_chars else text).replace("\n", "⏎")
    choices = ", ".join(f"{tokenizer.decode([int(i)], keep_special=True)!r} {_percent(float(np.exp(lp)))}"
                        for i, lp in zip(top_ids, top_logprobs))
    return f"{shown} ↦ {choices}"


class TextStream:
    """Decoding token by token for printing text as it comes: `push(id)` returns the new
    text, holding back a character whose UTF-8 bytes have not all arrived; `finish()`
    returns what is still held back."""

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids)
        return "" if text.endswith("\ufffd") else self._show(text)

    def finish(self) -> str:
        return self._show(self.tokenizer.decode(self.ids))

    def _show(self, text: str) -> str:
        """The part of `text` not shown yet (printed text cannot change: none if it did)."""
        new = text[len(self.shown):] if text.startswith(self.shown) else ""
        self.shown = text
        return new


# --- small helpers ----------------------------------------------------------------------


def _percent(p: float) -> str:
    return f"{p:.0%}" if p >= 0.01 else "<1%"


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)

