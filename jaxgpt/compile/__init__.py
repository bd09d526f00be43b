"""Compile, without running them, the programs a config's run would run, and say what they cost:

    python -m jaxgpt.compile --config=configs/gpt2_124m.py --topology=v5e:2x4 [--config.KEY=VALUE …]
        [--chips_per_host=2x4] [--json=PATH]      (each also as --option VALUE; --help: the usage)

The train step exactly as train.py builds it (run.lower_train_step: its mesh, grad_accum,
remat, dtype, attention kernel, scan_layers), the eval step as evaluation.py jits it, and
the jitted generate with its KV cache (one prompt of one bucket), each compiled for a TPU
topology through libtpu or a GPU one through JAX's CUDA plugin (no TPU or GPU needed, however
many hosts it has: jaxgpt.compile.gpu) or, with no --topology
(or `train.py --config.compile_only=True`), for this process's devices (on a CPU,
mesh.cpu_devices of them, as train.py makes them). Nothing is
allocated: the state is abstract_state's shapes. One table per device: the memory of each
program (the parts XLA allocates and their sum, and XLA's peak beside them: memory_figures)
against the budget of a device that the micro-batch is chosen by (jaxgpt.train.micro_batch.budget: the
chip's HBM, a GPU's share for XLA, on a CPU its share of the RAM), XLA's FLOPs and bytes
accessed, a roofline bound on the time (the larger of FLOPs / peak and bytes / bandwidth) with
the tokens/s and MFU it allows (upper bounds from the compiler's counts; XLA has none for GPUs,
where the bound on the time is the model's FLOP count at the GPU's peak instead), and the
collectives of the compiled program by kind; then the verdict: whether the train step fits.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from jaxgpt.compile import gpu as compile_gpu
from jaxgpt.compile import gpus
from jaxgpt.compile.table import GiB, budget_name, format_report, size
from jaxgpt.errors import stderr_kept
from jaxgpt.platforms import tpu_present
from jaxgpt.platforms.xla_flags import use_xla_flags

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.py"
INSTALL = "pip install -e '.[tpu]'"


@dataclasses.dataclass(frozen=True)
class Chip:
    hbm: int  # bytes per chip a program may use
    flops: float  # bfloat16 peak, FLOP/s
    bandwidth: float  # HBM, bytes/s
    memory: int | None = None  # a GPU's whole memory, of which JAX's allocator gives XLA hbm


CHIPS = {
    "v4": Chip(32 * GiB, 275e12, 1.2e12),
    "v5e": Chip(16 * GiB, 197e12, 0.82e12),
    "v5p": Chip(95 * GiB, 459e12, 2.8e12),
    "v6e": Chip(32 * GiB, 918e12, 1.6e12),
}
# device_kind as libtpu names it → the chip
DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
                "TPU v6 lite": "v6e", "TPU v6e": "v6e"}
_TWO_D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
_THREE_D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16")
TOPOLOGIES = {"v4": _THREE_D, "v5e": _TWO_D, "v5p": _THREE_D, "v6e": _TWO_D}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE_LINE = re.compile(r"^\s*(?:ROOT )?%\S+ = (?P<type>.+?) (?P<op>" + "|".join(COLLECTIVES)
                              + r")(?P<phase>-start|-done)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>\S+) .*\{\s*$")
_FUSED_SCATTER = re.compile(r" fusion\(.*calls=%all-reduce-scatter")
_SHAPE = re.compile(r"\b(?P<dtype>pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f8\w*|bf16|f16|f32|f64|c64|c128)"
                    r"\[(?P<dims>[\d,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "c64": 64, "c128": 128}


# --- where it compiles for ------------------------------------------------------------------


def known_topologies() -> str:
    tpus = ", ".join(f"{chip}:{{{'|'.join(shapes)}}}" for chip, shapes in TOPOLOGIES.items())
    return f"{tpus}, {gpus.known_topologies()}"


def topology_devices(name: str, chips_per_host: str | None = None) -> list:
    """The devices of a TPU topology such as 'v5e:2x4', all of its hosts', from libtpu's
    description of it (no TPU needed), or of a GPU one such as 'h100:8' (compile_gpu).
    chips_per_host ('2x4'): the chips of one TPU host, for a topology laid out other than
    libtpu's default (2x2 chips per host)."""
    if gpus.is_gpu_topology(name):
        return compile_gpu.topology_devices(name)
    chip, _, shape = name.partition(":")
    if shape not in TOPOLOGIES.get(chip, ()):  # checked first: a malformed name can abort libtpu
        raise ValueError(f"unknown topology {name!r}: known are {known_topologies()}")
    if importlib.util.find_spec("libtpu") is None:
        raise ValueError(f"compiling for the TPU topology {name} needs libtpu, which is not installed: {INSTALL}")
    import jax
    from jax.experimental import topologies

    kwargs: dict[str, Any] = {"chip_config_name": "megacore"} if chip == "v4" else {}
    if not chips_per_host and any(int(n) < 2 for n in shape.split("x")[:2]):  # less than a host's 2x2 chips
        chips_per_host = shape  # the slice is one host
    if chips_per_host:
        bounds = [int(n) for n in chips_per_host.split("x")]
        kwargs["chips_per_host_bounds"] = tuple(bounds + [1] * (3 - len(bounds)))
    if not tpu_present():  # no chip to guard: other processes may describe topologies at the same time
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:  # libtpu's start-up complaints about the TPU VM it is not on kept out of sight, unless it is being tuned
        with stderr_kept(enabled="LIBTPU_INIT_ARGS" not in os.environ) as noise:
            return list(topologies.get_topology_desc(name, "tpu", **kwargs).devices)
    except (jax.errors.JaxRuntimeError, ValueError) as error:
        raise ValueError(f"libtpu cannot describe topology {name!r} (chips_per_host={chips_per_host}): "
                         f"{' '.join(str(error).split())[:300]} {noise.text()[-300:]}") from None


