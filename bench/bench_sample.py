"""Generation speed: the KV cache against naive recomputation, and narrow weights against
float32 and transformers, side by side.

    python bench/bench_sample.py [--parts cache weights] [--shapes cpu baby] [--batches 1 16]
                                 [--new_tokens 500] [--gpt2_tokens 128] [--rounds 5] [--run_dir RUN]

For each model shape and batch size, --new_tokens tokens per row are drawn (temperature 1,
no EOS) from a one-token prompt with `jaxgpt.decode.sampling.generate` (the KV cache) and with
naive recomputation: nanoGPT's sample.py as one compiled loop, which runs the whole cropped
context (padded to block_size) through the model for every token. Reported separately:
compile time (tracing, lowering and XLA compilation, from jax.monitoring), first-token
latency (compiled; for the cache, prompt to first token with `stream`), and new tokens per
second of the compiled run. At batch 1 a second column times a run that stays inside the
context (block_size − 1 new tokens), where every cached token costs one position.

Past block_size every new token needs one pass over the block_size-token window, with or
without the cache (see jaxgpt/decode/logits.py), so the table ends with the speed that bound
allows at the measured matmul peak of this machine.

Narrow weights (--parts weights): GPT-2 124M (random weights) decodes greedily at batch 1
from an 8-token prompt, --gpt2_tokens new tokens, with jaxgpt in float32, bfloat16
(ComputeConfig(param_dtype="bfloat16", dtype="bfloat16")) and int8 weights
(ComputeConfig(weights="int8")), and with transformers' GPT2LMHeadModel in float32 and
bfloat16: --rounds rounds, each timing every sampler once in turn, medians, ratios to
jaxgpt float32. Then the greedy tokens of a trained model (--run_dir, or a character model
train.py trains on the stdlib source in about a minute) in bfloat16 and int8 against
float32 over the first 64 new tokens, with float32's margin between its two likeliest
tokens where a row first differs.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxgpt import GPT, ComputeConfig, GPTConfig, flops_per_token  # noqa: E402
from jaxgpt.decode import sampling
from jaxgpt.quantize import params_for  # noqa: E402
from jaxgpt.train.run import load_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    # nanoGPT's shakespeare_char CPU recipe and its "baby GPT" GPU recipe
    "cpu": GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, d_model=128, bias=False, dropout=0.0),
    "baby": GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, d_model=384, bias=False, dropout=0.0),
}
NAMES = {"cpu": "CPU recipe (4×128, block 64)", "baby": "baby GPT (6×384, block 256)"}
CPU_TARGET = 4_500  # new tokens/s, batch 1, CPU-recipe shape, with the cache
BABY_SPEEDUP_TARGET = 10.0  # cache over naive recomputation, baby-GPT shape
PROMPT = [0]  # one token, as nanoGPT's default "\n"
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")

compile_seconds = 0.0


def count_compile_time(event: str, duration: float, **_) -> None:
    global compile_seconds
    if event in COMPILE_EVENTS:
        compile_seconds += duration


def timed(function):
    """(wall seconds, of which compiling, result)."""
    global compile_seconds
    compile_seconds = 0.0
    start = time.perf_counter()
    result = jax.block_until_ready(function())
    return time.perf_counter() - start, compile_seconds, result


@functools.cache  # one compiled loop per shape, as for generate
def naive_generate(cfg: GPTConfig, new_tokens: int):
    """nanoGPT's sample.py as one compiled loop, the baseline: for every new token the last
    block_size tokens (all of them, left-aligned and padded, while fewer) go through the
    model, and the token is drawn as `generate` draws it. All rows are equally long."""
    model, window = GPT(cfg), cfg.block_size

    @jax.jit
    def run(params, prompts, key):
        batch, prompt_length = prompts.shape
        tokens = jnp.zeros((batch, max(prompt_length + new_tokens, window)), jnp.int32)
        tokens = tokens.at[:, :prompt_length].set(prompts)
        uniforms = jax.random.uniform(key, (new_tokens, batch))

        def step(i, tokens):
            length = prompt_length + i
            context = jax.lax.dynamic_slice_in_dim(tokens, jnp.maximum(length - window, 0), window, axis=1)
            logits = model.apply({"params": params}, context)[:, jnp.minimum(length, window) - 1]
            return tokens.at[:, length].set(jax.vmap(sampling.sample_at)(uniforms[i], logits))

        return jax.lax.fori_loop(0, new_tokens, step, tokens)

    return run


def init_params(cfg: GPTConfig):
    """Random params of the shape, initialised in one compiled call."""
    return jax.jit(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"])()


def generation(params, cfg, method, batch, new_tokens, seed=0):
    """A call that draws new_tokens per row from the one-token prompt, with `method`."""
    key = jax.random.key(seed)
    if method == "cache":
        return lambda: sampling.generate(params, cfg, [PROMPT] * batch, key, max_new_tokens=new_tokens)
    run, prompts = naive_generate(cfg, new_tokens), jnp.array([PROMPT] * batch)
    return lambda: run(params, prompts, key)


def run_seconds(params, cfg, method, batch, new_tokens):
    """(compile seconds, seconds of the compiled run): a second run when the first was short."""
    wall, compiling, _ = timed(generation(params, cfg, method, batch, new_tokens))
    seconds = wall - compiling
    if wall < 20:
        seconds = min(seconds, timed(generation(params, cfg, method, batch, new_tokens, seed=1))[0])
    return compiling, seconds


def first_token_seconds(params, cfg, method, batch, new_tokens):
    """Prompt to first token, compiled, best of three: with the cache, the first step of a
    `stream` of new_tokens; naively, a run of one new token."""
    def first_step():
        steps = sampling.stream(params, cfg, [PROMPT] * batch, jax.random.key(0), max_new_tokens=new_tokens)
        next(steps)
        steps.close()

    call = first_step if method == "cache" else generation(params, cfg, method, batch, 1)
    call()
    return min(timed(call)[0] for _ in range(3))


def matmul_peak(n: int = 1024, seconds: float = 1.0) -> float:
    """FLOP/s of a large float32 matmul: what this machine's arithmetic allows at best."""
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        tick = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - tick)
    return 2 * n**3 / best


