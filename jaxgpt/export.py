"""Write a training run as a Hugging Face GPT-2 checkpoint:
python -m jaxgpt.export --run_dir RUN --out DIR [--step N].

DIR receives config.json and model.safetensors (the best checkpoint by validation loss, or
step N) and, when the run's tokenizer is a byte-level BPE with GPT-2's split pattern,
vocab.json + merges.txt; transformers' GPT2LMHeadModel.from_pretrained(DIR) then computes
the run's model. A char or word tokenizer has no GPT-2 form: the weights are written all
the same, and a note says so. A model GPT-2 cannot express (rope, rmsnorm, swiglu, …) is
refused before anything is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from absl import logging as absl_logging

from jaxgpt import convert
from jaxgpt.checkpoint import CheckpointError
from jaxgpt.errors import tidy_cli_output
from jaxgpt.run import load_run


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxgpt.export", description=__doc__.split("\n\n")[1])
    parser.add_argument("--run_dir", required=True, help="a training run's directory")
    parser.add_argument("--out", required=True, help="the directory to write the GPT-2 checkpoint into")
    parser.add_argument("--step", type=int, help="the checkpoint step to export (default: best by validation loss)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    tidy_cli_output()
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's notes on opening checkpoints read-only
    try:
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise ValueError(f"--out {args.out} is a file: give a directory to write the checkpoint into")
        params, config, tokenizer = load_run(args.run_dir, step=args.step)
        try:
            convert.check_gpt2_tokenizer(tokenizer, config)
            tokenizer_note = None
        except ValueError as err:
            tokenizer, tokenizer_note = None, str(err)
        convert.save_hf_gpt2(args.out, config, params, tokenizer=tokenizer)
    except (ValueError, OSError, CheckpointError) as err:
        print(f"export: error: {err}", file=sys.stderr)
        return 2
    files = "config.json, model.safetensors" + (", vocab.json, merges.txt" if tokenizer else "")
    print(f"wrote {args.out}: {files}")
    if tokenizer_note:
        print(f"export: note: wrote the weights without tokenizer files: {tokenizer_note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
