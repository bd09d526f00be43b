"""The micro-batch a run takes on its devices: MaxText's per-device batch.

A preset declares the rows of one optimizer step, train.rows_per_step = R (its tokens are
R · block_size), and leaves train.batch_size and train.grad_accum at 0 (auto). When the run
opens, the rows each device takes at once are chosen from the device count and the memory of
one device, and the step is made of as many micro-batches as that leaves:

    W  the devices a batch's rows are split over (the mesh's data × fsdp)
    r  rows per device: the largest divisor of R / W with
         state + chunk(r · T) + r · margin · row ≤ memory   (at least 1)
    train.batch_size  B = r · W        train.grad_accum  k = R / B

so the tokens per step are the preset's on any slice, and a slice with more memory per device
runs fewer, larger micro-batches (fewer accumulation steps, each nearer the chip's best bound).
`state` is the parameters' and the optimizer's (state_bytes, from their shapes), chunk(n) the
loss's chunk of logits at n tokens a device (chunk_bytes), `row` an estimate (row_bytes, counted
`margin` = row_margin times: 1.02 on a TPU, more where XLA keeps more), and `memory` one
device's budget (budget: train.memory_limit_gib over all devices; a compile target's memory
when compiling ahead; a device's bytes_limit; on a CPU 90% of the RAM shared by its devices).
jaxgpt.compile holds the compiled train step to the same budget.

An explicit setting wins: train.batch_size and train.grad_accum both set make the step
(rows_per_step is then unused, and said so); one of them set, the other follows from
rows_per_step. rows_per_step = 0 (the default) is today's batch_size × grad_accum. Under
train.batch_schedule, r divides a device's share of every scheduled step's rows too (their
greatest common divisor), so each step is a whole number of micro-batches.

    config = resolved(config, mesh, cfg, compute)   # when a run opens (jaxgpt.train.opening), the data read
    plan(train, ways, state, row, memory)           # the arithmetic alone
    budget(devices, train)                          # the bytes a device may use, and what they are
    larger_note(result, grad_accum, block_size)     # jaxgpt.compile: a larger micro-batch would fit
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import jax
from ml_collections import ConfigDict

from jaxgpt import ops
from jaxgpt.attention import FORMS, KERNELS
from jaxgpt.config import ComputeConfig, GPTConfig, TrainConfig
from jaxgpt.errors import ConfigError
from jaxgpt.model import GPT, param_layout
from jaxgpt.optim import make_optimizer, open_train
from jaxgpt.train.step import abstract_state, state_shapes

GiB = 2**30
# XLA's TPU compiles of GPT-2 small kept 0.381 (v5e) and 0.411 GiB (v4) a row where row_bytes says 0.403: a
# row is counted 2% larger when the rows are chosen (docs/SCALE.md, "The micro-batch per device")
ROW_MARGIN = 1.02
# on an H100 (jax 0.11.2, cuDNN attention) GPT-2 small's train step kept 0.391 GiB a row with the loss in chunks where
# row_bytes says 0.211 (1.85×), the speedrun's 0.34 (1.37×), GPT-2's with the whole logits 0.73 (1.80×); and 128 rows
# a device asked XLA for 95.8 GiB where 64 took 27.1 (a deviceless compile said 48.7): a GPU's row is counted 2.2
# times (docs/SCALE.md, "Measured on GPUs")
ROW_MARGINS = {"gpu": 2.2}
# XLA's CPU compiles (jaxlib 0.10.2) keep a row's activations in float32 whatever compute.dtype, and more of them. Per
# row of a train step on one device ((XLA's sum at 8 or 4 rows − at 2 or 1) over the rows between), over row_bytes at
# float32: GPT-2 small's shapes with the loss in chunks 1.72 (4 layers: 0.888 GiB in float32 and in bfloat16) and 1.71
# (12 layers: 2.639 GiB); with the whole logits, which XLA keeps about 4 times, 1.84 (4 layers), 3.0 (6 layers of
# d_model 384, 256 tokens, the logits most of a row), 2.43 (2 layers of d_model 64, 64 tokens, a vocabulary of 512) and
# 1.94 (4 layers of 128, a vocabulary of 65). A CPU's row is counted at its float32 bytes times these, so that the
# micro-batch chosen fits the compiled program: gpt2_124m on 2 CPU devices of 23.5 GiB took 8 rows a device at 1.02,
# which compiled to 21.1 GiB a device against a budget of 10.6, and takes 2 at 1.85, which compile to 7.66.
CPU_ROW_MARGINS = {"chunked": 1.85, "whole logits": 3.0}


def row_margin(platform: str, compute: ComputeConfig | None = None) -> float:
    """How much larger than row_bytes (in `compute`'s dtype) a row is counted when the rows are
    chosen on `platform`: a CPU's at its float32 bytes times CPU_ROW_MARGINS (the loss in chunks
    or not: compute.loss_chunk)."""
    if platform == "cpu":
        chunked = compute is not None and compute.loss_chunk
        itemsize = compute.compute_dtype.itemsize if compute else 4
        return CPU_ROW_MARGINS["chunked" if chunked else "whole logits"] * 4 / itemsize
    return ROW_MARGINS.get(platform, ROW_MARGIN)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The micro-batch of a step: batch_size rows over all devices, grad_accum of them per step;
    `why`: the line that says how an automatic choice was made, or that rows_per_step is
    unused (None: nothing to say)."""

    batch_size: int
    grad_accum: int
    why: str | None = None


