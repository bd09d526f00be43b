"""Run by tests/test_training.py in a subprocess with 8 fake CPU devices: three train steps
on each mesh shape (data; data, fsdp and tensor at once; tensor), and on one device,
printed as JSON (loss and parameter differences), and an evaluation split over the devices.
tests/test_muon.py runs `run` with other train settings."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxgpt import GPTConfig, sharding  # noqa: E402
from jaxgpt.config import TrainConfig  # noqa: E402
from jaxgpt.model import param_layout  # noqa: E402
from jaxgpt.optim import learning_rate_schedule, make_optimizer  # noqa: E402
from jaxgpt.train.step import init_state, make_train_step, sharded_init  # noqa: E402

TRAIN = TrainConfig(**dict(lr=3e-3, min_lr=1e-4, warmup_steps=1, steps=10, b1=0.9, b2=0.99, weight_decay=0.1, clip=1.0))
# sizes divisible by every mesh axis, so each rule really shards; dropout masks depend on each
# element's global index only (partitionable threefry), so they too are the same on every mesh
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=8, d_model=32, d_ff=64, dropout=0.1)
STEPS, K, B = 3, 2, 8


def batches():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, size=(STEPS, K * B, CFG.block_size + 1)).astype(np.int32)
    return [(t[..., :-1], t[..., 1:]) for t in tokens]


def run(mesh_shape, train=TRAIN, cfg=CFG):
    optimizer, schedule = make_optimizer(train, param_layout(cfg)), learning_rate_schedule(train)
    step_fn = make_train_step(cfg, optimizer, schedule, grad_accum=K)
    key = jax.random.key(0)
    if mesh_shape is None:
        state = init_state(cfg, optimizer, key)
        step = jax.jit(step_fn)
        put = lambda x: x  # noqa: E731
    else:
        mesh = sharding.make_mesh(dict(zip(sharding.AXES, mesh_shape, strict=True)))
        state, shardings = sharded_init(cfg, optimizer, key, mesh)
        batch_sharding = sharding.batch_sharding(mesh)
        step = jax.jit(step_fn, in_shardings=(shardings, (batch_sharding, batch_sharding), None),
                       out_shardings=(shardings, None))
        put = lambda x: jax.device_put(x, batch_sharding)  # noqa: E731
    losses = []
    for i, (x, y) in enumerate(batches()):
        state, metrics = step(state, (put(x), put(y)), jax.random.fold_in(key, i))
        losses.append(float(metrics["loss"]))
    sharded_leaves = sum(len(leaf.sharding.device_set) > 1 and not leaf.sharding.is_fully_replicated
                         for leaf in jax.tree.leaves(state.params))
    return losses, jax.device_get(state.params), sharded_leaves, state


def evaluation(params):
    """eval.py's split of a batch's rows (sharding.rows_mesh: the most devices that divide the batch,
    every parameter on each) against one device's evaluation of the same windows."""
    from jaxgpt.train.evaluation import evaluate_tokens

    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, size=6 * 4 * CFG.block_size + 1).astype(np.int32)
    one = evaluate_tokens(CFG, params, tokens, 1.0, batch_size=6)
    mesh = sharding.rows_mesh(6)
    with jax.set_mesh(mesh):
        split = evaluate_tokens(CFG, sharding.replicated(params, mesh), tokens, 1.0, batch_size=6,
                                batch_sharding=sharding.batch_sharding(mesh))
    return {"devices": {b: sharding.rows_mesh(b).shape["data"] for b in (6, 7, 8, 12)},
            "loss_diff": abs(split["val_loss"] - one["val_loss"]), "tokens": [one["val_tokens"], split["val_tokens"]]}


def main():
    assert jax.device_count() == 8, jax.devices()
    ref_losses, ref_params, _, _ = run(None)
    out = {}
    for shape in [(8, 1, 1), (2, 2, 2), (1, 1, 8)]:
        losses, params, sharded_leaves, _ = run(shape)
        pairs = zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
        diff = max(float(np.abs(a - b).max()) for a, b in pairs)
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        out[str(shape)] = {"loss_diff": loss_diff, "param_diff": diff, "sharded_leaves": sharded_leaves}
    out["evaluation"] = evaluation(ref_params)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
