"""eval.py: loss, perplexity and bits per byte of a run or a Hugging Face GPT-2 on text, checked
against a float64 evaluation of every target from the context its window gives it; and a
one-line error for each bad input."""

import json
import math
import re
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import reference as ref
from runs import write_run
from scripts import load_script
from test_model import random_params

from jaxgpt import GPTConfig, convert, tokenizers

ROOT = Path(__file__).resolve().parent.parent
TEXT = "".join(f"Line {i}: the king speaks to the queen, and the lord answers {i * 7 % 13}.\n" for i in range(24))
VAL_FRACTION = 0.2
BLOCK = 16
BATCH = 4


@pytest.fixture(scope="module")
def cli():
    return load_script("eval.py")


def tiny(vocab_size):
    return GPTConfig(vocab_size=vocab_size, block_size=BLOCK, n_layer=2, n_head=2, d_model=16)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    """A char-level run directory as training writes it, whose data is `corpus` with its last
    fifth held out: (directory, config, params, tokenizer)."""
    path = tmp_path_factory.mktemp("eval") / "run"
    tokenizer = tokenizers.train_tokenizer("char", [TEXT])
    cfg = tiny(tokenizer.vocab_size)
    params = random_params(cfg)
    data = {"source": str(corpus), "tokenizer": "char", "val_fraction": VAL_FRACTION,
            "cache_dir": str(path.parent / "cache"), "eval_stride": None}
    write_run(path, cfg, tokenizer, step=2, params=params, data=data, train={"eval_batch_size": BATCH})
    return path, cfg, params, tokenizer


def evaluate(cli, capsys, *args):
    status = cli.main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return status, out, err


def result_of(cli, capsys, *args):
    status, out, err = evaluate(cli, capsys, *args)
    assert status == 0, err
    lines = out.splitlines()
    assert len(lines) == 1, out  # one JSON line on stdout; the progress bar is on stderr
    assert "eval" in err and "batch" in err
    return json.loads(lines[0])


