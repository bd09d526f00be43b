"""The schedules of a step's batch (jaxgpt.batch_schedule): its rows, the length of its rows and how
far back attention reaches, as functions of the step. Worked examples of the shapes and the tokens
before a step; the window against the float64 reference with the local form's mask; a scheduled
run that stops and resumes ends where an uninterrupted one does, each step's batch its own shape;
each setting that cannot work refused in one line."""

import json

import numpy as np
import pytest
import reference as ref
from runs import tiny_config
from test_model import forward, random_params, tiny, tokens
from test_run import assert_trees_close, corpus, final_params  # noqa: F401 - corpus: the module fixture

from jaxgpt import GPT, batch_schedule
from jaxgpt.config import TrainConfig
from jaxgpt.errors import ConfigError
from jaxgpt.train.opening import open_train
from jaxgpt.train.preflight import check_schedules

Shape = batch_schedule.Shape


def test_each_steps_shape_and_the_tokens_before_it():
    """Rows 4 before step 2 then 12; rows of 8 tokens before step 3 then the block's 16; a window of
    4 before step 1, of 6 before step 4, then none: the steps' shapes by hand, and the tokens before
    each step their running sum."""
    train = TrainConfig(batch_size=4, grad_accum=3, batch_schedule=((2, 4),), length_schedule=[[3, 8]],
                        window_schedule=((1, 4), (4, 6)), steps=7, warmup_steps=1)
    by_hand = [Shape(4, 8, 4), Shape(4, 8, 6), Shape(12, 8, 6), Shape(12, 16, 6), Shape(12, 16, None),
               Shape(12, 16, None), Shape(12, 16, None)]
    assert [batch_schedule.shape_at(train, 16, t) for t in range(7)] == by_hand
    tokens_by_hand = np.cumsum([0] + [shape.rows * shape.length for shape in by_hand])
    assert [batch_schedule.tokens_before(train, 16, t) for t in range(8)] == list(tokens_by_hand)
    assert set(batch_schedule.shapes(train, 16)) == set(by_hand) and len(batch_schedule.shapes(train, 16)) == 5
    assert batch_schedule.shapes(train, 16, start=3, end=5) == (Shape(12, 16, None), Shape(12, 16, 6))  # a resume
    assert batch_schedule.shapes(train, 16, start=9) == ()  # resumed past train.steps: no step to compile
    assert [batch_schedule.rows_before(train.batch_schedule, 12, t) for t in range(5)] == [0, 4, 8, 20, 32]


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_a_window_is_the_float64_reference_with_the_local_mask(positions):
    """GPT(cfg)(x, window=w): each query sees itself and the w − 1 tokens before it, as the float64
    reference computes attention='local' (0 ≤ t − s < w); the same weights, the model unchanged."""
    cfg = tiny(positions=positions)
    params, x = random_params(cfg), tokens(cfg, 2, 12)
    want = ref.gpt_forward(cfg.replace(attention="local", window=3), params, np.asarray(x))
    got = GPT(cfg).apply({"params": params}, x, window=3)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)
    assert np.abs(np.asarray(forward(cfg, params, x)) - want).max() > 1e-3  # the window changed the logits


def test_a_window_keeps_packed_examples_apart_and_scans_as_it_loops():
    """Records' packed rows: each example's logits under the window are its logits alone under it.
    compute.scan_layers: the scan computes what the loop does (a window is static in both)."""
    import jax.numpy as jnp
    import test_packed as packed

    from jaxgpt import ComputeConfig
    from jaxgpt.blocks import layers_as

    cfg = packed.tiny(positions="rope")
    params = packed.init(cfg)
    (x, positions, segments), examples = packed.packed_row((11, 6), cfg.block_size, np.random.default_rng(1))
    logits = GPT(cfg).apply({"params": params}, x, positions=positions, segments=segments, window=4)
    start = 0
    for example in examples:
        alone = GPT(cfg).apply({"params": params}, jnp.asarray(example, jnp.int32)[None], window=4)
        np.testing.assert_allclose(logits[0, start:start + len(example)], alone[0], atol=1e-5)
        start += len(example)
    scanned = GPT(cfg, ComputeConfig(scan_layers=True)).apply({"params": layers_as(params, True)}, x, window=4)
    np.testing.assert_allclose(scanned, GPT(cfg).apply({"params": params}, x, window=4), atol=1e-5)


