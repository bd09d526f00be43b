"""Sample text from a trained run:
python sample.py --run_dir RUN [--prompt TEXT | --prompt_file PATH | --record JSON | < stdin].
With no prompt (none given, or an empty one) the samples are unconditional: each starts a new
document, after the tokenizer's <|eos|>.

(--hf_dir PATH samples from a Hugging Face GPT-2 directory instead of a run.)

Loads the run's config, tokenizer and best (else latest) checkpoint, then prints
--num_samples continuations of the prompt, drawn with --temperature/--top_k/--top_p, or the
--beams best by beam search. --stream prints text as it is generated; --show_probs K prints,
before each new token, the K most likely next tokens under the model. Generation stops at
the tokenizer's <|eos|>. The work is done by jaxgpt.decode.sampling, jaxgpt.decode.beam and jaxgpt.decode.text.

How the model runs is chosen here, whatever the run was trained with: --param_dtype
bfloat16 keeps the weights in bfloat16 (auto, the default: bfloat16 on a GPU or TPU, which then
read half the bytes per token, float32 on a CPU), --weights int8 quantises each weight matrix to int8
with a scale per output channel (a quarter of float32's bytes read per token), --dtype sets
the matmuls' dtype and --kernel the attention kernel.

Records runs: --record '{"question": "1+2"}' formats the prompt as training formatted the
record's (the run's data.records.template, or its prompt_template; for chat, the earlier turns with
their completions and <|eos|>, then "Assistant: ") and prints only the completion. --template
names a preset instead (prompt_completion, alpaca, qa, chat; 'run' for the run's own). With
--prompt and --template, the prompt text fills the template's first required field (qa:
question, alpaca: instruction, prompt_completion: prompt; chat: one user message). A prompt
formatted by a template is answered greedily unless --temperature is given.
"""

from __future__ import annotations

# isort: off
import jaxgpt  # noqa: F401  (before JAX: keeps an accelerator's plugin this machine cannot use out, jaxgpt.platforms)
# isort: on
import argparse
import json
import sys
from pathlib import Path

import jax
from absl import logging as absl_logging

from jaxgpt import convert, sharding
from jaxgpt.attention import KERNELS
from jaxgpt.checkpoint import CheckpointError
from jaxgpt.cli import unescape
from jaxgpt.config import ComputeConfig
from jaxgpt.data.records import PRESETS
from jaxgpt.decode import beam, sampling
from jaxgpt.decode.text import TextStream, format_next_tokens, prompt_or_start
from jaxgpt.errors import exit_without_a_last_collection, tidy_cli_output
from jaxgpt.model_config import DTYPES, WEIGHTS
from jaxgpt.quantize import params_for
from jaxgpt.registries import check_kernel
from jaxgpt.score.completions import RUN_TEMPLATE, prompt_record, record_prompt, templates_named
from jaxgpt.train.run import load_run
from jaxgpt.train.rundir import read_run

