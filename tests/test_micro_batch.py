"""The micro-batch per device (jaxgpt.train.micro_batch): worked examples of the choice computed by hand
from the docstrings' formulas, explicit sizes winning, the rows per step kept, presets without
rows_per_step left exactly as they were, and bad sizes refused in one line."""

import json
from pathlib import Path

import pytest

from jaxgpt.config import ComputeConfig, GPTConfig, TrainConfig, load_config
from jaxgpt.errors import ConfigError
from jaxgpt.model import param_count
from jaxgpt.train.micro_batch import (
    Plan,
    block_values,
    chunk_bytes,
    larger_note,
    plan,
    row_bytes,
    row_margin,
    state_bytes,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
GiB = 2**30
GPT2 = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, d_model=768)
FLASH = ComputeConfig(kernel="flash", dtype="bfloat16", param_dtype="float32")

# GPT-2 small by hand: per layer 12d² + 13d (QKV, the projection and the MLP with their biases, two
# LayerNorms), the token and position tables and the final LayerNorm
N = 12 * (12 * 768**2 + 13 * 768) + 50304 * 768 + 1024 * 768 + 2 * 768  # 124,475,904
STATE = N * (3 * 4 + 8)  # float32 parameters, two gradients, two AdamW moments (and a few step counts)
ROW = 1024 * (12 * 12 * 768 * 2 + 4 * 50304)  # 12 bf16 values of d per block and layer, float32 logits


def train(**values) -> TrainConfig:
    return TrainConfig(**values)


def test_the_estimates_are_the_docstrings_formulas():
    assert param_count(GPT2) == N == 124_475_904
    assert block_values(GPT2) == 12 * 768
    assert 0 <= state_bytes(GPT2, FLASH, TrainConfig()) - STATE < 64 and STATE == 2_489_518_080
    assert row_bytes(GPT2, FLASH) == ROW == 432_537_600
    # a kernel that forms the (T, T) weights keeps 2·H·T values a layer more per token; remat drops them
    explicit = FLASH.replace(kernel="explicit")
    assert row_bytes(GPT2, explicit) == ROW + 1024 * 12 * 2 * 12 * 1024 * 2
    assert row_bytes(GPT2, explicit.replace(remat=True)) == ROW
    # compute.loss_chunk: no row holds its 1024 × 50304 float32 logits, one chunk's (and their gradient) at a time,
    # and a chunk larger than the micro-batch's tokens is one chunk of them
    chunked = FLASH.replace(loss_chunk=2048)
    assert row_bytes(GPT2, chunked) == ROW - 1024 * 4 * 50304
    assert chunk_bytes(GPT2, chunked, 4096) == 2 * 4 * 2048 * 50304
    assert chunk_bytes(GPT2, chunked, 1024) == 2 * 4 * 1024 * 50304 and chunk_bytes(GPT2, FLASH, 4096) == 0


@pytest.mark.parametrize(("rows", "ways", "memory", "expected"), [
    # each row counted 2% larger: (16 GiB − STATE) / (1.02 · ROW) = 33.3: of 480/8 = 60's divisors, 30 fits;
    # of 512/8 = 64's, 32
    (480, 8, 16 * GiB, (240, 2)),
    (512, 8, 16 * GiB, (256, 2)),
    # v4-8: 4 chips of 32 GiB, (32 GiB − STATE)/(1.02 · ROW) = 72.2: of 128's divisors, 64
    (512, 4, 32 * GiB, (256, 2)),
    # one 80 GB GPU: (80e9 − STATE)/(1.02 · ROW) = 175.7: of 512's divisors, 128
    (512, 1, 80e9, (128, 4)),
    # room for 34 rows by row_bytes, but not for 34 rows counted 2% larger: of 34's divisors, 17
    (272, 8, STATE + 34 * ROW, (136, 2)),
    # not even one row: one row each, and the memory check says the rest
    (512, 8, 2 * GiB, (8, 64)),
])
def test_the_rows_per_device_are_the_largest_divisor_that_fits(rows, ways, memory, expected):
    choice = plan(train(rows_per_step=rows, batch_size=0, grad_accum=0), ways, STATE, ROW, memory)
    assert (choice.batch_size, choice.grad_accum) == expected
    assert choice.batch_size * choice.grad_accum == rows
    assert choice.why.startswith(f"train.batch_size={expected[0]} ({expected[0] // ways} rows on each of {ways} "
                                 f"devices) × train.grad_accum={expected[1]} = train.rows_per_step={rows}: ")


