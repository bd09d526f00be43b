"""Training: the train state, jitted pure train and eval steps, and the loop around them.

    state = (step, params, opt_state)
    train_step(state, batch, key) -> (state', metrics)    one optimizer update, jitted, donated
    eval_step(params, inputs, targets, mask) -> (Σ loss, Σ count)

The loop adds what a run needs: data on the devices, logging, evaluation, checkpoints,
resume, the NaN guard and clean stops on SIGINT/SIGTERM.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxgpt import checkpoint, convert, ops, sharding
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT, flops_per_token
from jaxgpt.optim import learning_rate_schedule, make_optimizer

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """A run that cannot go on (non-finite loss, incompatible resume, bad settings)."""


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any

    def to_dict(self) -> dict:
        return {"step": self.step, "params": self.params, "opt_state": self.opt_state}

    @classmethod
    def from_dict(cls, tree: dict) -> "TrainState":
        return cls(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"])


# --- the pure steps -------------------------------------------------------------------------


def loss_fn(model: GPT, params, inputs, targets, mask=None, dropout_key=None):
    """Mean cross-entropy of the model's next-token predictions."""
    rngs = {} if dropout_key is None else {"dropout": dropout_key}
    logits = model.apply({"params": params}, inputs, deterministic=dropout_key is None, rngs=rngs)
    return ops.cross_entropy(logits, targets, mask)


def make_train_step(model_cfg: GPTConfig, optimizer: optax.GradientTransformation, schedule: Callable,
                    grad_accum: int = 1):
    """train_step(state, (inputs, targets), key) for a batch of k·B rows (k = grad_accum).

    Row i·k + j belongs to micro-batch j, so every micro-batch spreads over the devices the
    way the whole batch does. The k gradients are summed in a lax.scan (one gradient-sized
    buffer) and averaged: k micro-batches give the update of one batch of k·B rows."""
    model = GPT(model_cfg)
    use_dropout = model_cfg.dropout > 0
    k = grad_accum

    def train_step(state: TrainState, batch, key):
        inputs, targets = (a.reshape(a.shape[0] // k, k, *a.shape[1:]).swapaxes(0, 1) for a in batch)

        def micro_step(grad_sum, micro):
            x, y, i = micro
            dropout_key = jax.random.fold_in(key, i) if use_dropout else None
            loss, grads = jax.value_and_grad(loss_fn, argnums=1)(model, state.params, x, y, None, dropout_key)
            return jax.tree.map(jnp.add, grad_sum, grads), loss

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grad_sum, losses = jax.lax.scan(micro_step, zeros, (inputs, targets, jnp.arange(k)))
        grads = jax.tree.map(lambda g: g / k, grad_sum)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": losses.mean(), "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step)}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(model_cfg: GPTConfig):
    model = GPT(model_cfg)

    def eval_step(params, inputs, targets, mask):
        logits = model.apply({"params": params}, inputs)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        mask = mask.astype(jnp.float32)
        return (nll * mask).sum(), mask.sum()

    return eval_step


_EVAL_STEPS: dict = {}


def evaluate_tokens(model_cfg: GPTConfig, params, tokens, bytes_per_token: float, *, batch_size: int,
                    stride: Optional[int] = None, max_batches: Optional[int] = None, batch_sharding=None,
                    on_batch: Optional[Callable[[int, int], None]] = None) -> dict:
    """Loss (nats per token), perplexity and bits per byte of the model on a token array, over
    the sequential windows of `data.eval_batch` (every target counted once; `stride` <
    block_size gives each target more context). `max_batches` keeps only the first ones."""
    from jaxgpt import data

    if model_cfg not in _EVAL_STEPS:
        _EVAL_STEPS[model_cfg] = jax.jit(make_eval_step(model_cfg))
    eval_step = _EVAL_STEPS[model_cfg]
    T = model_cfg.block_size
    count_batches = data.num_eval_batches(len(tokens), batch_size=batch_size, block_size=T, stride=stride)
    if max_batches:
        count_batches = min(count_batches, max_batches)
    if batch_sharding is None:
        batch_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def make_batch(index: int, rows: slice):
        return data.eval_batch(tokens, index, batch_size=batch_size, block_size=T, stride=stride, rows=rows)

    loss_sum, count = 0.0, 0.0
    with data.DeviceBatches(make_batch, start_step=0, end_step=count_batches, batch_size=batch_size,
                            sharding=batch_sharding) as batches:
        for index, (x, y, m) in batches:
            s, c = eval_step(params, x, y, m)
            loss_sum, count = loss_sum + float(s), count + float(c)
            if on_batch:
                on_batch(index + 1, count_batches)
    loss = loss_sum / max(count, 1.0)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
            "val_bpb": data.bits_per_byte(loss, bytes_per_token), "val_tokens": int(count)}