DIVIDER = "-" * 15


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="sample.py", description=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--run_dir", help="a training run's directory")
    model.add_argument("--hf_dir", help="a Hugging Face GPT-2 directory (config.json, model.safetensors, vocab.json, "
                                        "merges.txt)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", type=unescape, help=r"the text to continue (\n a newline, \t a tab, \\ a "
                                                        "backslash)")
    source.add_argument("--prompt_file", help="a file holding the text to continue")
    source.add_argument("--record", metavar="JSON", help="a record (a JSON object of fields) whose prompt the run's "
                                                         "template (or --template) makes; prints the completion")
    parser.add_argument("--template", help=f"format the prompt by a records preset ({', '.join(PRESETS)}) or "
                                           f"{RUN_TEMPLATE!r}, the run's own (the default for --record)")
    parser.add_argument("--num_samples", type=int, default=1, help="how many continuations (default 1)")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="at most this many new tokens (default 256)")
    parser.add_argument("--temperature", type=float,
                        help="τ ≥ 0, 0 for greedy (default 1: the model's distribution; 0 for a prompt formatted by "
                             "a template)")
    parser.add_argument("--top_k", type=int, help="draw among the k most likely tokens only")
    parser.add_argument("--top_p", type=float, help="draw among the fewest most likely tokens holding probability p")
    parser.add_argument("--beams", type=int, help="beam search with this many beams instead of sampling")
    parser.add_argument("--compilation_cache", default="auto",
                        help="where compiled programs are kept between runs, as train.py's compilation_cache: 'auto' "
                             "($JAX_COMPILATION_CACHE_DIR, else ~/.cache/jaxgpt/xla), a directory, or 'off'")
    parser.add_argument("--step", type=int, help="with --run_dir: the checkpoint step (default: the best by validation "
                                                 "loss, or the newest intact one when that is damaged)")
    parser.add_argument("--calibrated", action="store_true",
                        help="divide the logits by the temperature eval.py --calibration fitted (calibration.json)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--stream", action="store_true", help="print the text as it is generated")
    parser.add_argument("--show_probs", type=int, metavar="K",
                        help="before each new token, the K most likely next tokens with their probabilities")
    parser.add_argument("--attention_png", metavar="FILE",
                        help="also draw the prompt's attention weights, one heatmap per head, to this PNG")
    parser.add_argument("--attention_layer", type=int, default=0,
                        help="the layer --attention_png draws, from 0 (default 0; -1 the last)")
    compute = parser.add_argument_group("how the model runs here (config.compute)")
    compute.add_argument("--param_dtype", choices=(*DTYPES, "auto"), default="auto",
                         help="the dtype the params are kept in (default auto: bfloat16 on a GPU or TPU, float32 on a "
                              "CPU)")
    compute.add_argument("--dtype", choices=DTYPES, help="the dtype the matmuls compute in (default: --param_dtype)")
    compute.add_argument("--weights", choices=WEIGHTS, default="float",
                         help="int8: weight-only quantisation, a scale per output channel (default float)")
    compute.add_argument("--kernel", choices=sorted(KERNELS), default="explicit",
                         help="the attention kernel (default explicit)")
    return parser.parse_args(argv)


def compute_settings(args) -> ComputeConfig:
    """The compute config the arguments ask to sample with (--param_dtype auto: bfloat16 where the
    devices compute in it natively, a GPU or TPU; float32 on a CPU)."""
    param_dtype = args.param_dtype
    if param_dtype == "auto":
        param_dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return ComputeConfig(kernel=args.kernel, dtype=args.dtype or param_dtype, param_dtype=param_dtype,
                         weights=args.weights)


def check_args(args) -> None:
    """Impossible values and combinations, found before anything is loaded."""
    check_record_args(args)
    if args.step is not None and args.hf_dir is not None:
        raise ValueError("--step chooses a run's checkpoint; a Hugging Face directory has one model: drop --step")
    if args.calibrated and args.run_dir is None:
        raise ValueError("--calibrated uses the temperature eval.py --calibration fitted for a run: give --run_dir")
    if args.attention_png and args.weights != "float":
        raise ValueError("--attention_png draws the float model's attention: drop --weights int8 (or --attention_png)")
    for name in ("num_samples", "max_new_tokens", "show_probs", "beams"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value}")
    if args.beams is None:
        sampling_options(args)  # checks the sampling arguments
        return
    given = [f"--{name}" for name in ("temperature", "top_k", "top_p", "show_probs") if getattr(args, name) is not None]
    given += ["--stream"] if args.stream else []
    if given:
        raise ValueError(f"beam search is deterministic and prints whole beams: drop {', '.join(given)}, or --beams")
    if args.num_samples > args.beams:
        raise ValueError(f"--num_samples={args.num_samples} is more than --beams={args.beams}, the beams kept")


def templated(args) -> bool:
    """Whether a records template formats the prompt (--record or --template)."""
    return args.record is not None or args.template is not None