# --- the memory a row and the state take ------------------------------------------------------


def state_bytes(cfg: GPTConfig, compute: ComputeConfig, train: TrainConfig, mesh=None) -> float:
    """Bytes of the parameters, their gradients and the optimizer's state on one device of
    `mesh` as training lays them out (None: all of them, whole), from their shapes
    (training.abstract_state: nothing allocated): the parameters, twice their bytes for the
    gradients' sum over the micro-batches and one micro-batch's gradient (both laid out as the
    parameters: training.make_train_step), and the optimizer's state (AdamW: two moments)."""
    gpt = GPT(cfg, compute)
    optimizer = make_optimizer(train, param_layout(gpt))
    if mesh is None:
        state = state_shapes(gpt, optimizer)
        size = lambda leaf: leaf.size * leaf.dtype.itemsize  # noqa: E731
    else:
        state = abstract_state(gpt, optimizer, mesh)
        size = lambda leaf: math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize  # noqa: E731
    params, opt_state = (sum(map(size, jax.tree.leaves(tree))) for tree in (state.params, state.opt_state))
    return 3 * params + opt_state


def block_values(cfg: GPTConfig) -> int:
    """Values one block keeps per token for its backward pass: the inputs of its two norms and
    their outputs (4d), the queries, keys and values (H·D + 2·H_kv·D), the attention's output
    (H·D) and each FFN layer's hidden values before the activation (d_ff, twice that gated);
    the elementwise ops' outputs (the activation's, a norm's statistics) are recomputed. With
    qk_norm the attention reads the normalised queries and keys, and their norms the projected
    ones: H·D + H_kv·D more. GPT-2: 4d + 3d + d + 4d = 12d."""
    gated = 2 if cfg.activation in ops.GATED_ACTIVATIONS else 1
    heads = (2 * cfg.n_head + 2 * cfg.n_kv_head + (cfg.n_head + cfg.n_kv_head) * cfg.qk_norm) * cfg.head_dim
    return 4 * cfg.d_model + heads + cfg.ffn_layers * gated * cfg.d_ff


def row_bytes(cfg: GPTConfig, compute: ComputeConfig) -> float:
    """Bytes of one row's activations in a train step: per token, n_layer blocks of
    block_values in the compute dtype, the attention weights where the kernel forms them
    (2·H·S values a layer, the scores and their softmax over S = min(T, window) keys, twice
    that a layer of paired_heads; none for a fused kernel, under remat, or a form without
    weights), and the float32 logits, 4·V
    (their gradient is written over them). An estimate: XLA's TPU compiles of GPT-2 small
    keep 0.381 GiB a row on v5e and 0.411 on v4, where this says 0.403 (ROW_MARGIN)."""
    size = compute.compute_dtype.itemsize
    kernel = KERNELS.get(compute.kernel)  # None: auto, not yet resolved for a platform (counted as forming them)
    forms_weights = (FORMS[cfg.attention].has_weights and not (kernel and kernel.fused)
                     and not compute.remat)
    span = cfg.block_size if cfg.window is None else min(cfg.block_size, cfg.window)
    weights = 2 * cfg.n_head * span if forms_weights else 0
    logits = 0 if compute.loss_chunk else 4 * cfg.vocab_size  # chunked: a chunk's at a time (chunk_bytes)
    layers = cfg.n_layer * block_values(cfg) + (cfg.n_layer + len(cfg.paired_heads)) * weights
    return cfg.block_size * (layers * size + logits)


