"""What one generated token costs the device in launches: `generate`'s program compiled for a GPU
topology (default h100:1, no GPU needed: jaxgpt.compile.gpu) or for this process's devices, and
its decoding loop's body read from the compiled HLO. Each instruction of the body that is not
bookkeeping (parameters, tuples, constants, bitcasts) runs as one kernel or library call per token:
fusions (XLA's kernels), GEMMs and other custom calls (cuBLAS, cuDNN), copies and the rest. Also
whether the loop's trip count is known (the device then never asks the host whether to go on)
and, from the body's parameter and the weights' bytes, the floor one token cannot go under.

    python bench/bench_decode_kernels.py                        # gpt2_124m, batch 1, for h100:1
    python bench/bench_decode_kernels.py --topology here --configs shakespeare_char_cpu
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

BOOKKEEPING = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
               "replica-id", "opt-barrier"}
CALLS = re.compile(r"\b(?:body|condition|to_apply|calls|branch_computations|true_computation|"
                   r"false_computation)=\{?([%\w.\-, ]+)\}?")


def computations(hlo: str) -> dict[str, list[str]]:
    """{name: its instruction lines} of an HLO module's text."""
    found, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head[1]
            found[name] = []
        elif name and line.startswith("  ") and "=" in line:
            found[name].append(line.strip())
    return found


def opcode(line: str) -> str:
    """The instruction's opcode: what follows its result type (a tuple's in balanced parentheses)."""
    rest = line.split("=", 1)[1].lstrip()
    if rest.startswith("("):
        depth = 0
        for i, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                rest = rest[i + 1:]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    found = re.match(r"\s*([a-z][\w\-]*)\(", rest)
    return found[1] if found else "?"


def kernels(comps: dict[str, list[str]], name: str) -> Counter:
    """The launches of computation `name` per run, by kind, with those of the loops and branches it
    calls (fusions' own computations are one launch)."""
    count: Counter = Counter()
    for line in comps.get(name, []):
        op = opcode(line)
        if op in BOOKKEEPING:
            continue
        if op in ("while", "conditional", "call"):
            count[op] += 1
            for callee in CALLS.findall(line):
                for part in callee.split(","):
                    count.update(kernels(comps, part.strip().lstrip("%")))
            continue
        if op == "fusion":
            kind = "gemm" if re.search(r'"(?:gemm|cublas)', line) or "__cublas" in line else "fusion"
            count[kind] += 1
        elif op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', line)
            count["gemm" if target and "cublas" in target[1] else f"custom-call {target[1] if target else ''}"] += 1
        else:
            count[op] += 1
    return count


def decoding_loop(hlo: str) -> tuple[str, bool]:
    """(the body of the loop that decodes one token a turn: of all the program's loops, the one
    whose own body launches the most, and whether XLA knows its trip count)."""
    comps = computations(hlo)
    loops = [line for lines in comps.values() for line in lines if opcode(line) == "while"]
    if not loops:
        raise SystemExit("no loop in the program")
    own = {line: sum(opcode(x) not in BOOKKEEPING for x in comps.get(re.search(r"body=%?([\w.\-]+)", line)[1], []))
           for line in loops}
    line = max(loops, key=own.get)
    return re.search(r"body=%?([\w.\-]+)", line)[1], "known_trip_count" in line


def compile_generate(config_name: str, topology: str, batch: int, new: int, weights: str, kernel: str,
                     matmul: str = "auto"):
    """generate's compiled program for `batch` one-token prompts and `new` new tokens (greedy)."""
    from jaxgpt.compile import topology_devices

    devices = None if topology == "here" else topology_devices(topology)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxgpt import GPT, ComputeConfig, GPTConfig
    from jaxgpt.config import load_config
    from jaxgpt.decode import sampling
    from jaxgpt.decode.logits import prompt_bucket
    from jaxgpt.model import param_shapes

    config = load_config(ROOT / "configs" / f"{config_name}.py")
    cfg = GPTConfig.from_dict(dict(config.model))
    dtype = config.compute.dtype if weights == "compute" else config.compute.param_dtype
    compute = ComputeConfig.from_dict({**config.compute, "kernel": kernel, "param_dtype": dtype, "loss_chunk": 0,
                                       "matmul": matmul})
    gpt = GPT(cfg, compute)
    mesh = Mesh(np.array((devices or jax.devices())[:1]), ("data",))
    whole = NamedSharding(mesh, PartitionSpec())
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=whole), param_shapes(gpt))
    width = prompt_bucket(1)
    prompts = jax.ShapeDtypeStruct((batch, width), np.int32, sharding=whole)
    lengths = jax.ShapeDtypeStruct((batch,), np.int32, sharding=whole)
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    keys = jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=whole)
    options = sampling.SamplingOptions(max_new_tokens=new, temperature=0.0)
    lowered = sampling.lower_generate(params, cfg, prompts, lengths, keys, options, compute)
    weight_bytes = sum(s.size * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(params))
    return lowered.compile(), weight_bytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="gpt2_124m")
    parser.add_argument("--topology", default="h100:1", help="a GPU topology, or 'here' for this process's devices")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--weights", default="compute,param", help="compute: cast to the compute dtype; param: as kept")
    parser.add_argument("--kernel", default="xla")
    parser.add_argument("--matmul", default="auto,xla", help="compute.matmul forms (auto: a GPU's pads few rows)")
    parser.add_argument("--hlo", default=None, help="write the first program's HLO here")
    args = parser.parse_args(argv)
    from table import print_table

    rows = []
    for name in args.configs.split(","):
        for weights, matmul in ((w, m) for w in args.weights.split(",") for m in args.matmul.split(",")):
            for batch in (int(b) for b in args.batch.split(",")):
                compiled, weight_bytes = compile_generate(name, args.topology, batch, args.new, weights, args.kernel,
                                                          matmul)
                hlo = compiled.as_text()
                if args.hlo:
                    Path(args.hlo).write_text(hlo)
                    args.hlo = None
                body, known = decoding_loop(hlo)
                count = kernels(computations(hlo), body)
                launches = sum(v for k, v in count.items() if k not in ("while", "conditional", "call"))
                rest = ", ".join(f"{k} {v}" for k, v in count.most_common() if k not in ("fusion", "gemm"))
                rows.append((name, weights, matmul, str(batch), str(launches), str(count["fusion"]), str(count["gemm"]),
                             rest, "yes" if known else "no", f"{weight_bytes / 2**20:,.0f}"))
    print(f"generate's decoding loop compiled for {args.topology}, {args.new} new tokens, kernel={args.kernel}")
    print_table(("config", "weights", "matmul", "batch", "launches/token", "fusions", "GEMMs", "other",
                 "trip count known", "weights (MiB)"), rows)
    return rows


if __name__ == "__main__":
    main()