def reference_loss(cfg, params, tokens, stride, skip_id=None):
    """Mean −log p(t_j | context) over every target j = 1…n−1 (but those equal to `skip_id`)
    in float64, each predicted from the longest context the windows give it: window w holds
    tokens w·stride … w·stride + T − 1, and target j is counted in window 0 when j ≤ T, else
    in window ⌈(j − T)/stride⌉."""
    T, n = cfg.block_size, len(tokens)
    targets_of = defaultdict(list)
    for j in range(1, n):
        if tokens[j] != skip_id:
            targets_of[0 if j <= T else -(-(j - T) // stride)].append(j)
    total = 0.0
    for w, targets in targets_of.items():
        start = w * stride
        logits = ref.gpt_forward(cfg, params, np.asarray(tokens[start:start + T])[None])[0]
        top = logits.max(-1, keepdims=True)
        log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        total -= sum(log_probs[j - start - 1, tokens[j]] for j in targets)
    return total / sum(map(len, targets_of.values()))


def val_tokens(tokenizer):
    """The held-out tail of the single-document corpus, tokenized."""
    cut = len(TEXT) - round(len(TEXT) * VAL_FRACTION)
    return TEXT[cut:], tokenizer.encode(TEXT[cut:])


def test_a_run_is_evaluated_on_its_validation_split(cli, capsys, run):
    path, cfg, params, tokenizer = run
    result = result_of(cli, capsys, "--run_dir", path)
    text, tokens = val_tokens(tokenizer)
    assert result["tokens"] == len(tokens) - 1
    assert result["loss"] == pytest.approx(reference_loss(cfg, params, tokens, BLOCK), rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-9)
    bytes_per_token = len(text.encode("utf-8")) / len(tokens)
    assert result["bits_per_byte"] == pytest.approx(result["loss"] / (math.log(2) * bytes_per_token), rel=1e-9)
    assert (result["split"], result["block_size"], result["stride"]) == ("val", BLOCK, BLOCK)
    assert (result["unknown_fraction"], result["unknown_masked"]) == (0, 0)  # in-domain text


def test_stride_context_and_batches(cli, capsys, run):
    path, cfg, params, tokenizer = run
    _, tokens = val_tokens(tokenizer)
    strided = result_of(cli, capsys, "--run_dir", path, "--stride", 5)
    assert strided["tokens"] == len(tokens) - 1 and strided["stride"] == 5
    assert strided["loss"] == pytest.approx(reference_loss(cfg, params, tokens, 5), rel=1e-5)

    short = result_of(cli, capsys, "--run_dir", path, "--block_size", 8)
    assert short["block_size"] == 8
    assert short["loss"] == pytest.approx(reference_loss(cfg.replace(block_size=8), params, tokens, 8), rel=1e-5)

    first = result_of(cli, capsys, "--run_dir", path, "--max_batches", 1)
    assert first["tokens"] == BATCH * BLOCK  # the first batch's windows, each counting BLOCK new targets


def test_a_hugging_face_model_is_evaluated_on_the_whole_file(cli, capsys, tmp_path, corpus):
    bpe = tokenizers.train_tokenizer("bpe", [TEXT], vocab_size=300)
    cfg = tiny(bpe.vocab_size)
    params = random_params(cfg)
    convert.save_hf_gpt2(tmp_path / "gpt2", cfg, params, tokenizer=bpe)
    result = result_of(cli, capsys, "--hf_dir", tmp_path / "gpt2", "--data", corpus, "--cache_dir", tmp_path / "cache")
    tokens = bpe.encode(TEXT)
    assert (result["split"], result["tokens"]) == ("all", len(tokens) - 1)
    assert result["loss"] == pytest.approx(reference_loss(cfg, params, tokens, BLOCK), rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-9)
    assert result["bits_per_byte"] == pytest.approx(
        result["loss"] * len(tokens) / (math.log(2) * len(TEXT.encode("utf-8"))), rel=1e-9)
    assert result["unknown_fraction"] == 0  # a byte-level BPE has no <|unk|>

    held_out = result_of(cli, capsys, "--hf_dir", tmp_path / "gpt2", "--data", corpus, "--cache_dir",
                         tmp_path / "cache", "--split", "val", "--val_fraction", 0.5)
    tail = TEXT[len(TEXT) - round(len(TEXT) * 0.5):]
    assert held_out["tokens"] == len(bpe.encode(tail)) - 1


# Japanese among known characters: a char model trained on TEXT has no token for the kana and kanji.
FOREIGN = "".join(f"王{i}は女王に話す。the king, {i}: ここ.\n" for i in range(6))


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """(path, its unknown targets, its known targets and their UTF-8 bytes), counted from the
    characters: every character of FOREIGN after the first is a target."""
    path = tmp_path_factory.mktemp("foreign") / "japanese.txt"
    path.write_text(FOREIGN, encoding="utf-8")
    known = [ch for ch in FOREIGN[1:] if ch in TEXT]
    return path, len(FOREIGN) - 1 - len(known), len(known), len("".join(known).encode("utf-8"))


def test_text_the_tokenizer_cannot_encode_is_refused_in_one_line(cli, capsys, run, foreign):
    path, unknown, known, _ = foreign
    status, out, err = evaluate(cli, capsys, "--run_dir", run[0], "--data", path, "--split", "all")
    share = unknown / (unknown + known)
    assert share > 0.3 and status == 2 and out == ""
    assert err == (f"eval.py: error: {share:.1%} of the tokens of {str(path)!r} are <|unk|> (text the tokenizer cannot "
                   "encode), so the loss would mean little; pass --mask_unknown to leave them out of the loss, or "
                   "--max_unknown to accept them\n")


def test_unknown_targets_can_be_masked_out_of_the_loss(cli, capsys, run, foreign):
    path, unknown, known, known_bytes = foreign
    _, cfg, params, tokenizer = run
    result = result_of(cli, capsys, "--run_dir", run[0], "--data", path, "--split", "all", "--mask_unknown")
    assert result["unknown_fraction"] == pytest.approx(unknown / (unknown + known), rel=1e-12)
    assert (result["unknown_masked"], result["tokens"]) == (unknown, known)
    tokens = tokenizer.encode(FOREIGN)
    assert result["loss"] == pytest.approx(reference_loss(cfg, params, tokens, BLOCK, skip_id=tokenizer.unk_id),
                                           rel=1e-5)
    assert result["loss"] != pytest.approx(reference_loss(cfg, params, tokens, BLOCK), rel=1e-3)
    # Bits per byte of the text the counted targets stand for, not of the unknown text too.
    assert result["bits_per_byte"] == pytest.approx(result["loss"] * known / (math.log(2) * known_bytes), rel=1e-9)


def test_a_raised_threshold_accepts_unknown_targets_in_the_loss(cli, capsys, run, foreign):
    path, unknown, known, _ = foreign
    _, cfg, params, tokenizer = run
    result = result_of(cli, capsys, "--run_dir", run[0], "--data", path, "--split", "all", "--max_unknown", 1)
    assert result["unknown_fraction"] == pytest.approx(unknown / (unknown + known), rel=1e-12)
    assert (result["unknown_masked"], result["tokens"]) == (0, unknown + known)
    assert result["loss"] == pytest.approx(reference_loss(cfg, params, tokenizer.encode(FOREIGN), BLOCK), rel=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--hf_dir", "{hf}"], "--hf_dir needs --data: the text to evaluate the model on"),
    (["--run_dir", "{run}", "--stride", "0"], "--stride must be a positive integer, got 0"),
    (["--run_dir", "{run}", "--stride", "17"], "eval stride 17 must be an integer in 1…block_size=16"),
    (["--run_dir", "{run}", "--block_size", "32"], "block_size=32: must be an integer in 1…16"),
    (["--run_dir", "{run}", "--val_fraction", "1.5"], r"--val_fraction must be in \[0, 1\), got 1.5"),
    (["--run_dir", "{run}", "--max_unknown", "-0.1"], r"--max_unknown must be in \[0, 1\], got -0.1"),
    (["--run_dir", "{run}/missing"], "run directory .*missing does not exist"),
    (["--run_dir", "{run}", "--data", "{run}/no-such-text.txt"], "data source .*no-such-text.txt' does not exist"),
    (["--run_dir", "{run}", "--val_fraction", "0"], "the val split of .* has 0 token\\(s\\), too few to evaluate"),
    (["--hf_dir", "{run}", "--data", "x"], "config.json has no model_type, so it is not the config of a Hugging Face"),
])
def test_bad_input_is_a_one_line_error(cli, capsys, run, args, message):
    path = run[0]
    status, out, err = evaluate(cli, capsys, *(a.format(run=path, hf=path) for a in args))
    assert status == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eval.py: error: "), err
    assert re.search(message, lines[0]), lines[0]


def test_a_run_that_records_no_data_needs_data(cli, capsys, run, tmp_path):
    path = tmp_path / "run"
    shutil.copytree(run[0], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({"model": config["model"]}))
    status, _, err = evaluate(cli, capsys, "--run_dir", path)
    assert status == 2 and err.strip() == f"eval.py: error: {path}/config.json records no data source: pass --data"


def test_a_model_is_required(cli, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--data", "x"])
    assert exit_.value.code == 2
    assert "one of the arguments --run_dir --hf_dir is required" in capsys.readouterr().err


def test_calibration_table_files_and_calibrated_sampling(cli, capsys, run):
    from jaxgpt.analysis import calibration

    path, cfg, params, tokenizer = run
    status = cli.main(["--run_dir", str(path), "--calibration", "--bins", "5"])
    out, err = capsys.readouterr()
    assert status == 0, err
    *table, line = out.strip().splitlines()
    line = json.loads(line)
    assert table[0].startswith("calibration over") and table[2].startswith("before (T=1.000)")
    saved = json.loads((path / "calibration.json").read_text())
    assert saved["temperature"] == pytest.approx(line["temperature"]) and saved["temperature"] > 0
    tokens = np.asarray(val_tokens(tokenizer)[1])
    predictions = calibration.collect_predictions(cfg, params, tokens, batch_size=BATCH)
    fit = calibration.split(predictions)[0]  # the first half of the targets fits T, the rest judges it
    assert saved["temperature"] == pytest.approx(calibration.fit_temperature(fit), rel=1e-6)
    assert (path / "calibration.png").stat().st_size > 1000
    sample = load_script("sample.py")
    assert sample.main(["--run_dir", str(path), "--prompt", "t", "--max_new_tokens", "5", "--calibrated"]) == 0
    capsys.readouterr()
    (path / "calibration.json").unlink()
    assert sample.main(["--run_dir", str(path), "--prompt", "t", "--calibrated"]) == 2
    assert "run eval.py --run_dir" in capsys.readouterr().err


def refuse_writes_in(monkeypatch, directory: Path) -> None:
    """Make `directory` take no new files, as a read-only one would (root writes whatever the
    permissions say, so the file system's answer is imitated)."""
    import errno
    import tempfile

    from jaxgpt import files

    original = tempfile.TemporaryFile

    def temporary_file(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).resolve() == directory.resolve():
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return original(*args, dir=dir, **kwargs)

    monkeypatch.setattr(files.tempfile, "TemporaryFile", temporary_file)


def test_calibration_of_a_read_only_run_says_where_to_write_instead(cli, capsys, run, tmp_path, monkeypatch):
    path = run[0]
    refuse_writes_in(monkeypatch, path)
    status, out, err = evaluate(cli, capsys, "--run_dir", path, "--calibration")
    assert status == 2 and not out  # refused before the evaluation (no progress bar), not after it
    assert err.strip() == f"eval.py: error: cannot write in {path} (Permission denied): pass --out DIR to write " \
                          "calibration.json and calibration.png elsewhere"
    (tmp_path / "file").write_text("")
    status, _, err = evaluate(cli, capsys, "--run_dir", path, "--calibration", "--out", tmp_path / "file")
    assert status == 2 and f"cannot write in {tmp_path / 'file'} (a file, not a directory): pass --out DIR" in err
    status, out, err = evaluate(cli, capsys, "--run_dir", path, "--calibration", "--out", tmp_path / "elsewhere")
    assert status == 0, err
    result = json.loads(out.splitlines()[-1])
    saved = json.loads((tmp_path / "elsewhere" / "calibration.json").read_text())
    assert saved["temperature"] == result["temperature"] and (tmp_path / "elsewhere" / "calibration.png").exists()
    status, _, err = evaluate(cli, capsys, "--run_dir", path, "--out", tmp_path)
    assert status == 2 and "--out is where --calibration writes its files" in err
