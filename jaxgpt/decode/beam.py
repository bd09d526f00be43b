"""Beam search: the num_beams most likely continuations of one prompt under the model.

Each step extends every live beam by every token and keeps the num_beams best by
log-probability; a beam that draws EOS is finished and competes on its length-penalised
score log p / (new tokens)^length_penalty. The logits come from `jaxgpt.decode.logits`, so beam
search crops past the context and uses the KV cache exactly as `jaxgpt.decode.sampling.generate`.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxgpt.config import ComputeConfig, GPTConfig, is_int, is_number
from jaxgpt.decode.logits import check_reach, next_logits, prompt_batch, start_cache
from jaxgpt.model import GPT


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
    cache: Any  # the attention form's cache (jaxgpt.attention)
    finished_tokens: jax.Array  # (K, W) the best hypotheses that ended with EOS
    finished_lengths: jax.Array  # (K,)
    finished_scores: jax.Array  # (K,)
    done: jax.Array  # () no live beam can beat the K finished ones any more


def _penalised(log_prob, new_length, length_penalty):
    """A hypothesis's score: log p / (new tokens)^length_penalty."""
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


@jax.jit(static_argnames=("config", "compute", "num_beams", "max_new_tokens"))
def _beam_search_program(params, prompt, prompt_length, eos_id, length_penalty, *, config: GPTConfig,
                         compute: ComputeConfig, num_beams: int, max_new_tokens: int) -> Beams:
    """`beam_search` of one prompt (P,) padded to its bucket, as one compiled while loop."""
    model = GPT(config, compute)
    k, width = num_beams, prompt.shape[0] + max_new_tokens
    tokens = jnp.where(jnp.arange(width) < prompt_length, jnp.pad(prompt, (0, max_new_tokens)), 0)
    tokens = jnp.tile(tokens[None], (k, 1))
    lengths = lambda step: jnp.full((k,), prompt_length + step)  # noqa: E731  every live beam has this length
    state = _BeamState(
        step=jnp.zeros((), jnp.int32),
        tokens=tokens,
        sums=jnp.full((k,), -jnp.inf).at[0].set(0.0),  # one beam to start from, not K copies
        cache=start_cache(params, model, tokens, lengths(0), prompt.shape[0]),
        finished_tokens=tokens,
        finished_lengths=jnp.zeros((k,), jnp.int32),
        finished_scores=jnp.full((k,), -jnp.inf),
        done=jnp.zeros((), bool),
    )

    def step(s):
        logits, cache = next_logits(params, model, s.cache, s.tokens, lengths(s.step), jnp.ones((k,), bool), s.step)
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
                length_penalty: float = 1.0, eos_id: int | None = None, compute: ComputeConfig | None = None) -> Beams:
    """The num_beams most likely continuations of one prompt (a sequence of token ids).

    Each step extends every live beam by every token and keeps the num_beams best; a beam
    that draws eos_id is finished and competes on log p / (new tokens)^length_penalty
    (length_penalty > 0 favours longer continuations, < 0 shorter ones). The search stops
    at max_new_tokens, or sooner once no live beam can beat the finished ones. Past the
    context it crops like `jaxgpt.decode.sampling.generate`. With num_beams=1 and no eos_id this is greedy
    decoding; with num_beams ≥ V^(max_new_tokens−1) it is exhaustive. compute: how the model
    runs here (default float32, the explicit kernel).
    """
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    if not is_int(num_beams) or num_beams < 1:
        raise ValueError(f"num_beams must be a positive integer, got {num_beams!r}")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not is_number(length_penalty):
        raise ValueError(f"length_penalty must be a number, got {length_penalty!r}")
    if eos_id is not None and (not is_int(eos_id) or not 0 <= eos_id < config.vocab_size):
        raise ValueError(f"eos_id must be a token id in 0…{config.vocab_size - 1}, got {eos_id!r}")
    prompts, prompt_lengths, longest = prompt_batch(config, [prompt], None, 0)
    check_reach(config, prompts, longest, max_new_tokens)
    result = _beam_search_program(params, prompts[0], prompt_lengths[0], jnp.int32(-1 if eos_id is None else eos_id),
                                  jnp.float32(length_penalty), config=config, compute=compute or ComputeConfig(),
                                  num_beams=num_beams,
                                  max_new_tokens=max_new_tokens)
    return result.replace(tokens=result.tokens[:, :longest + max_new_tokens])

