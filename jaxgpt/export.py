"""Write a training run as a Hugging Face GPT-2 checkpoint:
python -m jaxgpt.export --run_dir RUN --out DIR [--step N].

DIR receives config.json and model.safetensors (the best checkpoint by validation loss, or
step N) and, when the run's tokenizer is a byte-level BPE with GPT-2's split pattern,
vocab.json + merges.txt; transformers' GPT2LMHeadModel.from_pretrained(DIR) then computes
the run's model. A char or word tokenizer has no GPT-2 form: the weights are written all
the same, and a note says so. A model GPT-2 cannot express (rope, rmsnorm, swiglu, …) is
refused before anything is written. DIR then describes exactly one model: it must be new,
empty, or written by an earlier export, which jaxgpt_export.json records (each file with its
sha256). The earlier export's files are replaced, and those this one does not write are
removed and named (a char run exported over a BPE run's export loses its vocab.json and
merges.txt). Any other file in DIR (one no export wrote, or one changed since) is refused
and named, and nothing is written: move it away, or choose another --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from absl import logging as absl_logging

from jaxgpt import convert
from jaxgpt.checkpoint import CheckpointError
from jaxgpt.errors import tidy_cli_output
from jaxgpt.files import write_json
from jaxgpt.train.run import load_run

MANIFEST = "jaxgpt_export.json"  # the files an export wrote, each with its sha256


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxgpt.export", description=__doc__.split("\n\n")[1])
    parser.add_argument("--run_dir", required=True, help="a training run's directory")
    parser.add_argument("--out", required=True, help="the directory to write the GPT-2 checkpoint into: new, empty, "
                                                     "or an earlier export's")
    parser.add_argument("--step", type=int, help="the checkpoint step to export (default: best by validation loss)")
    return parser.parse_args(argv)


def earlier_export(directory: Path) -> dict[str, str | None]:
    """The files of `directory` that an earlier export wrote and nothing changed since, with
    their recorded sha256 (None: being written by an export that did not finish). ValueError,
    naming them, for any other entry."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--out {directory} is a file: give a directory to write the checkpoint into")
    if not directory.exists():
        return {}
    recorded = _recorded(directory)
    ours = {name: digest for name, digest in recorded.items()
            if (directory / name).is_file() and digest in (None, _sha256(directory / name))}
    foreign = sorted(p.name for p in directory.iterdir() if p.name not in ours and (p.name != MANIFEST or not recorded))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"--out {directory} holds {shown}, which no jaxgpt export wrote (or which changed since): "
                         "move them away, or choose a new or empty directory; an export replaces only an earlier "
                         "export's files")
    return ours


def _recorded(directory: Path) -> dict[str, str | None]:
    """The files jaxgpt_export.json lists ({} when it is absent or does not parse)."""
    try:
        files = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(files, dict):
        return {}
    return {name: digest for name, digest in files.items() if Path(name).name == name and name != MANIFEST}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_export(out: Path, run_dir: str, step: int | None) -> tuple[list[str], list[str], str | None]:
    """(the files written, the earlier export's files removed, why no tokenizer was written)."""
    earlier = earlier_export(out)  # before anything is read or written
    params, config, tokenizer = load_run(run_dir, step=step)
    try:
        convert.check_gpt2_tokenizer(tokenizer, config)
        tokenizer_note = None
    except ValueError as err:
        tokenizer, tokenizer_note = None, str(err)
    convert.config_to_hf(config)  # a model GPT-2 cannot express: refused before anything is written
    written = [convert.CONFIG_FILE, convert.WEIGHTS_FILE] + ([convert.VOCAB_FILE, convert.MERGES_FILE]
                                                             if tokenizer else [])
    out.mkdir(parents=True, exist_ok=True)
    _record(out, run_dir, {**earlier, **dict.fromkeys(written)})  # an export cut short is still ours
    convert.save_hf_gpt2(out, config, params, tokenizer=tokenizer)
    stale = sorted(set(earlier) - set(written))
    for name in stale:
        (out / name).unlink()
    _record(out, run_dir, {name: _sha256(out / name) for name in written})
    return written, stale, tokenizer_note


def _record(out: Path, run_dir: str, files: dict[str, str | None]) -> None:
    write_json(out / MANIFEST, {"run_dir": str(Path(run_dir).absolute()), "files": files})


def main(argv=None) -> int:
    args = parse_args(argv)
    tidy_cli_output()
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's notes on opening checkpoints read-only
    try:
        written, stale, tokenizer_note = write_export(Path(args.out), args.run_dir, args.step)
    except (ValueError, OSError, CheckpointError) as err:
        print(f"export: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {', '.join(written)}")
    if stale:
        print(f"export: removed {', '.join(stale)} of the earlier export in {args.out}: they do not describe this "
              "model", file=sys.stderr)
    if tokenizer_note:
        print(f"export: note: wrote the weights without tokenizer files: {tokenizer_note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