def window_flops(cfg: GPTConfig) -> float:
    """Forward FLOPs of one pass over a block_size window (a third of training's 6N + attention)."""
    return cfg.block_size * flops_per_token(cfg, cfg.block_size) / 3


def cache_table(args) -> None:
    """The KV cache against naive recomputation: the table, the ratios and the targets."""

    rows, speeds = [], {}
    for shape in args.shapes:
        cfg = SHAPES[shape]
        params = init_params(cfg)
        for batch in args.batches:
            for method in ("cache", "naive"):
                compiling, seconds = run_seconds(params, cfg, method, batch, args.new_tokens)
                first = first_token_seconds(params, cfg, method, batch, args.new_tokens)
                speed = batch * args.new_tokens / seconds
                inside = None
                if batch == 1:
                    fits = cfg.block_size - len(PROMPT)
                    inside = fits / run_seconds(params, cfg, method, batch, fits)[1]
                speeds[shape, batch, method] = (speed, inside)
                rows.append((NAMES[shape], batch, method, compiling, 1e3 * first, speed, inside))
                print(f"  measured {shape} batch {batch} {method}", file=sys.stderr, flush=True)

    header = ("shape", "batch", "method", "compile s", "first token ms", f"tok/s ({args.new_tokens} new)",
              "tok/s (in context)")
    print(f"{header[0]:<30} {header[1]:>5} {header[2]:>6} {header[3]:>9} {header[4]:>14} {header[5]:>15} "
          f"{header[6]:>18}")
    for name, batch, method, compiling, first, speed, inside in rows:
        inside_text = "—" if inside is None else f"{inside:,.0f}"
        print(f"{name:<30} {batch:>5} {method:>6} {compiling:>9.2f} {first:>14.2f} {speed:>15,.0f} {inside_text:>18}")

    print()
    for shape in args.shapes:
        for batch in args.batches:
            cached, cached_inside = speeds[shape, batch, "cache"]
            naive, naive_inside = speeds[shape, batch, "naive"]
            inside = "" if cached_inside is None else f"; inside the context {cached_inside / naive_inside:.1f}×"
            print(f"cache / naive, {NAMES[shape]}, batch {batch}: {cached / naive:.1f}× for "
                  f"{args.new_tokens} new tokens{inside}")

    peak = matmul_peak()
    print(f"\nmatmul peak of this machine: {peak / 1e9:.0f} GFLOP/s")
    for shape in args.shapes:
        cfg = SHAPES[shape]
        past = max(0, len(PROMPT) + args.new_tokens - 1 - cfg.block_size)  # drawn when the sequence is longer
        bound = args.new_tokens / (past * window_flops(cfg) / peak) if past else float("inf")
        print(f"{NAMES[shape]}: {past} of {args.new_tokens} new tokens lie past the context, each one "
              f"{window_flops(cfg) / 1e6:,.0f} MFLOP window pass: at most {bound:,.0f} tok/s at batch 1 at peak")
    if ("cpu", 1, "cache") in speeds:
        speed = speeds["cpu", 1, "cache"][0]
        verdict = "met" if speed >= CPU_TARGET else "missed"
        print(f"target ≥ {CPU_TARGET:,} tok/s, CPU recipe, batch 1, {args.new_tokens} new: {speed:,.0f} ({verdict})")
    for batch in args.batches:
        if ("baby", batch, "cache") in speeds:
            ratio = speeds["baby", batch, "cache"][0] / speeds["baby", batch, "naive"][0]
            verdict = "met" if ratio >= BABY_SPEEDUP_TARGET else "missed"
            print(f"target cache ≥ {BABY_SPEEDUP_TARGET:.0f}× naive, baby GPT, batch {batch}, "
                  f"{args.new_tokens} new: {ratio:.1f}× ({verdict})")