def chip_of(devices) -> tuple[str | None, Chip | None]:
    """(name, figures) of the devices' chip. A known GPU: the memory JAX gives XLA (its
    allocator's limit where the device reports one, else gpus.memory_fraction of the GPU's)
    and its peak. Any other: its kind and its memory where JAX reports it (no FLOP/s or
    bandwidth: no roofline)."""
    kind = devices[0].device_kind
    if kind in DEVICE_KINDS:
        return DEVICE_KINDS[kind], CHIPS[DEVICE_KINDS[kind]]
    try:
        limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - a CPU or a topology's device may have no stats at all
        limit = None
    for name, gpu in gpus.GPUS.items():
        if gpu.device_kind == kind:
            memory = limit or int(gpu.device_memory_size * gpus.memory_fraction())
            return name, Chip(memory, gpu.bf16_flops, gpu.memory_bandwidth, gpu.device_memory_size)
    return kind, Chip(limit, 0.0, 0.0) if limit else None


# --- the programs ---------------------------------------------------------------------------


@dataclasses.dataclass
class Program:
    """One compiled program and what its report needs beside XLA's figures."""

    name: str
    compiled: Any
    inputs: dict[str, int]  # bytes per device of its arguments, by kind
    tokens: int  # tokens one execution processes (all devices)
    model_flops: float | None  # the model's FLOPs in one execution (all devices), None: not reported
    loop: int = 1  # XLA counts a loop's body once: the train step's figures × grad_accum (its micro-batches)
    extras: tuple = ()  # (times, compiled) added to its counts: what XLA's counts of loops leave out (compile_counts)
    platform: str = "tpu"  # of the devices it is compiled for: how to read XLA's memory figures (memory_figures)


def per_device_bytes(tree) -> int:
    """Bytes per device of a pytree of ShapeDtypeStructs (or arrays) with shardings: the
    largest shard of each leaf."""
    import jax

    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(tree))


def model_of(config):
    """The GPTConfig of the config's model section; a vocabulary of 0 (the tokenizer's) is read
    from a tokenizer that exists already (known_vocab_size), since compiling reads no data."""
    from jaxgpt.registries import open_model

    values = dict(config.model)
    if not values["vocab_size"]:
        values["vocab_size"] = known_vocab_size(config)
    if not values["vocab_size"]:
        raise ValueError("model.vocab_size is 0 (the tokenizer's), and no tokenizer of this config exists yet: "
                         "prepare the data first (python -m jaxgpt.data with the same --config), or set "
                         "--config.model.vocab_size (e.g. 50304 for GPT-2's tokenizer)")
    return open_model(values)


