"""Training: the pure step (accumulation, sharding over meshes) and CPU devices per core."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from processes import finished, with_devices, xla_flags

from jaxgpt import GPTConfig, sharding
from jaxgpt.config import TrainConfig
from jaxgpt.model import param_layout
from jaxgpt.optim import learning_rate_schedule, make_optimizer
from jaxgpt.train.step import init_state, make_train_step

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TRAIN = TrainConfig(**dict(lr=3e-3, min_lr=1e-4, warmup_steps=1, steps=10, b1=0.9, b2=0.99, weight_decay=0.1, clip=1.0))


def test_gradient_accumulation_equals_one_big_batch():
    cfg = GPTConfig(vocab_size=31, block_size=8, n_layer=2, n_head=2, d_model=16)
    optimizer, schedule = make_optimizer(TRAIN, param_layout(cfg)), learning_rate_schedule(TRAIN)
    state = init_state(cfg, optimizer, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, cfg.block_size + 1), 0, cfg.vocab_size)
    batch = (tokens[:, :-1], tokens[:, 1:])
    key = jax.random.key(2)
    one, m1 = jax.jit(make_train_step(cfg, optimizer, schedule, grad_accum=1))(state, batch, key)  # 8 rows at once
    four, m4 = jax.jit(make_train_step(cfg, optimizer, schedule, grad_accum=4))(state, batch, key)  # 4 × 2 rows
    assert float(m4["loss"]) == pytest.approx(float(m1["loss"]), abs=1e-5)
    assert float(m4["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    pairs = zip(jax.tree.leaves(one.params), jax.tree.leaves(state.params), strict=True)
    moved = max(float(jnp.abs(a - b).max()) for a, b in pairs)
    assert moved > 1e-4  # the update is real, so equality above means something


def test_sharded_training_equals_single_device():
    """On 8 fake CPU devices: meshes (8,1,1), (2,2,2), (1,1,8) give the single-device
    losses and parameters after 3 steps (with 2 accumulated micro-batches per step); an evaluation
    split over the devices (eval.py's) the single-device loss over the same tokens."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(TESTS / "sharded_training.py")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout)
    evaluation = results.pop("evaluation")  # eval.py's rows over the devices that divide its batch
    assert evaluation["devices"] == {"6": 6, "7": 7, "8": 8, "12": 6}, evaluation
    assert evaluation["tokens"] == [6 * 4 * 16] * 2 and evaluation["loss_diff"] < 1e-6, evaluation
    assert set(results) == {"(8, 1, 1)", "(2, 2, 2)", "(1, 1, 8)"}
    for mesh, r in results.items():
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5, (mesh, r)
    assert results["(2, 2, 2)"]["sharded_leaves"] > 0 and results["(1, 1, 8)"]["sharded_leaves"] > 0


# A train step of 2 micro-batches as train.py lowers it (run.lower_train_step: under the mesh, each micro-batch's
# gradient laid out as its parameter), with two value tables (vocabulary 64, 2 heads × 8 over fsdp), against one
# device's; the collectives of the compiled program inside the micro-batch loop (the while loop's body and what it
# calls) and outside it, by the shapes of their results.
VALUE_TABLES = """
import json, re, sys
import jax, numpy as np
from jaxgpt import GPT, GPTConfig, sharding
from jaxgpt.config import TrainConfig
from jaxgpt.model import param_layout
from jaxgpt.optim import learning_rate_schedule, make_optimizer
from jaxgpt.train.run import lower_train_step
from jaxgpt.train.step import abstract_state, init_state, initialise_into, make_train_step, seeded

cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64,
                value_embeds=((0,), (1,)))
train = TrainConfig(lr=3e-3, min_lr=1e-4, warmup_steps=1, steps=10, weight_decay=0.1, clip=1.0, batch_size=8,
                    grad_accum=2)
gpt, mesh = GPT(cfg), sharding.make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
optimizer = make_optimizer(train, param_layout(gpt))
abstract = abstract_state(gpt, optimizer, mesh)
state = initialise_into(gpt, optimizer, 0, jax.tree.map(lambda leaf: leaf.sharding, abstract))
compiled = lower_train_step(gpt, train, mesh, optimizer, abstract, packed=False).compile()
one = jax.jit(seeded(make_train_step(gpt, optimizer, learning_rate_schedule(train), grad_accum=2)))
alone = init_state(gpt, optimizer, 0)
tokens = np.random.default_rng(0).integers(0, 64, size=(2, 16, 17)).astype(np.int32)
losses = []
for batch in tokens:
    state, metrics = compiled(state, (batch[:, :-1], batch[:, 1:]), train.seed)
    alone, reference = one(alone, (batch[:, :-1], batch[:, 1:]), train.seed)
    losses.append(abs(float(metrics["loss"]) - float(reference["loss"])))
pairs = zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(alone.params), strict=True)
out = {"loss_diff": max(losses), "param_diff": max(float(np.abs(a - b).max()) for a, b in pairs)}

hlo = compiled.as_text()
computations, calls, loop, current = {}, {}, set(), None
for line in hlo.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
        current = line.replace("ENTRY ", "").split()[0].lstrip("%")
        computations[current], calls[current] = [], set()
    elif current:
        computations[current].append(line)
        calls[current] |= set(re.findall(r"(?:body|condition|calls|to_apply)=%([\\w.-]+)", line))
def reached(name, seen):
    if name not in seen:
        seen.add(name)
        for callee in calls.get(name, ()):
            reached(callee, seen)
    return seen
for line in hlo.splitlines():  # the micro-batch loop: the step's own while (a CPU's scatter-adds are loops too)
    if " while(" in line and 'op_name="jit(seeded_step)/while"' in line:
        reached(re.search(r"body=%([\\w.-]+)", line).group(1), loop)
def collectives(names):  # [kind, [each result's shape]]: a CPU's all-reduces are of tuples
    found = []
    for name in names:
        for line in computations[name]:
            hit = re.match(r"\\s*(?:ROOT )?%\\S+ = (.+?) (all-gather|all-reduce|reduce-scatter)\\(", line)
            if hit:
                shapes = re.findall(r"\\w+\\[([\\d,]*)\\]", hit.group(1))
                found.append([hit.group(2), [[int(n) for n in dims.split(",") if n] for dims in shapes]])
    return found
out["loops"], out["in_loop"], out["outside"] = len(loop), collectives(loop), collectives(set(computations) - loop)
print(json.dumps(out))
"""


def test_value_tables_are_gathered_and_their_gradient_reduced_once_a_step_outside_the_loop():
    """On 8 CPU devices (fsdp=8), a train step of 2 micro-batches with two value-embedding tables
    (train.step.looked_up): each table is all-gathered once, before the micro-batch loop, and its
    gradient reduced once, after it (a reduce-scatter on a TPU; XLA's CPU writes one as an
    all-reduce and a slice); inside the loop no collective has a table's shape (neither a gather
    nor a reduction of its gradient); and two steps equal one device's."""
    out = json.loads(finished(with_devices(VALUE_TABLES), timeout=300))
    assert out["loss_diff"] < 1e-5 and out["param_diff"] < 1e-5, out
    shard = [64, 2, 1]  # a table (vocabulary, kv heads, head_dim) with head_dim over fsdp=8
    whole = ([64, 2, 8], [64, 16])  # gathered: as declared, or each row one vector of H·D values (stack.value_rows)
    assert out["loops"] > 1, out  # the loop's body and what it calls were found
    assert not [c for c in out["in_loop"] if any(s in whole or s == shard for s in c[1])], out["in_loop"]
    gathered = [c for c in out["outside"] if c[0] == "all-gather" and c[1][0] in whole]
    reduced = [s for kind, shapes in out["outside"] if kind != "all-gather" for s in shapes if s in whole or s == shard]
    assert len(gathered) == 2 and len(reduced) == 2, out["outside"]


MESH = {"data": -1, "fsdp": 1, "tensor": 1, "cpu_devices": -1}


def test_cpu_devices_one_per_core_as_many_as_divide_the_batches():
    assert sharding.auto_cpu_devices(2, [12, 48]) == 2
    assert sharding.auto_cpu_devices(8, [12, 48]) == 6
    assert sharding.auto_cpu_devices(8, [12, 32]) == 4
    assert sharding.auto_cpu_devices(2, [15, 45]) == 1
    assert sharding.auto_cpu_devices(4, [16, 32], processes=2) == 4
    assert sharding.auto_cpu_devices(4, [12], processes=2) == 3
    # the mesh's other axes: tensor=2 takes two of the devices, which the batch need not divide by
    assert sharding.auto_cpu_devices(2, [16], mesh_sizes=(-1, 1, 2)) == 2
    assert sharding.auto_cpu_devices(8, [12], mesh_sizes=(-1, 1, 2)) == 8  # data 4 divides 12
    assert sharding.auto_cpu_devices(8, [12], mesh_sizes=(-1, 2, 1)) == 6  # data 3 × fsdp 2
    assert sharding.auto_cpu_devices(8, [16], mesh_sizes=(2, 2, 2)) == 8
    assert sharding.auto_cpu_devices(4, [16], mesh_sizes=(2, 2, 2)) == 0  # no count up to 4 makes that mesh
    # JAX has started in this process: the count is left alone, and asking for one is an error
    jax.devices()
    assert sharding.use_cpu_cores(MESH, [12]) == 0
    assert sharding.use_cpu_cores({**MESH, "cpu_devices": 0}, [12]) == 0
    with pytest.raises(ValueError, match="mesh.cpu_devices=3 cannot take effect: JAX was already started"):
        sharding.use_cpu_cores({**MESH, "cpu_devices": 3}, [12])
    with pytest.raises(ValueError, match="mesh.cpu_devices=-3: use a device count, 0"):
        sharding.use_cpu_cores({**MESH, "cpu_devices": -3}, [12])


def test_the_default_cpu_device_count_makes_a_tensor_axis_on_two_cores():
    """mesh.tensor=2 on a machine of 2 cores: the default (one device per core) makes the two
    devices the mesh asks for, instead of refusing it with a fix it could have chosen."""
    code = ("import jax; from jaxgpt import sharding; mesh = {'data': -1, 'fsdp': 1, 'tensor': 2, 'cpu_devices': -1}; "
            "sharding.use_cpu_cores(mesh, [16]); print(dict(sharding.make_mesh(mesh).shape))")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "JAX_PLATFORMS": "cpu"})
    if sharding.available_cores() < 2:
        pytest.skip("one core: a tensor axis of 2 needs two devices")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "{'data': 1, 'fsdp': 1, 'tensor': 2}"


