"""The reference Muon: optax.contrib.muon on the blocks' matrices (the declarations' axes), AdamW
on the rest, as jaxgpt built it before its banks (jaxgpt.optim.muon), with train.muon_coeffs's table.
Its state's layout is the one checkpoints of that time hold."""

import optax

from jaxgpt.optim import adamw, learning_rate_schedule, muon_dimension_numbers, ns_coefficients, per_param


def optax_muon(train, declared) -> optax.GradientTransformation:
    schedule = learning_rate_schedule(train)
    matrices = optax.contrib.muon(schedule, ns_coeffs=ns_coefficients(train.muon_coeffs), ns_steps=train.muon_ns_steps,
                                  beta=train.muon_momentum,
                                  nesterov=train.muon_nesterov, weight_decay=train.weight_decay,
                                  muon_weight_dimension_numbers=muon_dimension_numbers(declared))
    labels = per_param(lambda leaf: "muon" if leaf.group == "matrix" else "adamw", declared)
    steps = [optax.clip_by_global_norm(train.clip)] if train.clip else []
    return optax.chain(*steps, optax.partition({"muon": matrices, "adamw": adamw(train, schedule, declared)}, labels))