def known_vocab_size(config) -> int | None:
    """The vocabulary of the config's tokenizer where one exists without reading the data: the
    run directory's tokenizer.json, a tokenizer file data.tokenizer names, or the token cache
    the data was prepared into. None when there is none yet."""
    from jaxgpt import data, tokenizers
    from jaxgpt.train.rundir import TOKENIZER_FILE

    pinned = Path(config.run_dir or "") / TOKENIZER_FILE
    if config.run_dir and pinned.is_file():
        return tokenizers.load(pinned).vocab_size
    try:
        tokenizer = data.known_tokenizer(config.data)
    except (ValueError, OSError):  # a source that cannot be opened here: nothing is known
        return None
    return None if tokenizer is None else tokenizer.vocab_size


def compile_programs(config, devices=None, generate: bool = True) -> tuple[Any, list[Program]]:
    """(the mesh, [train step, eval step, generate]) compiled for `devices` (default: this
    process's), built by the functions train.py uses; without generate when it is False."""
    import jax

    from jaxgpt import sharding
    from jaxgpt.compile import counts as compile_counts
    from jaxgpt.model import GPT, flops_per_token, param_layout
    from jaxgpt.optim import make_optimizer, open_train
    from jaxgpt.train import micro_batch, opening, preflight, run
    from jaxgpt.train.step import abstract_state

    mesh = sharding.make_mesh(config.mesh, devices)
    platform = mesh.devices.flat[0].platform
    name, chip = chip_of(list(mesh.devices.flat))
    capability = gpus.GPUS[name].compute_capability if name in gpus.GPUS else None  # a GPU target's: FP8 or not
    cfg, compute = model_of(config), opening.compute_config(config, platform, capability)
    config = micro_batch.resolved(config, mesh, cfg, compute, chip.hbm if chip else None)
    train_cfg = open_train(config.train)
    preflight.check_batch_sizes(train_cfg, mesh)
    preflight.check_targets_ahead(train_cfg, cfg.block_size)
    gpt, packed = GPT(cfg, compute), config.data.format == "records"
    optimizer = make_optimizer(train_cfg, param_layout(gpt))
    abstract = abstract_state(gpt, optimizer, mesh)
    lowered = run.lower_train_step(gpt, train_cfg, mesh, optimizer, abstract, packed)
    tokens = train_cfg.step_rows * cfg.block_size
    batch = per_device_bytes(batch_structs(mesh, tokens // cfg.block_size, cfg.block_size, packed))
    per_token = flops_per_token(cfg, cfg.block_size)
    counting = platform != "gpu"  # XLA counts FLOPs and bytes (not a GPU's): add what its count of loops leaves out
    train = Program("train step", _compiled(lowered, "train step"),
                    {"parameters": per_device_bytes(abstract.params),
                     "optimizer state": per_device_bytes(abstract.opt_state), "batch": batch},
                    tokens, per_token * tokens, loop=train_cfg.grad_accum, platform=platform,
                    extras=compile_counts.train_extras(gpt, mesh, optimizer, abstract, train_cfg.batch_size,
                                                       train_cfg.grad_accum) if counting else ())
    with jax.set_mesh(mesh):  # as train.py runs them (run.train)
        evaluation = _eval_program(gpt, mesh, abstract.params, train_cfg.eval_batch_size, packed, per_token / 3)
        if counting:
            evaluation.extras = compile_counts.eval_extras(gpt, mesh, abstract.params, train_cfg.eval_batch_size)
        generate = [_generate_program(gpt, mesh, abstract.params, config.sample)] if generate else []
    return mesh, [train, evaluation, *generate]


def _compiled(lowered, name: str):
    """lowered.compile(); a program XLA cannot fit in the devices' memory is a ValueError
    with XLA's numbers and the knobs that change them."""
    import jax

    try:
        return lowered.compile()
    except jax.errors.JaxRuntimeError as error:
        message = " ".join(str(error).split())
        if "RESOURCE_EXHAUSTED" not in message:
            raise
        found = re.search(r"\(([\d.]+\w?)\) exceeds available HBM \(([\d.]+\w?)\)", message)
        need = f"needs {found[1]}B, more than the {found[2]}B of HBM available" if found else message[:200]
        raise ValueError(f"the {name} does not fit: per device it {need}; {KNOBS}") from None


KNOBS = ("shard the weights and optimizer state (mesh.fsdp), recompute activations (compute.remat=True), or take "
         "fewer rows per micro-batch (train.batch_size lower, train.grad_accum higher)")


def batch_structs(mesh, rows: int, block_size: int, packed: bool, masked: bool = False) -> tuple:
    """The fields of a batch (training.batch_fields) as ShapeDtypeStructs laid out on the mesh
    as train.py lays them; masked: a text batch with its mask, as evaluation reads it."""
    import jax

    from jaxgpt import sharding
    from jaxgpt.train.step import batch_fields

    batches = sharding.batch_sharding(mesh)
    fields = batch_fields(rows, block_size, packed or masked)
    return tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=batches) for shape, dtype in fields[:5 if packed else 3
                                                                                                  if masked else 2])