@pytest.mark.parametrize("ways", [1, 2, 4, 8, 16, 64])
@pytest.mark.parametrize("gib", [1, 16, 32, 95])
def test_the_rows_per_step_are_kept_on_any_slice(ways, gib):
    choice = plan(train(rows_per_step=512, batch_size=0, grad_accum=0), ways, STATE / ways, ROW, gib * GiB)
    assert choice.batch_size * choice.grad_accum == 512 and choice.batch_size % ways == 0


def test_an_explicit_batch_size_or_grad_accum_wins():
    rows = dict(rows_per_step=512)
    assert plan(train(**rows, batch_size=128, grad_accum=0), 8, STATE, ROW, 16 * GiB) == Plan(128, 4)
    assert plan(train(**rows, batch_size=0, grad_accum=4), 8, STATE, ROW, 16 * GiB) == Plan(128, 4)
    both = plan(train(**rows, batch_size=16, grad_accum=8), 8, STATE, ROW, 16 * GiB)
    assert (both.batch_size, both.grad_accum) == (16, 8)
    assert both.why == ("train.rows_per_step=512 is unused: train.batch_size=16 × train.grad_accum=8 makes 128 rows "
                        "a step")
    assert plan(train(**rows, batch_size=64, grad_accum=8), 8, STATE, ROW, 16 * GiB) == Plan(64, 8)  # agrees


def test_without_rows_per_step_nothing_changes():
    """The default job and the CPU presets set no rows_per_step: their batch_size and grad_accum as they are."""
    from jaxgpt import sharding
    from jaxgpt.train.micro_batch import resolved

    assert plan(train(batch_size=12, grad_accum=3), 8, STATE, ROW, 1.0) == Plan(12, 3)
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    for name in ("default", "shakespeare_char_cpu", "speedrun_cpu", "shakespeare_char", "experiment"):
        config = load_config(CONFIGS / f"{name}.py")
        assert config.train.rows_per_step == 0 and config.train.batch_size > 0
        assert resolved(config, mesh, GPT2, ComputeConfig()) is config


@pytest.mark.parametrize(("values", "message"), [
    (dict(batch_size=0),
     r"^train.batch_size=0 \(chosen to fit\) needs train.rows_per_step, .* or give train.batch_size$"),
    (dict(grad_accum=0), r"^train.grad_accum=0 \(chosen to fit\) needs train.rows_per_step"),
    (dict(rows_per_step=512, batch_size=48, grad_accum=0),
     r"^train.rows_per_step=512 is not a multiple of train.batch_size=48: choose a divisor of 512"),
    (dict(rows_per_step=512, batch_size=0, grad_accum=3),
     r"^train.rows_per_step=512 is not a multiple of train.grad_accum=3"),
    (dict(rows_per_step=-1), r"^train.rows_per_step=-1: must be an integer ≥ 0"),
    (dict(batch_size=-2), r"^train.batch_size=-2: must be a positive integer, or 0"),
])
def test_sizes_that_cannot_make_a_step_are_one_line(values, message):
    with pytest.raises(ConfigError, match=message):
        train(**values)


def test_rows_per_step_the_devices_do_not_divide_is_one_line():
    with pytest.raises(ConfigError, match=r"^train.rows_per_step=500 must be divisible by the 8 devices its rows are "
                                          r"split over \(the mesh's data × fsdp\): choose a multiple of 8"):
        plan(train(rows_per_step=500, batch_size=0, grad_accum=0), 8, STATE, ROW, 16 * GiB)