# --- narrow weights: GPT-2 124M, greedy, batch 1, against float32 and transformers ------------

GPT2 = GPTConfig()  # GPT-2 small: 12 layers, d_model 768, vocab 50257
GPT2_PROMPT = list(range(1, 9))
NARROW = {
    "float32": ComputeConfig(),
    "bfloat16": ComputeConfig(dtype="bfloat16", param_dtype="bfloat16"),
    "int8": ComputeConfig(weights="int8"),
}
WEIGHTS_TARGET = 1.8  # narrow weights' tokens/s over jaxgpt float32's, GPT-2 124M, batch 1
AGREEMENT_NEW = 64
AGREEMENT_TARGET = 60  # greedy tokens equal to float32's, of the first AGREEMENT_NEW
AGREEMENT_PROMPTS = ("\n", "The ", "def ", "import ", "    return ", "KING ", "class ", "What ")


def jaxgpt_sampler(params, compute: ComputeConfig, new_tokens: int):
    """Greedy generation of new_tokens from GPT2_PROMPT with `compute`, compiled by a first call."""
    narrow = params_for(params, GPT2, compute)

    def sample():
        result = sampling.generate(narrow, GPT2, [GPT2_PROMPT], 0, max_new_tokens=new_tokens, temperature=0.0,
                                   compute=compute)
        return jax.block_until_ready(result.tokens)

    sample()
    return sample


def transformers_samplers(new_tokens: int) -> dict:
    """transformers' GPT2LMHeadModel (random weights) in float32 and bfloat16, greedy, with its
    KV cache, exactly new_tokens new tokens; {} when transformers is not installed."""
    try:
        import torch
        import transformers
    except ImportError:
        return {}
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    ids = torch.tensor([GPT2_PROMPT])

    def sampler(net):
        def sample():
            with torch.inference_mode():
                return net.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

        sample()
        return sample

    return {"float32": sampler(model), "bfloat16": sampler(copy.deepcopy(model).to(torch.bfloat16))}


def interleaved_speeds(samplers: dict, new_tokens: int, rounds: int) -> dict:
    """Median new tokens/s of each sampler over `rounds` rounds that call every one in turn."""
    seconds = {name: [] for name in samplers}
    for _ in range(rounds):
        for name, sample in samplers.items():
            start = time.perf_counter()
            sample()
            seconds[name].append(time.perf_counter() - start)
    return {name: new_tokens / statistics.median(times) for name, times in seconds.items()}


def weights_table(args) -> None:
    """GPT-2 124M at batch 1: jaxgpt float32, bfloat16, int8 and transformers float32, bfloat16."""
    params = init_params(GPT2)
    samplers = {("jaxgpt", name): jaxgpt_sampler(params, compute, args.gpt2_tokens) for name, compute in NARROW.items()}
    for name, sample in transformers_samplers(args.gpt2_tokens).items():
        samplers["transformers", name] = sample
    print("  compiled and warmed up; timing", file=sys.stderr, flush=True)
    speeds = interleaved_speeds(samplers, args.gpt2_tokens, args.rounds)
    base = speeds["jaxgpt", "float32"]
    print(f"\nGPT-2 124M (random weights), greedy, batch 1, {len(GPT2_PROMPT)}-token prompt, {args.gpt2_tokens} new "
          f"tokens: medians of {args.rounds} interleaved rounds")
    print(f"{'peer':<13} {'weights':<9} {'tok/s':>7} {'× jaxgpt float32':>17}")
    for (peer, name), speed in speeds.items():
        print(f"{peer:<13} {name:<9} {speed:>7.1f} {speed / base:>17.2f}")
    for name in ("bfloat16", "int8"):
        ratio = speeds["jaxgpt", name] / base
        verdict = "met" if ratio >= WEIGHTS_TARGET else "missed"
        print(f"target jaxgpt {name} ≥ {WEIGHTS_TARGET}× jaxgpt float32: {ratio:.2f}× ({verdict})")