def chunk_bytes(cfg: GPTConfig, compute: ComputeConfig, tokens: int) -> float:
    """Bytes of one chunk's float32 logits and their gradient under compute.loss_chunk, for a
    micro-batch of `tokens` tokens on a device: a chunk holds at most those (a chunk larger than
    the micro-batch is one chunk of its tokens: chunked.as_chunks). 0 without loss_chunk: the
    logits are then a row's, in row_bytes."""
    return 2 * 4 * min(compute.loss_chunk, tokens) * cfg.vocab_size


# --- the choice -------------------------------------------------------------------------------


def _no_chunk(rows: int) -> float:
    return 0.0


def plan(train: TrainConfig, ways: int, state: float = 0.0, row: float = 0.0, memory: float | None = None,
         where: str = "", margin: float = ROW_MARGIN, chunk=_no_chunk) -> Plan:
    """The micro-batch of `train` on a mesh whose data × fsdp is `ways`: its own batch_size
    and grad_accum, or those rows_per_step leaves (the module's docstring says how), with
    `state` and `row` the bytes per device of the state and of one row (state_bytes,
    row_bytes) and chunk(r) those of the loss's chunk at r rows a device (chunk_bytes)
    against `memory` bytes per device (`where`: what that memory is, for the line that
    says so). ConfigError, in one line, for rows_per_step that the devices do not divide."""
    rows, batch, accum = train.rows_per_step, train.batch_size, train.grad_accum  # checked by TrainConfig
    if batch and accum:
        unused = None if not rows or train.step_rows == rows else (
            f"train.rows_per_step={rows} is unused: train.batch_size={batch} × train.grad_accum={accum} makes "
            f"{train.step_rows} rows a step")
        return Plan(batch, accum, unused)
    if batch or accum:
        return Plan(batch or rows // accum, accum or rows // batch)
    common = math.gcd(rows, *(r for _, r in train.batch_schedule))  # the micro-batch divides every step's rows
    if common % ways:
        scheduled = f" and train.batch_schedule's rows (their divisor {common})" if common != rows else ""
        raise ConfigError(f"train.rows_per_step={rows}{scheduled} must be divisible by the {ways} devices its rows are "
                          f"split over (the mesh's data × fsdp): choose a multiple of {ways}, or set train.batch_size "
                          "and train.grad_accum")
    per_device = rows_per_device(common // ways, state, row, memory, margin, chunk)
    batch = per_device * ways
    why = (f"train.batch_size={batch} ({per_device} rows on each of {ways} devices) × train.grad_accum="
           f"{rows // batch} = train.rows_per_step={rows}: ")
    if memory is None:
        why += "one micro-batch (no memory to fit)"
    else:
        loss = f", {_gib(chunk(per_device))} GiB for the loss's chunk" if chunk(per_device) else ""
        why += (f"the most rows per device that fit {_gib(memory)} GiB a device{f' ({where})' if where else ''}, at "
                f"about {_gib(state)} GiB for the parameters, gradients and optimizer state{loss} and {_gib(row)} GiB "
                f"a row (counted {margin:g} times)")
    return Plan(batch, rows // batch, why + "; set train.batch_size or train.grad_accum to choose")


def rows_per_device(rows: int, state: float, row: float, memory: float | None, margin: float = ROW_MARGIN,
                    chunk=_no_chunk) -> int:
    """The largest divisor r of `rows` (a device's rows of one step) with state + chunk(r) +
    r · margin · row ≤ memory (margin: row_margin of the platform; chunk(r): the loss's chunk at
    r rows); 1 when none fits (the run's memory check, or the compile, says so), all of them
    when the memory is unknown."""
    if memory is None:
        return rows
    fitting = [r for r in range(1, rows + 1) if rows % r == 0 and state + chunk(r) + r * margin * row <= memory]
    return max(fitting, default=1)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}" if n < 10 * GiB else f"{n / GiB:.1f}"


# --- a run's config -------------------------------------------------------------------------


def resolved(config, mesh, cfg: GPTConfig, compute: ComputeConfig, memory: float | None = None,
             say: bool = True) -> ConfigDict:
    """`config` with train.batch_size and train.grad_accum as a run of the model `cfg` (its
    vocabulary known) on `mesh` takes them (plan), in the kernel and dtypes of `compute` (as
    resolved for the platform). `memory`: a compile target's bytes per device (a TPU's HBM, a
    GPU's share for XLA: budget). The config is returned as it was when nothing is chosen; a
    choice is said on standard error (`say`)."""
    train = open_train(config.train)
    if not train.rows_per_step:
        return config
    ways = mesh.shape["data"] * mesh.shape["fsdp"]
    if train.batch_size or train.grad_accum:  # set: nothing to fit
        choice = plan(train, ways)
    else:
        choice = fitted_plan(train, ways, cfg, compute, list(mesh.devices.flat), mesh, memory)
    if choice.why and say:
        print(f"jaxgpt: {choice.why}", file=sys.stderr)
    if (choice.batch_size, choice.grad_accum) == (train.batch_size, train.grad_accum):
        return config
    config = ConfigDict(config.to_dict())
    config.train.batch_size, config.train.grad_accum = choice.batch_size, choice.grad_accum
    return config


def fitted_plan(train: TrainConfig, ways: int, cfg: GPTConfig, compute: ComputeConfig, devices, mesh=None,
                memory: float | None = None) -> Plan:
    """plan for rows_per_step on `devices` (`ways` of them split the rows; `mesh`: the state's
    layout, None: whole on each), against their budget (`memory`: a compile target's), with the
    state, a row and the loss's chunk as estimated here, each row at the platform's margin."""
    memory, where = budget(devices, train, memory)
    return plan(train, ways, state_bytes(cfg, compute, train, mesh), row_bytes(cfg, compute), memory, where,
                row_margin(devices[0].platform, compute), lambda r: chunk_bytes(cfg, compute, r * cfg.block_size))


def budget(devices, train: TrainConfig, target: float | None = None) -> tuple[float | None, str]:
    """(bytes one device may use, what they are): what the micro-batch is chosen to fit, and what
    jaxgpt.compile holds the compiled train step to. train.memory_limit_gib shared by the devices;
    else `target`, a compile target's memory (a TPU's HBM, a GPU's share for XLA); else the
    smallest bytes_limit the devices report (a GPU's, a TPU's); else on a CPU 90% of the RAM
    shared by its devices; else (None, ''). Only this process's devices are asked (another
    host's report nothing here)."""
    n = len(devices)
    if train.memory_limit_gib:
        limit = train.memory_limit_gib
        return limit * GiB / n, f"train.memory_limit_gib={limit:g} over {n} devices"
    if target:
        return target, f"the memory for XLA of one {devices[0].device_kind}"
    limits = [_bytes_limit(device) for device in devices if device.process_index == jax.process_index()]
    if limits and all(limits):
        return min(limits), f"the memory one {devices[0].device_kind} reports"
    if devices[0].platform == "cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return 0.9 * ram / n, f"90% of the RAM over {n} CPU devices"
    return None, ""


def _bytes_limit(device) -> int | None:
    try:
        return (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - a CPU, or a topology's device, may have no stats at all
        return None


def larger_note(result: dict, grad_accum: int, block_size: int) -> str | None:
    """A line when a larger micro-batch would fit the chip than the one jaxgpt.compile's
    `result` (compile.report's) compiled, at the same rows per step (`grad_accum` micro-batches
    of `block_size` tokens a row): from the train step's memory per device M at r rows per
    device and its state S (the parameters and optimizer state as laid out, and twice the
    parameters' bytes for the gradients), (M − S)/r a row, for m·r rows with m the largest
    power of two dividing grad_accum where S + m·(M − S)·g ≤ the budget (the report's, else the
    chip's HBM), g what a compile for the result's platform (a TPU where it names none) leaves
    out: 1 where it compiles for the devices themselves; on a GPU 2.2/1.02, as a GPU's own compile
    of 128 rows of GPT-2 small asked for 1.97× what a deviceless one said. None when none would,
    or nothing is known of the memory."""
    train = result["programs"]["train step"]
    hbm = (result.get("budget") or {}).get("bytes") or (result.get("chip_figures") or {}).get("hbm")
    ways = result["mesh"]["data"] * result["mesh"]["fsdp"]
    batch = train["tokens"] // (grad_accum * block_size)
    if not hbm or grad_accum < 2:
        return None
    rows = batch // ways
    state = train["parameters"] + train["optimizer_state"] + 2 * train["parameters"]
    left_out = ROW_MARGINS.get(result.get("platform", "tpu"), ROW_MARGIN) / ROW_MARGIN
    per_row = max(train["total"] - state, 0) / rows * left_out
    fits = [m for m in (2**i for i in range(1, grad_accum.bit_length()))
            if grad_accum % m == 0 and state + m * rows * per_row <= hbm]
    if not fits:
        return None
    m = max(fits)
    return (f"{m * rows} rows per device would fit too (about {_gib(state + m * rows * per_row)} GiB of the "
            f"{_gib(hbm)} by this compile's figures): the same rows a step in fewer micro-batches, "
            f"--config.train.batch_size={m * batch} --config.train.grad_accum={grad_accum // m}")