def test_rows_the_mesh_cannot_split_are_refused_before_the_data_is_read():
    """preflight.check_batch_sizes (run by check_sections, before the data): the rows a chosen
    micro-batch is made of must split over the mesh's data × fsdp."""
    from types import SimpleNamespace

    from jaxgpt.train.preflight import check_batch_sizes

    mesh = SimpleNamespace(shape={"data": 4, "fsdp": 2, "tensor": 1})
    with pytest.raises(ValueError, match=r"^train.rows_per_step=500 must be divisible by the mesh's data×fsdp size 8"):
        check_batch_sizes(train(rows_per_step=500, batch_size=0, grad_accum=0, eval_batch_size=8), mesh)
    with pytest.raises(ValueError, match=r"^train.rows_per_step / train.grad_accum=250 must be divisible by the mesh"):
        check_batch_sizes(train(rows_per_step=500, batch_size=0, grad_accum=2, eval_batch_size=8), mesh)
    check_batch_sizes(train(rows_per_step=512, batch_size=0, grad_accum=0, eval_batch_size=8), mesh)


def test_the_preset_takes_the_micro_batch_that_fits(capsys):
    """configs/gpt2_124m.py on this process's one CPU device with 32 GiB: the explicit kernel's
    weights counted, ROW + 12 layers × 2·12·1024 bf16 values a token = 1,036,517,376 B a row,
    which a CPU with the whole logits counts at 3 times its float32 bytes, 6 times bfloat16's
    (row_margin); (32 GiB − STATE)/(6 · that) = 5.1, and of 512's divisors 4 fits: 4 rows in 128
    micro-batches."""
    from jaxgpt import sharding
    from jaxgpt.train.micro_batch import resolved
    from jaxgpt.train.opening import compute_config, model_config

    config = load_config(CONFIGS / "gpt2_124m.py")
    config.train.memory_limit_gib = 32.0
    config.compute.loss_chunk = 0  # the whole logits: a row's float32 logits counted in it
    mesh, cfg, compute = sharding.make_mesh(config.mesh), model_config(config, 1), compute_config(config, "cpu")
    chosen = resolved(config, mesh, cfg, compute)
    assert (chosen.train.batch_size, chosen.train.grad_accum, chosen.train.rows_per_step) == (4, 128, 512)
    assert (config.train.batch_size, config.train.grad_accum) == (0, 0)  # the caller's config is left as it was
    err = capsys.readouterr().err
    assert err == ("jaxgpt: train.batch_size=4 (4 rows on each of 1 devices) × train.grad_accum=128 = "
                   "train.rows_per_step=512: the most rows per device that fit 32.0 GiB a device "
                   "(train.memory_limit_gib=32 over 1 devices), at about 2.32 GiB for the parameters, gradients and "
                   "optimizer state and 0.97 GiB a row (counted 6 times); set train.batch_size or "
                   "train.grad_accum to choose\n")
    config.train.batch_size = 64  # explicit: the accumulation follows, nothing said
    chosen = resolved(config, mesh, cfg, compute)
    assert (chosen.train.batch_size, chosen.train.grad_accum) == (64, 8) and capsys.readouterr().err == ""


def test_a_gpu_counts_a_row_at_its_margin_so_gpt2_takes_64_rows_on_an_h100():
    """GPT-2 small with the loss in chunks of 4096 on one H100 (56.48 GiB for XLA, as the device
    reported): a row is 1024 · 12 · 12d bf16 bytes = 0.211 GiB, the state 2.32 GiB and a chunk's
    logits and gradient 8 · 4096 · 50304 bytes = 1.54 GiB. At a TPU's 1.02 a row, 128 rows need
    3.86 + 128 · 0.215 = 31.4 GiB (they asked the GPU for 95.8); at a GPU's 2.2, 3.86 + 128 · 0.464
    = 63.3 does not fit and 64 rows (33.6) do."""
    chunked = FLASH.replace(kernel="cudnn", loss_chunk=4096)
    row, state = 1024 * 12 * 12 * 768 * 2, STATE + 8 * 4096 * 50304
    assert row_bytes(GPT2, chunked) == row and chunk_bytes(GPT2, chunked, 128 * 1024) == 8 * 4096 * 50304
    h100 = 56.48 * GiB
    assert row_margin("gpu") == 2.2 and row_margin("tpu") == 1.02 and row_margin("cpu", chunked) == 1.85 * 2
    preset = train(rows_per_step=512, batch_size=0, grad_accum=0)
    assert plan(preset, 1, state, row, h100, margin=row_margin("tpu")).batch_size == 128
    on_gpu = plan(preset, 1, state, row, h100, margin=row_margin("gpu"))
    assert (on_gpu.batch_size, on_gpu.grad_accum) == (64, 8)
    # jaxgpt.compile's note scales its own figures alike: 64 rows at 25.69 GiB (a deviceless H100 compile)
    figures = {"parameters": 0.464 * GiB, "optimizer_state": 0.927 * GiB, "total": 25.69 * GiB, "tokens": 524_288}
    result = {"programs": {"train step": figures}, "chip_figures": {"hbm": 59.7 * GiB},
              "mesh": {"data": 1, "fsdp": 1, "tensor": 1}}
    assert larger_note({**result, "platform": "tpu"}, 8, 1024).startswith("128 rows per device would fit")  # 49.1
    assert larger_note({**result, "platform": "gpu"}, 8, 1024) is None  # 2.32 + 2 · 23.37 · 2.2/1.02 = 103