def trained_run(run_dir: str | None) -> Path:
    """The run to check agreement on: run_dir, or nanoGPT's CPU character recipe trained by
    train.py on the stdlib source into a temporary directory (about a minute)."""
    if run_dir is not None:
        return Path(run_dir)
    directory = Path(tempfile.mkdtemp(prefix="bench_sample_"))
    print(f"  training a character model in {directory}", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, str(ROOT / "train.py"), "--config=configs/shakespeare_char_cpu.py",
                    "--config.data.source=stdlib", f"--config.run_dir={directory / 'run'}",
                    f"--config.data.cache_dir={directory / 'cache'}"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return directory / "run"


def greedy_rows(run_dir: Path, compute: ComputeConfig, prompts: list[str]):
    """(the first AGREEMENT_NEW greedy tokens of each prompt, their top-2 logprobs) with `compute`."""
    params, cfg, tokenizer = load_run(run_dir, compute=compute)
    result = jax.device_get(sampling.generate(params, cfg, [tokenizer.encode(p) for p in prompts], 0,
                                              max_new_tokens=AGREEMENT_NEW, temperature=0.0, compute=compute,
                                              top_logprobs=2))
    return [row[:AGREEMENT_NEW] for row in result.new_tokens()], result.top_logprobs


def encodes(tokenizer, text: str) -> bool:
    """Whether the tokenizer encodes text and decodes it back as it was."""
    try:
        return tokenizer.decode(tokenizer.encode(text)) == text
    except ValueError:
        return False


def agreement_table(run_dir: str | None) -> None:
    """How many of the first 64 greedy tokens bfloat16 and int8 share with float32, per prompt."""
    run = trained_run(run_dir)
    tokenizer = load_run(run)[2]
    prompts = [prompt for prompt in AGREEMENT_PROMPTS if encodes(tokenizer, prompt)]
    (want, top), rows = greedy_rows(run, NARROW["float32"], prompts), []
    for name in ("bfloat16", "int8"):
        got, _ = greedy_rows(run, NARROW[name], prompts)
        for i, prompt in enumerate(prompts):
            differ = np.nonzero(got[i] != want[i])[0]
            margin = "—" if not len(differ) else f"{top[i, differ[0], 0] - top[i, differ[0], 1]:.4f}"
            rows.append((name, repr(prompt), int((got[i] == want[i]).sum()), margin))
    print(f"\ngreedy agreement with float32 over the first {AGREEMENT_NEW} new tokens, trained run {run}")
    print(f"{'weights':<9} {'prompt':<14} {'equal':>5}  float32's top-2 logprob margin where it first differs")
    for name, prompt, equal, margin in rows:
        print(f"{name:<9} {prompt:<14} {equal:>5}  {margin}")
    for name in ("bfloat16", "int8"):
        counts = [equal for n, _, equal, _ in rows if n == name]
        met = sum(count >= AGREEMENT_TARGET for count in counts)
        print(f"target ≥ {AGREEMENT_TARGET}/{AGREEMENT_NEW} equal, {name}: {met} of {len(counts)} prompts")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=["cache", "weights"], default=["cache", "weights"])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["cpu", "baby"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--new_tokens", type=int, default=500)
    parser.add_argument("--gpt2_tokens", type=int, default=128, help="new tokens per GPT-2 124M sample")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the GPT-2 124M samplers")
    parser.add_argument("--run_dir", help="a trained run for the agreement check (default: train one)")
    args = parser.parse_args(argv)
    jax.monitoring.register_event_duration_secs_listener(count_compile_time)
    if "cache" in args.parts:
        cache_table(args)
    if "weights" in args.parts:
        weights_table(args)
        agreement_table(args.run_dir)


if __name__ == "__main__":
    main()