def init_state(model_cfg: GPTConfig, optimizer: optax.GradientTransformation, key) -> TrainState:
    params = GPT(model_cfg).init(key, jnp.zeros((1, model_cfg.block_size), jnp.int32))["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def sharded_init(model_cfg, optimizer, key, mesh):
    """Initialise directly into the shardings the partition rules give: the shapes come from
    jax.eval_shape, so a large model never materialises on one device."""
    abstract = jax.eval_shape(lambda k: init_state(model_cfg, optimizer, k), key)
    shardings = sharding.tree_shardings(abstract, mesh)
    state = jax.jit(lambda k: init_state(model_cfg, optimizer, k), out_shardings=shardings)(key)
    return state, shardings


# --- measuring ------------------------------------------------------------------------------


def measure_matmul_peak(dtype=jnp.float32, n: int = 1024, seconds: float = 0.5, trials: int = 5) -> float:
    """FLOP/s of a large square matmul on the default device: the CPU's practical peak, the
    best of `trials` timings (each `seconds`/`trials` long) so a busy moment does not lower it."""
    a = jnp.ones((n, n), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = 0.0
    for _ in range(trials):
        repeats, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / trials:
            matmul(a, a).block_until_ready()
            repeats += 1
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - start))
    return best


def peak_flops(train_cfg) -> Optional[float]:
    """The configured peak FLOP/s for MFU; on a CPU with none configured, measured."""
    configured = train_cfg.get("peak_flops")
    if configured:  # a CPU's devices share its cores: there the peak is the whole host's
        per_host = jax.default_backend() == "cpu"
        return float(configured) * (jax.process_count() if per_host else jax.device_count())
    if jax.default_backend() == "cpu":
        return measure_matmul_peak()
    return None


# --- the run --------------------------------------------------------------------------------


class StopRequested:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each step, so the run saves a
    checkpoint and exits cleanly instead of dying mid-step. A second signal stops at once."""

    def __init__(self):
        self.signal_name: Optional[str] = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal_name is not None:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def model_config(config, vocab_size: int) -> GPTConfig:
    """The GPTConfig of a run: the config's model section, the vocabulary from the tokenizer."""
    values = dict(config.model)
    if not values.get("vocab_size"):
        values["vocab_size"] = vocab_size
    elif values["vocab_size"] < vocab_size:
        raise ValueError(f"model.vocab_size={values['vocab_size']} is smaller than the tokenizer's {vocab_size}")
    return GPTConfig.from_dict(values)


def write_json(path: Path, value) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