def test_the_compile_says_when_a_larger_micro_batch_would_fit():
    """gpt2_124m as shipped before rows_per_step, compiled for v5e:2x4 (16 rows in 32 micro-batches,
    2 per chip): XLA's peak 3.148 GiB with 0.464 GiB of parameters and 0.927 of AdamW state. The
    state with two gradients is 0.464 · 3 + 0.927 = 2.319 GiB, a row (3.148 − 2.319)/2 = 0.4145;
    16 times the rows is 2.319 + 32 · 0.4145 = 15.58 GiB ≤ 16: 32 rows per chip, 2 micro-batches."""
    figures = {"parameters": 0.464 * GiB, "optimizer_state": 0.927 * GiB, "total": 3.148 * GiB, "tokens": 524_288}
    result = {"programs": {"train step": figures}, "chip_figures": {"hbm": 16 * GiB},
              "mesh": {"data": 8, "fsdp": 1, "tensor": 1}}
    assert larger_note(result, 32, 1024) == (
        "32 rows per device would fit too (about 15.6 GiB of the 16.0 by this compile's figures): the same rows a "
        "step in fewer micro-batches, --config.train.batch_size=256 --config.train.grad_accum=2")
    assert larger_note(result, 1, 1024) is None  # no accumulation to trade
    figures["total"] = 9.0 * GiB  # a row (9 − 2.319)/2 = 3.34 GiB: twice the rows would need 15.7 GiB, four 29
    assert larger_note({**result, "programs": {"train step": {**figures, "tokens": 524_288}}}, 32, 1024).startswith(
        "4 rows per device")
    assert larger_note({**result, "chip_figures": None}, 32, 1024) is None


def test_a_run_opens_with_the_micro_batch_it_chose_and_records_it(tmp_path):
    """A tiny run of 8 rows a step whose memory holds the state and 3 rows (by the module's own
    estimates, a row at a CPU's margin: what is tested here is that the run takes the choice, with
    the vocabulary its data makes): 2 rows in 4 micro-batches, in the run's train settings and its
    config.json."""
    from jaxgpt import tokenizers
    from jaxgpt.train.opening import model_config, open_run
    from tests.runs import tiny_config, write_corpus

    corpus = write_corpus(tmp_path / "corpus.txt")
    config = tiny_config(tmp_path, corpus, **{"train.rows_per_step": 8, "train.batch_size": 0, "train.grad_accum": 0})
    vocab = tokenizers.train_tokenizer("char", [corpus.read_text()]).vocab_size
    cfg, compute = model_config(config, vocab), ComputeConfig()
    state = state_bytes(cfg, compute, TrainConfig.from_mapping(config.train))
    config.train.memory_limit_gib = (state + 3 * row_margin("cpu", compute) * row_bytes(cfg, compute)) / GiB
    run = open_run(config)
    run.checkpoints.close()
    run.lock.release()
    assert (run.train.batch_size, run.train.grad_accum, run.model.vocab_size) == (2, 4, vocab)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert (saved["batch_size"], saved["grad_accum"], saved["rows_per_step"]) == (2, 4, 8)
