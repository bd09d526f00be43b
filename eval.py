"""Evaluate a model on text: python eval.py (--run_dir RUN | --hf_dir DIR) [--data SOURCE] [--split val|train|all].

Prints the loss (nats per token), perplexity = exp(loss) and bits per UTF-8 byte of a
training run (its best checkpoint, or --step) or a Hugging Face GPT-2 directory on a data
source as training reads it: a file, directory or glob, 'stdlib', or 'tfds:NAME[:SPLIT]',
tokenized with the model's own tokenizer. The windows are those of training's evaluation:
block_size tokens each, every target counted once, each window --stride tokens after the
last (default block_size; a smaller stride gives each target more context). A progress
bar goes to stderr and one JSON line to stdout. On a CPU the windows of each batch are split
over one device per core, as train.py runs (as many as divide the batch).

Splits: a run is evaluated by default on the validation split it held out while training
(its own data settings; with --data, the same fraction of that source held out the same
way). 'train' is the rest and 'all' the whole source. A Hugging Face model was trained on
none of it, so 'all' is its default; 'val' holds out --val_fraction (default 0.1) as a run
would. The work is done by jaxgpt.data and jaxgpt.train.evaluation.

Unknown tokens: text a character or word tokenizer has no token for becomes <|unk|>, which a
model learns to predict cheaply, so a loss over it flatters the model. "unknown_fraction" is
the share of <|unk|> among the split's targets (every token after the first; 0 for a
byte-level BPE, which has no <|unk|>). Above --max_unknown (default 1%) eval.py refuses.
--mask_unknown leaves <|unk|> targets out of the loss ("unknown_masked" says how many; they
still serve as inputs): the loss and perplexity are then over the known targets, and bits
per byte divide by the bytes of the text those targets stand for (each token's own UTF-8
bytes; a word tokenizer's spaces between words are not counted, which errs towards more
bits per byte), not by the split's average, which the unknown text would inflate.

Records (--records, a run trained on data.format='records'): the loss is over the completions,
as training's evaluation counts it, and each example of the split is answered: the prompt is
every token before its last completion, the model's greedy completion (up to <|eos|>, at most
--max_new_tokens, default the longest reference + 8) is compared with the reference: exact
match after stripping surrounding whitespace, and a SQuAD-style token F1 over lower-cased
whitespace-separated words (jaxgpt.score.completions). A line "records: N held-out, exact match …"
and then the JSON line go to stdout; each example's prompt, reference and prediction go to
--predictions (default RUN_DIR/predictions.jsonl), one JSON object per line.

Multiple choice (--choices FILE.jsonl): records {"context", "choices", "label"}, or HellaSwag's
{"ctx", "endings", "label"}. Each choice is scored as the continuation " " + choice of the
context, as the lm-evaluation-harness scores a multiple_choice task, and the harness's
accuracies are reported: acc (the most likely choice), acc_norm (log-likelihood divided by the
choice's length in characters) and acc_bytes (divided by its UTF-8 bytes). A line "choices: N
items, acc …" and then the JSON line go to stdout; each item's label, predictions and
log-likelihoods go to --predictions (default RUN_DIR/choices.jsonl). The work is done by
jaxgpt.score.choices.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from jaxgpt.errors import exit_without_a_last_collection, tidy_cli_output

SPLITS = ("val", "train", "all")
DEFAULT_BATCH_SIZE = 8
RECORDS_MARGIN = 8  # jaxgpt.score.completions.MARGIN_TOKENS (not imported here: --help stays fast)
SPLIT_WORDS = {"val": "held-out", "train": "training", "all": "in all"}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="eval.py", description=__doc__.split("\n\n")[1])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--run_dir", help="a training run's directory")
    model.add_argument("--hf_dir", help="a Hugging Face GPT-2 directory (config.json, model.safetensors, "
                                        "vocab.json, merges.txt)")
    parser.add_argument("--compilation_cache", default="auto",
                        help="where compiled programs are kept between runs, as train.py's compilation_cache: 'auto' "
                             "($JAX_COMPILATION_CACHE_DIR, else ~/.cache/jaxgpt/xla), a directory, or 'off'")
    parser.add_argument("--step", type=int, help="with --run_dir: the checkpoint step (default: the best by "
                                                 "validation loss)")
    parser.add_argument("--data", help="the text: a file, directory or glob, 'stdlib' or 'tfds:NAME[:SPLIT]' "
                                       "(default for a run: its own data)")
    parser.add_argument("--split", choices=SPLITS, help="which part of the data (default: val for a run, all for "
                                                        "a Hugging Face model)")
    parser.add_argument("--val_fraction", type=float, help="the fraction held out as 'val' (default: the run's, "
                                                           "else 0.1)")
    parser.add_argument("--stride", type=int, help="tokens between window starts, 1…block_size (default: the run's "
                                                   "eval stride, else block_size)")
    parser.add_argument("--block_size", type=int, help="evaluate with a shorter context than the model's")
    parser.add_argument("--batch_size", type=int, help=f"windows per batch (default: the run's eval batch size, "
                                                       f"else {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--max_batches", type=int, help="evaluate only the first N batches (default: all)")
    parser.add_argument("--cache_dir", help="where token files are cached (default: the run's, else jaxgpt's)")
    parser.add_argument("--max_unknown", type=float, default=0.01,
                        help="the largest share of <|unk|> targets accepted (default 0.01)")
    parser.add_argument("--mask_unknown", action="store_true",
                        help="leave <|unk|> targets out of the loss instead of refusing text with many")
    parser.add_argument("--calibration", action="store_true",
                        help="also measure calibration (ECE, Brier) and fit a temperature on the first half of the "
                             "targets, measured on the second; with --run_dir (or --out), write calibration.json (the "
                             "temperature sample.py --calibrated uses) and calibration.png")
    parser.add_argument("--bins", type=int, default=15, help="confidence bins for --calibration (default 15)")
    parser.add_argument("--out", help="with --calibration: the directory for calibration.json and calibration.png "
                                      "(default: the run directory)")
    parser.add_argument("--records", action="store_true",
                        help="with --run_dir of a records run: also answer each example of the split greedily and "
                             "report exact match and token F1 against its completion")
    parser.add_argument("--max_records", type=int, help="with --records: answer only the first N examples")
    parser.add_argument("--max_new_tokens", type=int, help="with --records: new tokens per answer at most (default: "
                                                           f"the longest reference + {RECORDS_MARGIN})")
    parser.add_argument("--predictions", help="with --records or --choices: the JSONL file of predictions (default "
                                              "RUN_DIR/predictions.jsonl, or RUN_DIR/choices.jsonl)")
    parser.add_argument("--choices", help="a JSONL file of multiple-choice items {context, choices, label} (or "
                                          "HellaSwag's ctx, endings, label): report acc, acc_norm and acc_bytes")
    return parser.parse_args(argv)


def check_args(args) -> None:
    """Impossible values and combinations, found before anything is loaded."""
    if args.bins < 1:
        raise ValueError(f"--bins must be a positive integer, got {args.bins}")
    check_calibration_out(args)
    check_choices_args(args)
    check_records_args(args)
    for name in ("step", "stride", "block_size", "batch_size", "max_batches"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "step" else 1):
            raise ValueError(f"--{name} must be a {'non-negative' if name == 'step' else 'positive'} integer, "
                             f"got {value}")
    if args.val_fraction is not None and not 0 <= args.val_fraction < 1:
        raise ValueError(f"--val_fraction must be in [0, 1), got {args.val_fraction}")
    if not 0 <= args.max_unknown <= 1:
        raise ValueError(f"--max_unknown must be in [0, 1], got {args.max_unknown}")
    if args.hf_dir is not None:
        if args.data is None and args.choices is None:
            raise ValueError("--hf_dir needs --data: the text to evaluate the model on")
        if args.step is not None:
            raise ValueError("--step chooses a run's checkpoint; a Hugging Face directory has one model: drop --step")


def calibration_dir(args) -> Path | None:
    """Where --calibration writes calibration.json and calibration.png: --out, else the run
    directory; None for a Hugging Face directory without --out."""
    directory = args.out or args.run_dir
    return Path(directory) if args.calibration and directory is not None else None


def check_calibration_out(args) -> None:
    """--out goes with --calibration, and the directory it writes in takes files: found before
    the evaluation, not after it."""
    from jaxgpt.files import writable_directory

    if args.out is not None and not args.calibration:
        raise ValueError("--out is where --calibration writes its files: add --calibration, or drop --out")
    if calibration_dir(args) is not None:
        writable_directory(calibration_dir(args), "pass --out DIR to write calibration.json and calibration.png "
                                                  "elsewhere")


def check_choices_args(args) -> None:
    """--choices scores its own items: the flags of text and records evaluation do not apply."""
    if args.choices is None:
        return
    given = ("data", "split", "val_fraction", "stride", "max_batches", "cache_dir")
    clashing = [f"--{name}" for name in given if getattr(args, name) is not None]
    clashing += [f"--{name}" for name in ("calibration", "records", "mask_unknown") if getattr(args, name)]
    if clashing:
        raise ValueError(f"--choices scores the items of its file: drop {', '.join(clashing)}")
    if args.hf_dir is not None and args.predictions is None:
        raise ValueError("--choices with --hf_dir needs --predictions FILE.jsonl: where to write each item's "
                         "predictions")
    if args.predictions is not None and not Path(args.predictions).resolve().parent.is_dir():
        raise ValueError(f"--predictions {args.predictions}: the directory {Path(args.predictions).parent} does not "
                         "exist; make it, or write the predictions elsewhere")


def check_records_args(args) -> None:
    """--records and the flags that go with it."""
    names = ("max_records", "max_new_tokens") + (("predictions",) if args.choices is None else ())
    alone = [f"--{name}" for name in names if getattr(args, name) is not None]
    if not args.records:
        if alone:
            raise ValueError(f"{', '.join(alone)} go with --records: add --records, or drop them")
        return
    if args.run_dir is None:
        raise ValueError("--records evaluates a records run's completions: give --run_dir (not --hf_dir)")
    if args.calibration or args.stride is not None:
        raise ValueError("--calibration and --stride measure text windows, not records: drop them, or --records")
    for name in ("max_records", "max_new_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if args.predictions is not None and not Path(args.predictions).resolve().parent.is_dir():
        raise ValueError(f"--predictions {args.predictions}: the directory {Path(args.predictions).parent} does not "
                         "exist; make it, or write the predictions elsewhere")


def load_model(args):
    """(params, config, tokenizer, the run's saved config or {}) of --run_dir or --hf_dir."""
    from jaxgpt import convert
    from jaxgpt.train import run

    if args.hf_dir is not None:
        params, config, tokenizer = convert.load_hf_run(args.hf_dir)
        return params, config, tokenizer, {}
    params, config, tokenizer = run.load_run(args.run_dir, step=args.step)
    return params, config, tokenizer, json.loads((Path(args.run_dir) / "config.json").read_text(encoding="utf-8"))


def eval_batch_size(args, saved: dict) -> int:
    """Windows (or rows of records) per batch: --batch_size, else the run's eval batch size."""
    return args.batch_size or saved.get("train", {}).get("eval_batch_size") or DEFAULT_BATCH_SIZE


def use_every_core(args) -> None:
    """Before JAX starts: on a CPU, one device per core that divides the eval batch, as train.py
    runs (jaxgpt.sharding.use_cpu_cores), so that the windows of a batch are evaluated on all cores
    at once. (--choices scores its items on one device.)"""
    from jaxgpt.sharding import ROWS_MESH, use_cpu_cores

    saved = {}
    if args.run_dir is not None:  # a missing or malformed config.json is load_model's to report
        with contextlib.suppress(OSError, ValueError):
            saved = json.loads((Path(args.run_dir) / "config.json").read_text(encoding="utf-8"))
    if args.choices is None:
        use_cpu_cores(ROWS_MESH, [eval_batch_size(args, saved if isinstance(saved, dict) else {})])


def over_devices(params, batch_size: int):
    """(a mesh of the devices that split a batch's rows, the params whole on each of them):
    the loss passes over a split run with the rows of each batch on all cores at once."""
    from jaxgpt import sharding

    mesh = sharding.rows_mesh(batch_size)
    return mesh, sharding.replicated(params, mesh)


def data_config(args, saved: dict, split: str) -> dict:
    """The data settings to prepare (with the model's own tokenizer): the run's own (if any),
    --data as the only source when given, and no held-out part for 'all'."""
    values = dict(saved.get("data", {}))
    if args.data is not None:
        values.update(source=args.data, val_source=None)
    elif "source" not in values:
        raise ValueError(f"{args.run_dir}/config.json records no data source: pass --data")
    if args.val_fraction is not None:
        values["val_fraction"] = args.val_fraction
    if split == "all":
        values.update(val_fraction=0.0, val_source=None)
    if args.cache_dir is not None:
        values["cache_dir"] = args.cache_dir
    return values


def check_unknown(args, tokens, tokenizer, where: str) -> tuple[float, float | None]:
    """(the share of <|unk|> targets, the bytes per counted target when they are masked, else
    None); a share above --max_unknown without --mask_unknown is an error."""
    from jaxgpt.train.evaluation import id_share, known_bytes_per_token

    share = id_share(tokens, tokenizer.unk_id)
    if share > args.max_unknown and not args.mask_unknown:
        raise ValueError(f"{share:.1%} of the tokens of {where} are <|unk|> (text the tokenizer cannot encode), so "
                         "the loss would mean little; pass --mask_unknown to leave them out of the loss, or "
                         "--max_unknown to accept them")
    if not (args.mask_unknown and share):
        return share, None
    if share == 1:
        raise ValueError(f"every token of {where} is <|unk|>: with --mask_unknown nothing is left to evaluate")
    return share, known_bytes_per_token(tokens, tokenizer)


def evaluate(args) -> dict:
    import jax
    from tqdm.auto import tqdm

    from jaxgpt import convert, data, sharding
    from jaxgpt.train.evaluation import evaluate_tokens

    if args.choices is not None:
        return evaluate_choices(args)
    params, config, tokenizer, saved = load_model(args)
    if args.block_size is not None:
        config, params = convert.crop_block_size(config, params, args.block_size)
    split = args.split or ("val" if args.run_dir is not None else "all")
    if args.records and saved.get("data", {}).get("format") != "records":
        raise ValueError(f"--records answers the examples of a records run, but {args.run_dir} trained on "
                         f"data.format={saved.get('data', {}).get('format', 'text')!r}: drop --records")
    corpus = data.prepare(data_config(args, saved, split), tokenizer=tokenizer)
    if args.records:
        return evaluate_records(args, params, config, tokenizer, corpus, saved, split)
    tokens = corpus.val if split == "val" else corpus.train
    source = args.data or corpus.meta["source"]
    if len(tokens) < 2:
        raise ValueError(f"the {split} split of {source!r} has {len(tokens)} token(s), too few to evaluate "
                         "(one input and one target): choose another --split, or raise --val_fraction for 'val'")
    stride = args.stride if args.stride is not None else saved.get("data", {}).get("eval_stride")
    batch_size = eval_batch_size(args, saved)
    unknown_fraction, known_bytes_per_token = check_unknown(
        args, tokens, tokenizer, repr(source) if split == "all" else f"the {split} split of {source!r}")
    bytes_per_token = known_bytes_per_token or corpus.bytes_per_token["val" if split == "val" else "train"]
    # Counting the batches first also checks stride and batch size before the bar is drawn.
    total = data.num_eval_batches(len(tokens), batch_size=batch_size, block_size=config.block_size, stride=stride)
    with tqdm(total=min(total, args.max_batches or total), unit="batch", desc="eval", file=sys.stderr,
              dynamic_ncols=True, mininterval=0.5) as bar:
        def on_batch(done: int, _total: int) -> None:
            bar.update(done - bar.n)

        mesh, spread = over_devices(params, batch_size)
        with jax.set_mesh(mesh):
            result = evaluate_tokens(config, spread, tokens, bytes_per_token, batch_size=batch_size, stride=stride,
                                     max_batches=args.max_batches, on_batch=on_batch,
                                     ignore_id=tokenizer.unk_id if args.mask_unknown else None,
                                     batch_sharding=sharding.batch_sharding(mesh))
    calibrated = calibrate(args, config, params, tokens, batch_size, stride) if args.calibration else {}
    return {
        **calibrated,
        "loss": result["val_loss"],
        "perplexity": result["val_ppl"],
        "bits_per_byte": result["val_bpb"],
        "tokens": result["val_tokens"],
        "unknown_fraction": unknown_fraction,
        "unknown_masked": result.get("val_ignored", 0),
        "model": args.run_dir or args.hf_dir,
        "data": source,
        "split": split,
        "block_size": config.block_size,
        "stride": stride or config.block_size,
    }


def evaluate_records(args, params, config, tokenizer, corpus, saved: dict, split: str) -> dict:
    """--records: the loss over the split's completions, then each example answered greedily
    and scored (jaxgpt.score.completions); the predictions file written and the summary line printed."""
    from jaxgpt.files import write_atomically

    examples = corpus.examples["val" if split == "val" else "train"]
    source = args.data or corpus.meta["source"]
    if not len(examples):
        raise ValueError(f"the {split} split of {source!r} holds no records: choose another --split, or raise "
                         "--val_fraction for 'val'")
    batch_size = eval_batch_size(args, saved)
    unknown_fraction, known_bytes_per_token = check_unknown(args, examples.tokens, tokenizer,
                                                            f"the {split} split of {source!r}")
    loss = records_loss(args, params, config, tokenizer, examples, saved.get("data", {}), batch_size,
                        known_bytes_per_token or corpus.bytes_per_token["val" if split == "val" else "train"])
    summary, rows = answer_records(args, params, config, tokenizer, examples, batch_size)
    path = Path(args.predictions) if args.predictions is not None else Path(args.run_dir) / "predictions.jsonl"
    write_atomically(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    skipped = f", {summary['skipped']} skipped (nothing before the completion)" if summary["skipped"] else ""
    print(f"records: {summary['records']} {SPLIT_WORDS[split]}, exact match {summary['exact_match']:.1%}, token F1 "
          f"{summary['token_f1']:.1%}, loss {loss['val_loss']:.4f}{skipped} (predictions in {path})")
    return {"loss": loss["val_loss"], "perplexity": loss["val_ppl"], "bits_per_byte": loss["val_bpb"],
            "tokens": loss["val_tokens"], "unknown_fraction": unknown_fraction,
            "unknown_masked": loss.get("val_ignored", 0), **summary, "predictions": str(path),
            "model": args.run_dir, "data": source, "split": split, "block_size": config.block_size}


def evaluate_choices(args) -> dict:
    """--choices: each item's choices scored (jaxgpt.score.choices), the summary line printed and the
    predictions file written."""
    from tqdm.auto import tqdm

    from jaxgpt import convert
    from jaxgpt.files import write_atomically
    from jaxgpt.model import GPT
    from jaxgpt.score import choices

    items = choices.read_items(args.choices)  # a bad file is found before the model is loaded
    params, config, tokenizer, _ = load_model(args)
    if args.block_size is not None:
        config, params = convert.crop_block_size(config, params, args.block_size)
    with tqdm(unit="batch", desc="choices", file=sys.stderr, dynamic_ncols=True, mininterval=0.5) as bar:
        def on_batch(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        scores, unknown = choices.score_items(GPT(config), params, tokenizer, items,
                                              batch_size=args.batch_size or DEFAULT_BATCH_SIZE, on_batch=on_batch)
    if unknown:
        print(f"eval.py: warning: {unknown}", file=sys.stderr)
    summary, rows = choices.accuracies(items, scores)
    path = Path(args.predictions) if args.predictions is not None else Path(args.run_dir) / "choices.jsonl"
    write_atomically(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"choices: {summary['items']} items, acc {summary['acc']:.1%}, acc_norm {summary['acc_norm']:.1%}, "
          f"acc_bytes {summary['acc_bytes']:.1%} (predictions in {path})")
    return {**summary, "predictions": str(path), "model": args.run_dir or args.hf_dir, "choices": args.choices,
            "block_size": config.block_size}


def records_loss(args, params, config, tokenizer, examples, data_section: dict, batch_size: int,
                 bytes_per_token: float) -> dict:
    """The loss over the completions of the examples, packed into rows as the run packed them."""
    import jax
    from tqdm.auto import tqdm

    from jaxgpt import data, sharding
    from jaxgpt.config import DataConfig
    from jaxgpt.train.evaluation import evaluate_examples

    records = DataConfig.from_mapping(data_section).records  # a run's saved data section, old or new
    layout = data.plan(examples, config.block_size, records.packing, records.truncate)
    total = data.num_eval_rows(layout, batch_size)
    mesh, spread = over_devices(params, batch_size)
    with tqdm(total=min(total, args.max_batches or total), unit="batch", desc="eval", file=sys.stderr,
              dynamic_ncols=True, mininterval=0.5) as bar, jax.set_mesh(mesh):
        return evaluate_examples(config, spread, examples, layout, bytes_per_token,
                                 batch_size=batch_size, max_batches=args.max_batches,
                                 on_batch=lambda done, _: bar.update(done - bar.n),
                                 ignore_id=tokenizer.unk_id if args.mask_unknown else None,
                                 batch_sharding=sharding.batch_sharding(mesh))


def answer_records(args, params, config, tokenizer, examples, batch_size: int) -> tuple[dict, list[dict]]:
    """Each example's greedy completion scored, with a progress bar."""
    from tqdm.auto import tqdm

    from jaxgpt.score.completions import evaluate_completions

    with tqdm(unit="batch", desc="answer", file=sys.stderr, dynamic_ncols=True, mininterval=0.5) as bar:
        def on_batch(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        return evaluate_completions(params, config, tokenizer, examples, batch_size=batch_size,
                                    max_new_tokens=args.max_new_tokens, max_records=args.max_records,
                                    on_batch=on_batch)


def calibrate(args, config, params, tokens, batch_size: int, stride) -> dict:
    """Calibration before and after temperature scaling: a table on stdout; with --run_dir or
    --out, calibration.json and calibration.png there (calibration_dir). Returns the JSON line's part."""
    from jaxgpt import viz
    from jaxgpt.analysis import calibration
    from jaxgpt.files import unwritable, write_json

    predictions = calibration.collect_predictions(config, params, tokens, batch_size=batch_size, stride=stride)
    report = calibration.calibration_report(predictions, bins=args.bins)
    print(calibration.format_report(report))
    out = calibration_dir(args)
    if out is not None:
        try:
            write_json(out / "calibration.json", report)
            viz.plot_reliability(report, out / "calibration.png", title=Path(args.run_dir or args.hf_dir).name)
        except OSError as error:
            raise unwritable(out, error, "pass --out DIR to write calibration.json and calibration.png elsewhere") \
                from None
    return {"temperature": report["temperature"], "ece_before": report["before"]["ece_width"],
            "ece_after": report["after"]["ece_width"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    tidy_cli_output()
    exit_without_a_last_collection()
    from absl import logging as absl_logging

    from jaxgpt.checkpoint import CheckpointError

    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's notes on opening checkpoints read-only
    try:
        check_args(args)
        from jaxgpt import programs
        from jaxgpt.sharding import use_compilation_cache

        use_every_core(args)
        use_compilation_cache(args.compilation_cache)  # a second evaluation loads its programs
        with programs.keeping():  # and its eval step, untraced
            result = evaluate(args)
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        print(f"eval.py: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