def test_compilation_cache_directory_follows_the_setting_and_the_environment(tmp_path):
    from jaxgpt.sharding import compilation_cache_dir

    assert compilation_cache_dir("off", {}) is None and compilation_cache_dir("", {}) is None
    assert compilation_cache_dir(str(tmp_path), {"JAX_COMPILATION_CACHE_DIR": "/elsewhere"}) == str(tmp_path)
    assert compilation_cache_dir("auto", {"JAX_COMPILATION_CACHE_DIR": "/elsewhere"}) == "/elsewhere"
    assert compilation_cache_dir("auto", {"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "jaxgpt" / "xla")


@pytest.mark.parametrize("command, argv", [("train.py", ["--config.compilation_cache={}"]),
                                           ("sample.py", ["--run_dir", "nowhere", "--compilation_cache={}"]),
                                           ("eval.py", ["--run_dir", "nowhere", "--compilation_cache={}"])])
def test_a_compilation_cache_that_cannot_be_a_directory_is_one_line(tmp_path, command, argv):
    """A file where the cache directory should be: one line that says what to pass, status 2, before any work."""
    (tmp_path / "a_file").write_text("not a directory")
    out = subprocess.run([sys.executable, str(ROOT / command), *(a.format(tmp_path / "a_file") for a in argv)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    said = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(said) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert said[0].endswith(f"compilation_cache={tmp_path / 'a_file'}: cannot keep compiled programs there (File "
                            "exists): name a writable directory, 'auto' or 'off'"), said
    assert list(tmp_path.iterdir()) == [tmp_path / "a_file"]  # nothing else written


def test_a_repeated_run_loads_its_programs_from_the_compilation_cache(tmp_path):
    """The second identical run compiles nothing: every program comes from the cache the first
    wrote (the files JAX keeps there: the second run neither adds one nor rewrites one)."""
    root = Path(__file__).resolve().parent.parent
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the king speaks to the queen. " * 200)
    cache = tmp_path / "xla"
    args = [sys.executable, str(root / "train.py"), f"--config.data.source={corpus}", "--config.data.tokenizer=char",
            f"--config.data.cache_dir={tmp_path / 'data'}", "--config.model.n_layer=1", "--config.model.d_model=16",
            "--config.model.n_head=2", "--config.model.block_size=16", "--config.train.steps=2",
            "--config.train.warmup_steps=1", "--config.train.batch_size=4", "--config.train.eval_batch_size=4",
            "--config.train.eval_max_batches=1", "--config.sample.max_new_tokens=4", "--config.sample.prompt=the",
            "--config.mesh.cpu_devices=1",
            f"--config.compilation_cache={cache}"]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    first = subprocess.run([*args, f"--config.run_dir={tmp_path / 'a'}"], capture_output=True, text=True, env=env,
                           timeout=240)
    assert first.returncode == 0, first.stderr[-2000:]
    def programs():  # each compiled program's file and when it was written (not the access-time files)
        return {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if "atime" not in p.name}

    written = programs()
    assert len(written) >= 3  # init, train step, eval step, sampling…
    kept = {p.name: p.stat().st_mtime_ns for p in (cache / "programs").iterdir()}
    programs_kept = [name for name in kept if name.endswith(".pickle")]  # train step, init, eval step, checksums
    assert len(programs_kept) == 4 and len(kept) == 5  # and the params' declarations (.value)
    second = subprocess.run([*args, f"--config.run_dir={tmp_path / 'b'}"], capture_output=True, text=True, env=env,
                            timeout=240)
    assert second.returncode == 0, second.stderr[-2000:]
    assert programs() == written  # nothing compiled anew, nothing rewritten
    assert {p.name: p.stat().st_mtime_ns for p in (cache / "programs").iterdir()} == kept  # read back, not made


def test_a_seeded_step_draws_dropout_with_the_key_of_seed_and_step():
    """seeded(train_step)(state, batch, seed) is train_step with key fold_in(key(seed), step):
    the key the loop made on the host before, so runs and resumes draw the same dropout."""
    from jaxgpt.train.step import seeded

    cfg = GPTConfig(vocab_size=31, block_size=8, n_layer=1, n_head=2, d_model=16, dropout=0.5)
    optimizer, schedule = make_optimizer(TRAIN, param_layout(cfg)), learning_rate_schedule(TRAIN)
    state = init_state(cfg, optimizer, 3)
    by_key = init_state(cfg, optimizer, jax.random.key(3))  # a seed is the key of that seed
    assert jax.tree.all(jax.tree.map(jnp.array_equal, state.params, by_key.params))
    state = state.replace(step=jnp.int32(5))
    tokens = jax.random.randint(jax.random.key(1), (4, cfg.block_size + 1), 0, cfg.vocab_size)
    batch = (tokens[:, :-1], tokens[:, 1:])
    step = make_train_step(cfg, optimizer, schedule)
    _, by_seed = jax.jit(seeded(step))(state, batch, 7)
    _, by_key = jax.jit(step)(state, batch, jax.random.fold_in(jax.random.key(7), 5))
    _, other = jax.jit(step)(state, batch, jax.random.fold_in(jax.random.key(7), 4))
    assert float(by_seed["loss"]) == float(by_key["loss"]) != float(other["loss"])  # dropout differs per step


def test_the_init_program_compiled_for_speed_of_compiling_gives_the_default_values():
    """sharded_init compiles its program with INIT_COMPILER_OPTIONS (a lighter LLVM pipeline):
    its state must be the one XLA's default compilation of the same init gives, bit for bit."""
    from jaxgpt.train.step import sharded_init

    cfg = GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, d_model=32)
    optimizer = make_optimizer(TrainConfig(steps=10, warmup_steps=1), param_layout(cfg))
    state, _ = sharded_init(cfg, optimizer, 3, sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}))
    # XLA's default, named: the suite's own process compiles at -O0 (conftest.py)
    default = jax.jit(lambda seed: init_state(cfg, optimizer, seed),
                      compiler_options={"xla_backend_optimization_level": 3})(3)
    leaves = jax.tree.leaves(default)
    assert len(leaves) == len(jax.tree.leaves(state)) and any(np.asarray(x).std() > 0 for x in leaves)
    for x, y in zip(jax.tree.leaves(state), leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