def _eval_program(gpt, mesh, params, rows: int, packed: bool, flops_per_token: float) -> Program:
    """The eval step as evaluation.py jits it, for a batch of train.eval_batch_size rows."""
    import jax

    from jaxgpt.train import evaluation

    inputs, targets, mask, *rest = batch_structs(mesh, rows, gpt.cfg.block_size, packed, masked=True)
    lowered = jax.jit(evaluation.ignoring_step(gpt)).lower(params, inputs, targets, mask, -1, *rest)
    tokens = rows * gpt.cfg.block_size
    return Program("eval step", _compiled(lowered, "eval step"),
                   {"parameters": per_device_bytes(params), "optimizer state": 0,
                    "batch": per_device_bytes((inputs, targets, mask, *rest))}, tokens, flops_per_token * tokens,
                   platform=mesh.devices.flat[0].platform)


def _generate_program(gpt, mesh, params, sample) -> Program:
    """sampling's generate program (the KV cache, the decoding loop) for one prompt of the
    smallest bucket and sample.max_new_tokens new tokens, top_k as the config samples."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxgpt.decode import sampling
    from jaxgpt.decode.logits import prompt_bucket

    whole = NamedSharding(mesh, PartitionSpec())
    width = prompt_bucket(1)
    prompts = jax.ShapeDtypeStruct((1, width), np.int32, sharding=whole)
    lengths = jax.ShapeDtypeStruct((1,), np.int32, sharding=whole)
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 1))
    keys = jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=whole)
    top_k = int(sample.top_k or 0)
    options = sampling.SamplingOptions(max_new_tokens=int(sample.max_new_tokens),
                                       top_k=top_k if top_k > 0 else None)
    lowered = sampling.lower_generate(params, gpt.cfg, prompts, lengths, keys, options, gpt.compute)
    return Program("generate", _compiled(lowered, "generate"),
                   {"parameters": per_device_bytes(params), "optimizer state": 0,
                    "batch": per_device_bytes((prompts, lengths))}, 0, None,  # its decoding loop: no roofline
                   platform=mesh.devices.flat[0].platform)


# --- the figures ----------------------------------------------------------------------------


def collectives(hlo: str) -> dict[str, dict[str, int]]:
    """{kind: {count, bytes}} of the collective instructions in a compiled program's HLO text,
    bytes their results'. An asynchronous one counts once, by its -done (whose result is the
    output; its -start's tuple also holds the operands). TPU programs fuse a reduce-scatter
    as a fusion calling an %all-reduce-scatter computation (an all-reduce of which each
    device keeps its slice): that fusion counts as one reduce-scatter, its inside not at all.
    An instruction inside a loop counts once."""
    found = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVES}
    inside_fused_scatter = False
    for line in hlo.splitlines():
        if header := _COMPUTATION.match(line):
            inside_fused_scatter = header["name"].startswith("all-reduce-scatter")
            continue
        match = _COLLECTIVE_LINE.match(line)
        kind = "reduce-scatter" if _FUSED_SCATTER.search(line) else match and match["phase"] != "-start" and match["op"]
        if kind and not inside_fused_scatter:
            found[kind]["count"] += 1
            found[kind]["bytes"] += sum(_shape_bytes(shape) for shape in _SHAPE.finditer(_result_type(line)))
    return found


def _result_type(line: str) -> str:
    """The result type of an HLO instruction line: between '=' and the opcode's '('."""
    found = re.match(r"^\s*(?:ROOT )?%\S+ = (.+?) [\w-]+\(", line)
    return found[1] if found else ""


def _shape_bytes(shape: re.Match) -> int:
    dtype = shape["dtype"]
    bits = _BITS.get(dtype) or (8 if dtype.startswith("f8") else int(re.sub(r"\D", "", dtype)))
    return math.prod(int(d) for d in shape["dims"].split(",") if d) * bits // 8


def memory_figures(program: Program) -> dict[str, Any]:
    """The memory of one program per device, from XLA's memory analysis: the parts it
    allocates, which add up to `sum`, and XLA's `peak`, a measure of its own (the most
    bytes live at once), beside them; `total`: the one that must fit the device (`total_from`).

    XLA's argument bytes are the parameters, optimizer state and batch as laid out on the
    mesh (program.inputs) and the rest (other_arguments: scalar arguments such as keys or
    step counts, and the padding of the device's layout, e.g. a TPU's tiles). Outputs count
    only where they do not reuse a donated argument's buffer (output − alias). Temporaries:
    XLA's temp count; generated code: the program's own (in device memory on a TPU).

    XLA's peak (its heap simulation over the program's schedule) shares memory between
    buffers never live together, so it can be below the sum, and it is what must fit; on a
    CPU it counts the arguments, outputs and constants but not the preallocated temporaries,
    so there the sum is the total. A TPU's temp count may be 0 while its peak counts them."""
    memory = program.compiled.memory_analysis()
    parts = {**{key.replace(" ", "_"): value for key, value in program.inputs.items()},
             "other_arguments": memory.argument_size_in_bytes - sum(program.inputs.values()),
             "outputs": memory.output_size_in_bytes - memory.alias_size_in_bytes,
             "temporaries": memory.temp_size_in_bytes,
             "generated_code": getattr(memory, "generated_code_size_in_bytes", 0)}
    whole = sum(parts.values())
    peak = getattr(memory, "peak_memory_in_bytes", 0) or None
    from_peak = peak is not None and program.platform != "cpu"
    return {**parts, "sum": whole, "peak": peak, "total": peak if from_peak else whole,
            "total_from": "peak" if from_peak else "sum"}


def _cost(compiled) -> dict:
    """XLA's cost analysis of a compiled program ({} where it has none)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - XLA: "GetCostAnalysis is not supported" (some GPU builds)
        cost = None
    return (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}


def figures(program: Program, chip: Chip | None, devices: int, budget: float | None = None) -> dict[str, Any]:
    """The report of one program, per device: its memory (memory_figures) against `budget`, the
    bytes a device may use (None: the chip's HBM) as `hbm`, whether it `fits` and the `margin`;
    XLA's counts and the bounds they allow. Where XLA has no cost analysis (a GPU), the counts are
    None and the time is bounded by the model's FLOPs at the chip's peak instead (bound_from
    'model_flops')."""
    cost = _cost(program.compiled)
    counted = "flops" in cost
    parts = [(program.loop, cost), *((times, _cost(compiled)) for times, compiled in program.extras)] if counted else []
    result = {**memory_figures(program),
              "flops": sum(times * float(c["flops"]) for times, c in parts) if counted else None,
              "bytes_accessed": sum(times * float(c.get("bytes accessed", 0.0)) for times, c in parts) if counted
              else None,
              "bound_from": "xla_counts" if counted else "model_flops",
              "tokens": program.tokens, "collectives": collectives(program.compiled.as_text())}
    total, budget = result["total"], budget or (chip.hbm if chip else None)
    if budget:
        result.update(hbm=budget, fits=total <= budget, margin=budget - total)
    if chip and chip.flops and program.tokens and (counted or program.model_flops):
        bound = (max(result["flops"] / chip.flops, result["bytes_accessed"] / chip.bandwidth) if counted
                 else program.model_flops / (chip.flops * devices))
        result["roofline_seconds"] = bound
        result["tokens_per_second_bound"] = program.tokens / bound if bound else None
        if counted and program.model_flops is not None and bound:
            result["mfu_bound"] = program.model_flops / bound / (chip.flops * devices)
    return result


def report(config, devices=None, where: str | None = None) -> dict[str, Any]:
    """Compile the config's programs for `devices` and gather their figures (see figures), each
    against the budget the micro-batch was chosen by (`budget`: its bytes and what they are)."""
    import jax

    from jaxgpt.optim import open_train
    from jaxgpt.train import micro_batch

    devices = list(jax.devices()) if devices is None else devices
    mesh, programs = compile_programs(config, devices)
    chip_name, chip = chip_of(devices)
    memory, of = micro_batch.budget(list(mesh.devices.flat), open_train(config.train),
                                    chip.hbm if chip else None)  # as compile_programs' micro-batch was chosen
    result = {"where": where or f"{len(devices)} local {jax.default_backend()} device(s)", "chip": chip_name,
              "devices": len(devices), "processes": len({d.process_index for d in devices}),
              "mesh": dict(mesh.shape), "chip_figures": dataclasses.asdict(chip) if chip else None,
              "budget": {"bytes": memory, "of": of}, "platform": devices[0].platform,
              "programs": {p.name: figures(p, chip, len(devices), memory) for p in programs}}
    result["larger_micro_batch"] = micro_batch.larger_note(result, programs[0].loop, config.model.block_size)
    return result


def print_and_check(result: dict, json_path: str | None = None) -> int:
    """Print the table (and write --json); 2 with a one-line error when the train step does
    not fit the chip's HBM, else 0."""
    print(format_report(result))
    if result.get("larger_micro_batch"):
        print(f"jaxgpt.compile: {result['larger_micro_batch']}", file=sys.stderr)
    if json_path:
        try:
            Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
        except OSError as error:
            print(f"jaxgpt.compile: cannot write --json {json_path} ({error.strerror or error})", file=sys.stderr)
            return 2
    train = result["programs"]["train step"]
    if train.get("fits", True):
        return 0
    print(f"jaxgpt.compile: the train step needs {size(train['total'])} per device, {size(-train['margin'])} "
          f"more than the {size(train['hbm'])} of {budget_name(result)}: {KNOBS}", file=sys.stderr)
    return 2


# --- the command line -----------------------------------------------------------------------


def local_devices(config) -> list:
    """This process's devices as train.py makes them: on a CPU, mesh.cpu_devices of them
    (sharding.use_cpu_cores), set before JAX's backend starts."""
    import jax

    from jaxgpt import sharding

    sharding.use_cpu_cores(config.mesh, [config.train.batch_size, config.train.eval_batch_size])
    return list(jax.devices())


def main(argv: list[str] | None = None) -> int:
    from jaxgpt.compile.args import check_writable, parse_args, usage, wants_help
    from jaxgpt.errors import one_line, tidy_cli_output

    argv = sys.argv if argv is None else argv
    if wants_help(argv):
        print(usage(known_topologies()))
        return 0
    try:
        options, config_argv = parse_args(argv)
        topology, notes = options.get("topology"), []
        gpu = bool(topology) and gpus.is_gpu_topology(topology)
        if gpu:
            compile_gpu.open_plugin(topology)  # before JAX is imported (the config's modules import it)
        from jaxgpt.cli import parse_config

        config = parse_config(config_argv, DEFAULT_CONFIG)
        use_xla_flags(config.get("xla_flags", "default"))  # they change what XLA compiles, for any target
        if "json" in options:
            check_writable(options["json"])
        tidy_cli_output()
        if gpu and (note := compile_gpu.attention_without_cudnn(config, topology)):
            notes.append(note)
        # XLA's GPU compiler warns on stderr: its warnings become notes; jaxgpt's own lines stay jaxgpt's
        with stderr_kept(enabled=gpu, python=False) as compiler:
            devices = topology_devices(topology, options.get("chips_per_host")) if topology else local_devices(config)
            result = report(config, devices, f"{'GPU' if gpu else 'TPU'} topology {topology}" if topology else None)
        notes.extend(compile_gpu.compiler_notes(compiler.lines()) if gpu else ())
    except ValueError as error:
        print(f"jaxgpt.compile: {one_line(error, limit=2000)}", file=sys.stderr)
        return 2
    return print_and_check({**result, "notes": notes}, options.get("json"))