def check_record_args(args) -> None:
    """--record's JSON and --template."""
    if args.template is not None and args.template not in (*PRESETS, RUN_TEMPLATE):
        raise ValueError(f"--template {args.template!r} is not a preset: choose one of {', '.join(PRESETS)}, or "
                         f"{RUN_TEMPLATE!r} for the run's own")
    if templated(args) and args.hf_dir is not None and args.template in (None, RUN_TEMPLATE):
        raise ValueError(f"a Hugging Face model has no records template of its own: name a preset with --template "
                         f"({', '.join(PRESETS)})")
    record_fields(args)


def record_fields(args) -> dict | None:
    """The fields of --record's JSON object (None without --record); ValueError for anything else."""
    if args.record is None:
        return None
    try:
        fields = json.loads(args.record)
    except json.JSONDecodeError as err:
        raise ValueError(f"--record is not valid JSON ({err.msg} at character {err.pos}): give one object, e.g. "
                         """--record '{"question": "1+2"}'""") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--record must be a JSON object of fields, e.g. '{{\"question\": \"1+2\"}}', not a "
                         f"JSON {type(fields).__name__}")
    return fields


def prompt_ids(args, tokenizer, text: str | None) -> tuple[str, list[int]]:
    """(the text printed before each sample, the prompt's ids): the prompt as given, or
    formatted by the records template (then nothing is printed before the completion)."""
    if not templated(args):
        return text, prompt_or_start(tokenizer, text)
    data = {}
    if (args.template or RUN_TEMPLATE) == RUN_TEMPLATE:
        data = json.loads((Path(args.run_dir) / "config.json").read_text(encoding="utf-8")).get("data", {})
    forms = templates_named(args.template or RUN_TEMPLATE, data)
    fields = record_fields(args)
    if fields is None:
        fields = prompt_record(forms, text)
    return "", record_prompt(forms, fields, tokenizer)[1]


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"cannot read --prompt_file {args.prompt_file}: {err}") from None
    if sys.stdin is None or sys.stdin.isatty():
        return ""  # no prompt: unconditional samples, each a new document
    return sys.stdin.read()


def print_sample(tokenizer, prompt: str, ids: list[int], records, stream: bool, show_probs: bool) -> None:
    """One sample from its (token, top ids, top logprobs) records: with show_probs a line per
    token and then the text, else the text (as it comes when streaming)."""
    text = TextStream(tokenizer)
    context = list(ids)
    live = stream and not show_probs
    if live:
        print(prompt, end="", flush=True)
    for token, top_ids, top_logprobs in records:
        if show_probs:
            print(format_next_tokens(tokenizer, context, top_ids, top_logprobs), flush=stream)
        context.append(int(token))
        new_text = text.push(token)
        if live:
            print(new_text, end="", flush=True)
    print(text.finish() if live else prompt + tokenizer.decode(context[len(ids):]))


def row_of(records, i):
    """Row i of a record array, or None when that record was not asked for."""
    return None if records is None else records[i]


def calibrated_temperature(run_dir: Path) -> float:
    """The temperature T* that eval.py --calibration fitted for the run."""
    path = run_dir / "calibration.json"
    try:
        return float(json.loads(path.read_text(encoding="utf-8"))["temperature"])
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: run eval.py --run_dir {run_dir} --calibration first") from None
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path} holds no temperature: run eval.py --run_dir {run_dir} --calibration again") \
            from None


def sampling_options(args, temperature_scale: float = 1.0, **more) -> sampling.SamplingOptions:
    """The arguments' SamplingOptions (ValueError for impossible ones), their temperature times
    temperature_scale (--calibrated's T*), with `more` fields."""
    default = 0.0 if templated(args) else 1.0
    temperature = (default if args.temperature is None else args.temperature) * temperature_scale
    return sampling.SamplingOptions(args.max_new_tokens, temperature=temperature, top_k=args.top_k, top_p=args.top_p,
                                    **more)