class MetricsLog:
    """metrics.jsonl in the run directory (one JSON object per line), TensorBoard when
    tensorboardX is installed, and a progress bar on the terminal."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, enabled: bool = True):
        self.enabled = enabled
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.tensorboard = None
        if enabled:
            try:
                from tensorboardX import SummaryWriter

                self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                pass
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        disable=not enabled, file=sys.stderr, mininterval=0.5)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, record["step"])

    def progress(self, steps: int, **fields) -> None:
        self.bar.update(steps)
        if fields:
            self.bar.set_postfix({k: v for k, v in fields.items() if v is not None}, refresh=False)

    def message(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
        if self.file:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def train(config) -> dict:
    """Run training as the config says: returns the final metrics and whether it was stopped.

    config sections: model (GPTConfig fields; vocab_size from the tokenizer when 0), data
    (jaxgpt.data), train (optimizer, schedule, steps, batch, logging, checkpoints), mesh
    (data, fsdp, tensor sizes), distributed; and run_dir, resume (auto | never | must).
    """
    from jaxgpt import data  # the data pipeline knows nothing of the model; only the run joins them

    dist = config.get("distributed") or {}
    processes = int(dist.get("num_processes") or os.environ.get("JAX_NUM_PROCESSES") or 1)
    sharding.use_cpu_cores(config.mesh, [config.train.batch_size, config.train.eval_batch_size], processes)
    sharding.maybe_initialize_distributed(dist)
    lead = jax.process_index() == 0
    tc = config.train
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    checkpoints = checkpoint.Checkpoints(run_dir, keep=tc.keep_checkpoints, async_save=tc.get("async_checkpoints", True))
    resume = config.get("resume", "auto")
    if resume not in ("auto", "never", "must"):
        raise ValueError(f"resume={resume!r}: must be auto, never or must")
    has_checkpoints = bool(checkpoints.steps())
    if resume == "must" and not has_checkpoints:
        raise TrainingError(f"resume='must' but {run_dir} has no checkpoint to resume from")
    if resume == "never" and has_checkpoints:
        raise TrainingError(
            f"resume='never' but {run_dir} already holds checkpoints (steps {checkpoints.steps()}): "
            "choose another --config.run_dir or remove that directory"
        )
    resuming = has_checkpoints

    init_from = config.get("init_from")
    if init_from:  # the checkpoint fixes the architecture and the tokenizer
        convert.resolve_init_from(config)
    corpus = data.prepare(config.data)
    tokenizer = corpus.tokenizer
    cfg = model_config(config, tokenizer.vocab_size)
    saved_config_path = run_dir / "config.json"
    if resuming and saved_config_path.exists():
        saved_model = json.loads(saved_config_path.read_text()).get("model")
        if saved_model != cfg.to_dict():
            raise TrainingError(
                f"{run_dir} holds a run of another model ({saved_model}); resume it with its own "
                "config or choose another --config.run_dir"
            )
    resolved = config.to_dict()
    resolved["model"] = cfg.to_dict()
    if lead:
        write_json(saved_config_path, resolved)
        tokenizer.save(run_dir / "tokenizer.json")

    mesh = sharding.make_mesh(config.mesh)
    accum, batch_size, T = int(tc.grad_accum), int(tc.batch_size), cfg.block_size
    divisor = sharding.batch_size_divisor(mesh)
    for name in ("batch_size", "eval_batch_size"):
        if int(tc[name]) % divisor:
            raise ValueError(f"train.{name}={tc[name]} must be divisible by the mesh's data×fsdp size {divisor}"
                             + (" (on a CPU, --config.mesh.cpu_devices sets the number of devices)"
                                if jax.default_backend() == "cpu" else ""))

    optimizer = make_optimizer(tc)
    schedule = learning_rate_schedule(tc)
    key = jax.random.key(tc.seed)
    state, state_shardings = sharded_init(cfg, optimizer, key, mesh)
    start_step = 0
    if resuming:
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                state.to_dict(), state_shardings.to_dict())
        restored, start_step = checkpoints.restore(abstract)
        state = TrainState.from_dict(restored)
    elif init_from:  # AdamW's fresh state is zeros whatever the params: only they change
        state = state.replace(params=convert.init_params_from(init_from, cfg, state_shardings.params))

    batches_sharding = sharding.batch_sharding(mesh)
    train_step = jax.jit(
        make_train_step(cfg, optimizer, schedule, accum),
        in_shardings=(state_shardings, (batches_sharding, batches_sharding), None),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )
    if len(corpus.val) < 2:
        raise ValueError(f"the validation split of {config.data.source!r} is empty: raise data.val_fraction "
                         "or give data.val_source")

    def make_batch(step: int, rows: slice):
        return data.train_batch(corpus.train, seed=tc.seed, step=step, batch_size=accum * batch_size,
                                block_size=T, rows=rows)

    def evaluate(params) -> dict:
        return evaluate_tokens(cfg, params, corpus.val, corpus.bytes_per_token["val"], batch_size=tc.eval_batch_size,
                               stride=config.data.get("eval_stride"), max_batches=tc.get("eval_max_batches"),
                               batch_sharding=batches_sharding)

    tokens_per_step = accum * batch_size * T
    flops = flops_per_token(cfg, T)
    peak = peak_flops(tc)
    metrics_log = MetricsLog(run_dir, tc.steps, start_step, enabled=lead)
    if lead:
        metrics_log.message(
            f"jaxgpt: {cfg.n_layer} layers, d_model {cfg.d_model}, {jax.device_count()} {jax.default_backend()} "
            f"device(s), mesh {dict(mesh.shape)}, {tokens_per_step} tokens/step, "
            f"{'resuming at step ' + str(start_step) if start_step else 'from scratch'}; "
            + (f"MFU against a peak of {peak / 1e9:.0f} GFLOP/s" if peak else "MFU not reported (set train.peak_flops)")
        )

    pending: list = []  # (step, device metrics) not yet fetched
    last_fetched = {"loss": float("nan"), "grad_norm": float("nan"), "lr": float("nan")}
    interval_losses: list = []
    last_val: Optional[dict] = None
    interval_start = time.perf_counter()
    run_start = time.perf_counter()
    step = start_step
    interrupted = None

    def fetch() -> None:
        """Bring pending metrics to the host; stop on the first non-finite loss or gradient."""
        nonlocal pending
        for s, m in pending:
            values = {k: float(v) for k, v in jax.device_get(m).items()}
            if not (math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])):
                good = checkpoints.steps()
                raise TrainingError(
                    f"non-finite loss ({values['loss']}) or gradient norm ({values['grad_norm']}) at step {s}: "
                    f"stopping. The last good checkpoint is {'step ' + str(good[-1]) if good else 'none'} in {run_dir}; "
                    "lower train.lr or raise train.warmup_steps and resume"
                )
            interval_losses.append(values["loss"])
            last_fetched.update(values)
        pending = []

    train_batches = data.DeviceBatches(make_batch, start_step=start_step, end_step=tc.steps,
                                       batch_size=accum * batch_size, sharding=batches_sharding)
    with train_batches as batches, StopRequested() as stop:
        try:
            for _, batch in batches:
                state, metrics = train_step(state, batch, jax.random.fold_in(key, step))
                step += 1
                pending.append((step, metrics))
                is_last = step == tc.steps
                do_eval = is_last or step % tc.eval_every == 0
                stopping = stop.signal_name  # read once: a signal arriving later is seen next step
                do_ckpt = is_last or do_eval or step % tc.ckpt_every == 0 or stopping
                if step % tc.log_every == 0 or do_eval or do_ckpt:
                    fetch()
                    now = time.perf_counter()
                    interval_steps = len(interval_losses)
                    tokens_per_sec = interval_steps * tokens_per_step / max(now - interval_start, 1e-9)
                    record = {
                        "step": step,
                        "train_loss": sum(interval_losses) / max(interval_steps, 1),
                        "lr": last_fetched["lr"],
                        "grad_norm": last_fetched["grad_norm"],
                        "tokens_per_sec": tokens_per_sec,
                        "mfu": flops * tokens_per_sec / peak if peak else None,
                        "elapsed": now - run_start,
                        "tokens_seen": step * tokens_per_step,
                    }
                    if do_eval:
                        last_val = evaluate(state.params)
                        record.update(last_val)
                        metrics_log.message(
                            f"step {step}: train loss {record['train_loss']:.4f}, val loss {last_val['val_loss']:.4f}, "
                            f"val ppl {last_val['val_ppl']:.2f}, val bpb {last_val['val_bpb']:.3f}"
                        )
                    metrics_log.write(record)
                    metrics_log.progress(
                        interval_steps, loss=f"{record['train_loss']:.4f}", lr=f"{record['lr']:.2e}",
                        tok_s=f"{tokens_per_sec:,.0f}", mfu=f"{record['mfu']:.1%}" if peak else None,
                    )
                    interval_losses.clear()
                    if do_ckpt:
                        checkpoints.save(step, state.to_dict(), val_loss=last_val["val_loss"] if do_eval else None)
                    interval_start = time.perf_counter()  # evaluation and saving are not training time
                if stopping:
                    interrupted = stopping
                    break
        except KeyboardInterrupt:  # a second signal: stop at once, the last checkpoint stands
            interrupted = "a second signal"
        finally:
            checkpoints.close()
            metrics_log.close()

    if lead:
        from jaxgpt import viz

        viz.plot_loss(run_dir)
        if interrupted:
            saved = checkpoint.Checkpoints(run_dir, read_only=True).steps()
            print(f"stopped by {interrupted} at step {step}; the last checkpoint is step {saved[-1] if saved else 'none'} "
                  f"in {run_dir}. Run the same command again to resume.", file=sys.stderr)
    return {"step": step, "train_loss": last_fetched["loss"], "interrupted": interrupted,
            "run_dir": str(run_dir), **(last_val or {})}




def load_config(path):
    """get_config() of a configs/*.py file (what train.py's --config loads, without overrides)."""
    import importlib.util

    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def default_config():
    """Every key a run reads, with defaults; configs/*.py start from this and change what
    their preset needs, and the command line overrides any of it."""
    import dataclasses

    from ml_collections import ConfigDict, config_dict

    from jaxgpt import data

    model = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    model["vocab_size"] = 0  # 0: the tokenizer's vocabulary size
    model["d_ff"] = config_dict.placeholder(int)
    config = ConfigDict({
        "model": model,
        "data": data.default_data_config(),
        "train": {
            "seed": 0,
            "steps": 2000,
            "batch_size": 12,  # rows per micro-batch, over all devices
            "grad_accum": 1,  # micro-batches per optimizer step
            "lr": 1e-3,
            "min_lr": 1e-4,
            "warmup_steps": 100,
            "decay_steps": config_dict.placeholder(int),  # None: the run's steps
            "b1": 0.9,
            "b2": 0.99,
            "eps": 1e-8,
            "weight_decay": 0.1,
            "decay_embeddings": True,
            "clip": 1.0,
            "eval_every": 250,
            "eval_batch_size": 32,
            "eval_max_batches": config_dict.placeholder(int),  # None: the whole validation split
            "log_every": 10,
            "ckpt_every": 250,
            "keep_checkpoints": 3,
            # True: training goes on while a checkpoint is written (a kill -9 during the write
            # loses up to 2·ckpt_every steps); False: each save finishes first (at most ckpt_every)
            "async_checkpoints": True,
            "peak_flops": config_dict.placeholder(float),  # per device (a CPU: per host); None: measured on CPU
        },
        "sample": {"prompt": "\n", "max_new_tokens": 200, "temperature": 0.8, "top_k": 40},
        # cpu_devices: on a CPU, one JAX device per core (-1: as many as divide the batches; 0: one)
        "mesh": {"data": -1, "fsdp": 1, "tensor": 1, "cpu_devices": -1},
        "distributed": {
            "coordinator_address": config_dict.placeholder(str),
            "num_processes": config_dict.placeholder(int),
            "process_id": config_dict.placeholder(int),
            "auto": False,
        },
        "init_from": config_dict.placeholder(str),  # 'hf:PATH': start from a GPT-2 checkpoint (jaxgpt.convert)
        "run_dir": config_dict.placeholder(str),  # None: runs/<config file name>
        "resume": "auto",  # auto | never | must
    })
    return config