def test_a_scheduled_run_resumed_ends_where_an_uninterrupted_one_does(tmp_path, corpus):  # noqa: F811
    """Rows of 8 tokens and a window of 4 before step 2, then the block's 16 with a window of 8 before
    step 4: a run stopped at step 3 and resumed ends where one run of 5 steps does; the tokens it
    counts are each step's rows × length."""
    from jaxgpt.train.run import train

    scheduled = {"train.length_schedule": ((2, 8),), "train.window_schedule": ((2, 4), (4, 8))}
    assert train(tiny_config(tmp_path, corpus, "split", **scheduled, **{"train.steps": 3}))["step"] == 3
    resumed = train(tiny_config(tmp_path, corpus, "split", **scheduled, **{"train.steps": 5}))
    whole = train(tiny_config(tmp_path, corpus, "whole", **scheduled, **{"train.steps": 5}))
    assert resumed["step"] == whole["step"] == 5
    assert_trees_close(final_params(tmp_path / "split"), final_params(tmp_path / "whole"), atol=1e-6)
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    seen = {r["step"]: r["tokens_seen"] for r in records if "tokens_seen" in r}
    assert seen[1] == 4 * 8 and seen[5] == 4 * (8 * 2 + 16 * 3)


@pytest.mark.parametrize(("train", "model", "records", "message"), [
    ({"length_schedule": ((10, 32),)}, {}, False, "train.length_schedule: rows of 32 tokens before step 10 do not fit "
     "model.block_size=16: choose lengths of at most 16"),
    ({"length_schedule": ((10, 8),)}, {}, True, "train.length_schedule needs a text corpus"),
    ({"length_schedule": ((10, 2),), "mtp_tokens": 3}, {}, False, "are shorter than train.mtp_tokens=3"),
    ({"window_schedule": ((10, 16),)}, {}, False, "a window of 16 before step 10 is the whole block"),
    ({"window_schedule": ((10, 4),)}, {"attention": "local", "window": 8}, False,
     "train.window_schedule: model.attention='local' takes no training window (the forms that do: 'softmax')"),
    ({"window_schedule": ((10, 4),)}, {"attention": "linear"}, False, "model.attention='linear'"),
    ({"window_schedule": ((10, 4),)}, {"paired_heads": (0,), "positions": "rope"}, False,
     "model.paired_heads=(0,) interleaves two heads' places"),
])
def test_a_schedule_that_cannot_work_is_refused_in_one_line(train, model, records, message):
    with pytest.raises(ConfigError) as refused:
        check_schedules(TrainConfig(**train, warmup_steps=1), tiny(block_size=16, **model), records)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(("changes", "message"), [
    ({"length_schedule": ((10, 0),)}, "train.length_schedule=((10, 0),): must be (until_step, length) pairs"),
    ({"window_schedule": ((10, 4), (5, 8))}, "train.window_schedule=((10, 4), (5, 8)): its until_steps must increase"),
    ({"window_schedule": "16"}, "must be (until_step, window) pairs of positive integers"),
])
def test_a_malformed_schedule_is_a_one_line_error_naming_its_key(changes, message):
    with pytest.raises(ConfigError) as refused:
        open_train(changes)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_train_py_refuses_a_length_past_the_block_before_it_compiles(tmp_path, corpus):  # noqa: F811
    from runs import cli_args
    from test_run import run_train_py

    out = run_train_py(cli_args(tmp_path, corpus, **{"train.length_schedule": "((3,64),)"}))
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and lines[-1].startswith("train.py: train.length_schedule: rows of 64 tokens"), lines
    assert not (tmp_path / "run").exists()