def print_samples(args, params, config, tokenizer, prompt: str, ids: list[int], compute: ComputeConfig,
                  temperature_scale: float) -> None:
    key = jax.random.key(args.seed)
    show_probs = args.show_probs is not None
    options = sampling_options(args, temperature_scale, eos_id=tokenizer.eos_id,
                               top_logprobs=min(args.show_probs or 0, config.vocab_size))
    if args.stream:
        for i in range(args.num_samples):
            # One row at a time, with the key that row i of a batch would have: the same samples.
            steps = sampling.stream(params, config, [ids], jax.random.fold_in(key, i)[None], options, compute=compute)
            records = ((s.token[0], row_of(s.top_ids, 0), row_of(s.top_logprobs, 0)) for s in steps)
            if i:
                print(DIVIDER)
            print_sample(tokenizer, prompt, ids, records, stream=True, show_probs=show_probs)
        return
    result = jax.device_get(sampling.generate(params, config, [ids] * args.num_samples, key, options,
                                              compute=compute))
    for i, new in enumerate(result.new_tokens()):
        top_ids, top_logprobs = row_of(result.top_ids, i), row_of(result.top_logprobs, i)
        records = ((token, row_of(top_ids, step), row_of(top_logprobs, step)) for step, token in enumerate(new))
        if i:
            print(DIVIDER)
        print_sample(tokenizer, prompt, ids, records, stream=False, show_probs=show_probs)


def print_beams(args, params, config, tokenizer, prompt: str, ids: list[int], compute: ComputeConfig) -> None:
    beams = jax.device_get(beam.beam_search(params, config, ids, num_beams=args.beams,
                                            max_new_tokens=args.max_new_tokens, eos_id=tokenizer.eos_id,
                                            compute=compute))
    for i in range(args.num_samples):
        if i:
            print(DIVIDER)
        print(f"# beam {i + 1}, score {beams.scores[i]:.4f}")
        print(prompt + tokenizer.decode(beams.tokens[i, len(ids):beams.lengths[i]]))


def check_kernel_here(args, compute: ComputeConfig) -> None:
    """--kernel against the devices here and the model (registries.check_kernel), before its
    params are read."""
    config = read_run(Path(args.run_dir))[1] if args.run_dir is not None else convert.load_hf_config(args.hf_dir)
    check_kernel(compute.kernel, config, jax.default_backend(), dtype=compute.dtype, flag="--kernel")


def load_model(args, compute: ComputeConfig):
    """(params as compute reads them, config, tokenizer) of --run_dir or --hf_dir."""
    if args.run_dir is not None:
        return load_run(args.run_dir, step=args.step, compute=compute)
    params, config, tokenizer = convert.load_hf_run(args.hf_dir)
    return params_for(params, config, compute), config, tokenizer


def main(argv=None) -> int:
    args = parse_args(argv)
    tidy_cli_output()
    exit_without_a_last_collection()
    try:
        check_args(args)
        sharding.use_compilation_cache(args.compilation_cache)  # a second sample loads its programs
        compute = compute_settings(args)
        check_kernel_here(args, compute)
        text = read_prompt(args) if args.record is None else None
        absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's notes on opening checkpoints read-only
        params, config, tokenizer = load_model(args, compute)
        temperature_scale = calibrated_temperature(Path(args.run_dir)) if args.calibrated else 1.0
        prompt, ids = prompt_ids(args, tokenizer, text)
        if args.attention_png:
            from jaxgpt import viz  # matplotlib: only for the picture

            viz.draw_attention(params, config, tokenizer, ids, args.attention_png, layer=args.attention_layer,
                               name=Path(args.run_dir or args.hf_dir).name)
    except (ValueError, CheckpointError) as err:
        print(f"sample.py: error: {err}", file=sys.stderr)
        return 2
    if args.beams is None:
        print_samples(args, params, config, tokenizer, prompt, ids, compute, temperature_scale)
    else:
        print_beams(args, params, config, tokenizer, prompt, ids, compute)
    return 0


if __name__ == "__main__":
    sys.exit(main())
