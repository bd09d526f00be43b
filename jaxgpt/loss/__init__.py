"""What a model says of its targets, from the whole logits or a chunk of tokens at a time
(compute.loss_chunk): the training loss's pieces and each target's log-probability.

    logits_fn(model)        (head, x) → logits: model.unembed, as the chunked loss calls it
    chunk_tokens(compute)   the tokens of one chunk over all devices
    score_targets(model, params, tokens, targets[, cache])   (log p(y_i), y_i is the argmax)

training.loss_fn, evaluation (training.make_eval_step) and the likelihoods of benchmarks
(jaxgpt.score.likelihood) call these, so every path that reads logits reads them the same way.
"""

from __future__ import annotations

import functools

from jaxgpt import ops
from jaxgpt.axes import batch_ways, current_mesh
from jaxgpt.loss import chunked
from jaxgpt.model import GPT, unembed
from jaxgpt.model_config import ComputeConfig


def logits_fn(model: GPT):
    """unembed for the model's config and compute: (head, x) → logits, as the chunked loss calls it."""
    return functools.partial(unembed, model.cfg, model.compute)


def chunk_tokens(compute: ComputeConfig) -> int:
    """The tokens of one chunk of the loss over all devices: compute.loss_chunk on each of the
    devices the rows are split over (under the mesh the program is traced in)."""
    mesh = current_mesh()
    return compute.loss_chunk * (1 if mesh is None else batch_ways(mesh))


def score_targets(model: GPT, params, tokens, targets, cache=None, **kwargs):
    """(log p(y_i), [y_i = argmax of its logits]) of each target (B, T) after tokens (B, T), and
    with a cache the new cache: from the whole logits, or with compute.loss_chunk chunk by chunk
    (chunked.chunked_target_scores). kwargs go to GPT (positions, segments)."""
    chunk = model.compute.loss_chunk
    out = model.apply({"params": params}, tokens, cache, hidden=bool(chunk), **kwargs)
    out, cache = (out, None) if cache is None else out
    if chunk:
        hidden, head = out
        scores = chunked.chunked_target_scores(logits_fn(model), head, hidden, targets,
                                               chunk=chunk_tokens(model.compute))
    else:
        scores = ops.target_scores(out, targets)
    return scores if cache is None else (*scores, cache)
