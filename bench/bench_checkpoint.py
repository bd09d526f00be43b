"""How long `Checkpoints.save` holds up the training loop at GPT-2 small, and how long until
the checkpoint is written; side by side with the checkpoint module of another checkout.

    python bench/bench_checkpoint.py [--repeat 5] [--peer PATH] [--dir DIR]

The state is GPT-2 small's train state (124M parameters and AdamW's mu and nu, float32:
1.4 GiB), made by `init_state` and ready on the devices before each save, so that the time is
the save's own. Each save is asynchronous (`Checkpoints(dir, async_save=True)`), of the same
state as a new step: "blocking" is the time until `save()` returns (the loop's stall: the
checksums, then orbax's copy of the arrays off the devices), "written" the time until
`manager.wait_until_finished()` returns, and "checksums" times `tree_checksums` alone. The
first save (which compiles the checksum program, where there is one) is reported apart; the
others give the medians.

--peer PATH: the jaxgpt/checkpoint.py of the checkout at PATH (say, an earlier commit),
loaded beside this one in the same process and timed on the same state, the two alternating
save by save, so that both see the same load on the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import jax  # noqa: E402
from table import print_table  # noqa: E402

from jaxgpt import GPTConfig, checkpoint  # noqa: E402
from jaxgpt.config import TrainConfig  # noqa: E402
from jaxgpt.model import param_layout  # noqa: E402
from jaxgpt.optim import make_optimizer  # noqa: E402
from jaxgpt.train.step import init_state  # noqa: E402


def gpt2_small_state() -> dict:
    """GPT-2 small's train state as `Checkpoints.save` takes it, computed and on the devices."""
    optimizer = make_optimizer(TrainConfig(), param_layout(GPTConfig()))
    state = jax.jit(lambda: init_state(GPTConfig(), optimizer, 0).to_dict())()
    return jax.block_until_ready(state)


def peer_module(checkout: Path):
    """The checkpoint module of another checkout, under a name of its own."""
    spec = importlib.util.spec_from_file_location("peer_checkpoint", checkout / "jaxgpt" / "checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed_save(checkpoints, step: int, state: dict) -> tuple[float, float]:
    """(seconds until save() returned, seconds until the checkpoint was written)."""
    start = time.perf_counter()
    checkpoints.save(step, state)
    blocking = time.perf_counter() - start
    checkpoints.manager.wait_until_finished()
    return blocking, time.perf_counter() - start


def timed_checksums(module, state: dict) -> float:
    start = time.perf_counter()
    module.tree_checksums(state)
    return time.perf_counter() - start


def measure(modules: dict, state: dict, work: Path, repeat: int) -> dict[str, dict[str, float]]:
    """Per module, the seconds of each measure; the modules take turns, in turn first."""
    stores = {name: module.Checkpoints(work / name, keep=2, async_save=True) for name, module in modules.items()}
    times = {name: {"blocking": [], "written": [], "checksums": []} for name in modules}
    for step in range(1, repeat + 2):
        order = list(modules) if step % 2 else list(reversed(modules))
        for name in order:
            blocking, written = timed_save(stores[name], step, state)
            times[name]["blocking"].append(blocking)
            times[name]["written"].append(written)
        for name in order:
            times[name]["checksums"].append(timed_checksums(modules[name], state))
    for store in stores.values():
        store.close()
    return {name: {"first save, blocking": t["blocking"][0], "save, blocking": statistics.median(t["blocking"][1:]),
                   "save, written": statistics.median(t["written"][1:]),
                   "checksums": statistics.median(t["checksums"][1:])}
            for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="saves after the first (medians)")
    parser.add_argument("--peer", type=Path, help="a jaxgpt checkout whose checkpoint module to time beside this one")
    parser.add_argument("--dir", type=Path, help="where to write the checkpoints (default: the temporary directory)")
    args = parser.parse_args()
    modules = {"this": checkpoint, **({"peer": peer_module(args.peer.resolve())} if args.peer else {})}
    state = gpt2_small_state()
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir))
    try:
        seconds = measure(modules, state, work, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    parameters = sum(x.size for x in jax.tree.leaves(state["params"]))
    print(f"GPT-2 small train state: {parameters / 1e6:.1f}M parameters, "
          f"{sum(x.nbytes for x in jax.tree.leaves(state)) / 2**30:.2f} GiB with AdamW's mu and nu; "
          f"{jax.device_count()} × {jax.devices()[0].device_kind}; medians of {args.repeat} asynchronous saves")
    print(f"  this: {Path(checkpoint.__file__).parent.parent}" + (f"\n  peer: {args.peer}" if args.peer else ""))
    rows = []
    for key, this in seconds["this"].items():
        peer = [f"{seconds['peer'][key]:.3f}", f"{seconds['peer'][key] / this:.1f}×"] if args.peer else []
        rows.append([key, f"{this:.3f}", *peer])
    print_table(("seconds", "this", *(("peer", "peer / this") if args.peer else ())), rows)


if __name__ == "__main__":
    main()
