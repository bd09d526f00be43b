"""Records (jaxgpt.data.records, examples, packing): templates and presets, file formats,
the loss mask in the cache, packing and its batches, bad input, and whole records runs
(resume, init_from a run directory)."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from jaxgpt import data
from jaxgpt.config import DataConfig, RecordsConfig, default_config
from jaxgpt.data import packing, records
from jaxgpt.errors import DataError

TESTS = Path(__file__).resolve().parent


def forms(**settings):
    return records.templates(RecordsConfig(**settings))


def record(fields, where="r.jsonl:1"):
    return records.Record(fields, 0, 1, where)


# --- templates and presets: worked examples --------------------------------------------------------


def test_qa_preset_with_and_without_context():
    qa = forms(template="qa")
    assert records.example_turns(record({"question": "2+2", "answer": "4"}), qa) == [("Question: 2+2\nAnswer: ", "4")]
    with_context = {"context": "Sums.", "question": "2+2", "answer": "4"}
    assert records.example_turns(record(with_context), qa) == [("Context: Sums.\nQuestion: 2+2\nAnswer: ", "4")]


def test_alpaca_preset_leaves_out_an_empty_input():
    alpaca = forms(template="alpaca")
    full = {"instruction": "Add.", "input": "2 and 3", "output": "5"}
    assert records.example_turns(record(full), alpaca) == [
        ("### Instruction:\nAdd.\n\n### Input:\n2 and 3\n\n### Response:\n", "5")]
    for empty in ({"instruction": "Greet.", "input": "", "output": "Hi"}, {"instruction": "Greet.", "output": "Hi"}):
        assert records.example_turns(record(empty), alpaca) == [("### Instruction:\nGreet.\n\n### Response:\n", "Hi")]


def test_prompt_completion_preset_and_own_templates_with_nested_keys():
    pc = forms(template="prompt_completion")
    assert records.example_turns(record({"prompt": "a", "completion": "b"}), pc) == [("a", "b")]
    own = forms(prompt_template="Q: {q.text} ({meta.tags.1}) {{x}}\nA: ", completion_template="{answers.0.text}")
    fields = {"q": {"text": "why"}, "meta": {"tags": ["x", "y"]}, "answers": [{"text": "because"}]}
    assert records.example_turns(record(fields), own) == [("Q: why (y) {x}\nA: ", "because")]
    numbers = forms(prompt_template="{a}+{b}=", completion_template="{c}")
    assert records.example_turns(record({"a": 2, "b": 3.5, "c": True}), numbers) == [("2+3.5=", "true")]


def test_chat_preset_makes_every_assistant_turn_a_completion():
    chat = forms(template="chat")
    fields = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
                           {"role": "assistant", "content": "Bye."}, {"role": "user", "content": "ignored"}]}
    assert records.example_turns(record(fields), chat) == [
        ("System: Be brief.\nUser: Hi\nAssistant: ", "Hello."), ("User: Bye\nAssistant: ", "Bye.")]


def test_encoded_example_masks_exactly_the_completions_and_their_eos():
    from jaxgpt import tokenizers

    tokenizer = tokenizers.train_tokenizer("char", ["abcdef: \n"])
    ids, mask = data.encode_turns([("ab: ", "cd"), ("\ne: ", "f")], tokenizer)
    eos = tokenizer.eos_id
    assert ids.tolist() == tokenizer.encode("ab: cd") + [eos] + tokenizer.encode("\ne: f") + [eos]
    assert mask.tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]


# --- file formats ------------------------------------------------------------------------------------


def test_csv_tsv_json_array_and_json_table_give_the_same_records(tmp_path):
    rows = [{"question": "1+1", "answer": "2"}, {"question": "say \"a, b\"", "answer": "a, b"}]
    (tmp_path / "r.csv").write_text('question,answer\n1+1,2\n"say ""a, b""","a, b"\n')
    (tmp_path / "r.tsv").write_text('question\tanswer\n1+1\t2\nsay "a, b"\ta, b\n')
    (tmp_path / "r.json").write_text(json.dumps(rows))
    (tmp_path / "t.json").write_text(json.dumps({"columns": ["question", "answer"],
                                                 "rows": [[r["question"], r["answer"]] for r in rows]}))
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n\n" for r in rows))
    for name in ("r.csv", "r.tsv", "r.json", "t.json", "r.jsonl"):
        got = [dict(r.fields) for r in records.read_records([tmp_path / name])]
        assert got == rows, name
    where = [r.where for r in records.read_records([tmp_path / "r.jsonl"])]
    assert where == [f"{tmp_path / 'r.jsonl'}:1", f"{tmp_path / 'r.jsonl'}:3"]


# --- bad input: one line naming file and line, the cache untouched ----------------------------------


def prepare_records(tmp_path, text, name="r.jsonl", templates=None, **settings):
    path = tmp_path / name
    path.write_text(text)
    cfg = default_config().data
    cfg.update({"source": str(path), "format": "records", "tokenizer": "char", "cache_dir": str(tmp_path / "cache"),
                **settings})
    cfg.records.update({"template": "qa", **(templates or {})})
    return data.prepare(cfg)


GOOD = '{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": "4"}\n{"question": "3+3", "answer": "6"}\n'


@pytest.mark.parametrize("text, name, templates, message", [
    ('{"question": "1+1", "answer": "2"}\n{"question": "2+2"}\n', "r.jsonl", {},
     r"r.jsonl:2 has no field 'answer', which the template needs"),
    ('{"question": "1+1", "answer": "2"}\n', "r.jsonl", {"template": None, "prompt_template": "{questoin}",
                                                         "completion_template": "{answer}"},
     r"names the field 'questoin', which the records do not have .*did you mean \{question\}"),
    ('{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": "4"\n', "r.jsonl", {},
     r"r.jsonl:2 is not valid JSON"),
    ("question,answer\n1+1,2\n2+2,4,extra\n", "r.csv", {}, r"r.csv:3 has 3 columns, the header has 2"),
    ('{"question": "1+1", "answer": ""}\n', "r.jsonl", {}, r"r.jsonl:1 has an empty completion"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', "r.jsonl", {"template": "chat"},
     r"r.jsonl:1 is a chat without an assistant turn"),
    ("some text\n", "r.txt", {}, r"r.txt is not a records file"),
    (GOOD, "r.jsonl", {"template": "nope"}, r"data.records.template='nope' is not a preset"),
    (GOOD, "r.jsonl", {"template": None}, r"data.format='records' needs data.records.template"),
])
def test_bad_records_are_one_line_errors_and_leave_no_cache(tmp_path, text, name, templates, message):
    with pytest.raises(DataError, match=message) as error:
        prepare_records(tmp_path, text, name, templates)
    assert "\n" not in str(error.value)
    assert not list((tmp_path / "cache").glob("*/meta.json"))  # no corpus was published
    assert not list((tmp_path / "cache").glob(".*.partial"))  # and no partial one left behind


@pytest.mark.parametrize("key, value", [("format", "table"), ("records.loss_on", "prompt"),
                                        ("records.truncate", "drop"), ("records.packing", "bins")])
def test_unknown_setting_values_are_one_line_errors(key, value):
    section, _, name = key.rpartition(".")
    with pytest.raises(DataError, match=f"data.{key}={value!r}: must be"):
        DataConfig.from_mapping({section: {name: value}} if section else {key: value})


def test_records_that_are_not_utf8_are_read_with_one_warning_naming_the_file_and_the_count(tmp_path):
    path = tmp_path / "latin.jsonl"
    lines = ['{"prompt": "caf\xe9 ", "completion": "cr\xe8me br\xfbl\xe9e"}',
             '{"prompt": "na\xefve ", "completion": "ok"}']
    path.write_bytes("\n".join(lines).encode("latin-1"))  # 5 bytes that UTF-8 cannot decode, one per accent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read = list(records.read_records([path]))
    assert [r.fields["completion"] for r in read] == ["cr\ufffdme br\ufffdl\ufffde", "ok"]
    (warning,) = caught
    assert f"{path} is not UTF-8: 5 undecodable byte sequence(s)" in str(warning.message)


# --- the cache and packing ------------------------------------------------------------------------------


def addition_corpus(tmp_path, count=40, **settings):
    cfg = default_config().data
    cfg.update(source=f"generated:addition:{count}", format="records", tokenizer="char",
               cache_dir=str(tmp_path / "cache"), val_fraction=0.1, **settings)
    cfg.records.template = "qa"
    return data.prepare(cfg)


def test_cache_holds_each_example_with_its_completion_mask(tmp_path):
    corpus = addition_corpus(tmp_path)
    examples, tokenizer = corpus.examples["train"], corpus.tokenizer
    assert len(examples) == 36 and len(corpus.examples["val"]) == 4
    source = [json.loads(line) for line in Path(examples.files[0]).read_text().splitlines()]
    for i in range(len(examples)):
        tokens, mask = examples.example(i)
        number = int(examples.origins[i][1])
        expected = source[number - 1]
        assert tokenizer.decode(tokens[mask == 0].tolist()) == f"Question: {expected['question']}\nAnswer: "
        assert tokens[mask == 1].tolist() == tokenizer.encode(expected["answer"]) + [tokenizer.eos_id]
    again = addition_corpus(tmp_path)  # reused, checked against its checksums
    assert again.directory == corpus.directory


def test_a_damaged_mask_file_is_rebuilt(tmp_path):
    corpus = addition_corpus(tmp_path)
    path = corpus.directory / "train.mask.bin"
    raw = bytearray(path.read_bytes())
    raw[5] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="train.mask.bin does not match its checksum"):
        rebuilt = addition_corpus(tmp_path)
    assert rebuilt.examples["train"].mask.tolist() == corpus.examples["train"].mask.tolist()


def test_packing_places_every_example_once_within_the_block(tmp_path):
    examples = addition_corpus(tmp_path, count=200).examples["train"]
    for mode in ("pack", "pad"):
        layout = packing.plan(examples, 64, mode)
        assert sorted(layout.members.tolist()) == list(range(len(examples)))
        for r in range(layout.rows):
            members = layout.members[layout.row_starts[r]:layout.row_starts[r + 1]]
            assert (layout.kept[members] - 1).sum() <= 64
            assert mode == "pack" or len(members) == 1
    packed, padded = packing.plan(examples, 64, "pack"), packing.plan(examples, 64, "pad")
    assert packed.padding < 0.10 < padded.padding
    assert packed.rows < padded.rows


def test_packed_batches_are_a_pure_function_of_seed_and_step_and_visit_every_row_each_epoch(tmp_path):
    examples = addition_corpus(tmp_path, count=200).examples["train"]
    layout = packing.plan(examples, 64)
    full = packing.packed_batch(examples, layout, seed=3, step=2, batch_size=6)
    parts = [packing.packed_batch(examples, layout, seed=3, step=2, batch_size=6, rows=(a, b))
             for a, b in ((0, 2), (2, 5), (5, 6))]
    for whole, *pieces in zip(full, *parts, strict=True):
        np.testing.assert_array_equal(whole, np.concatenate(pieces))
    other_seed = packing.packed_batch(examples, layout, seed=4, step=2, batch_size=6)
    assert not np.array_equal(full[0], other_seed[0])
    # one epoch of rows, batch by batch: every row exactly once (rows identified by their inputs)
    rows = layout.rows
    seen = np.concatenate([packing.packed_batch(examples, layout, seed=3, step=s, batch_size=1, rows=(0, 1))[0]
                           for s in range(rows)])
    every_row = np.concatenate([packing.eval_rows(examples, layout, r, batch_size=1)[0] for r in range(rows)])
    assert sorted(map(bytes, seen.astype(np.int32))) == sorted(map(bytes, every_row.astype(np.int32)))
    next_epoch = np.concatenate([packing.packed_batch(examples, layout, seed=3, step=s, batch_size=1, rows=(0, 1))[0]
                                 for s in range(rows, 2 * rows)])
    assert sorted(map(bytes, next_epoch)) == sorted(map(bytes, seen)) and not np.array_equal(next_epoch, seen)


def test_a_batch_row_matches_its_examples(tmp_path):
    examples = addition_corpus(tmp_path, count=200).examples["train"]
    layout = packing.plan(examples, 64)
    inputs, targets, mask, positions, segments = packing.eval_rows(examples, layout, 0, batch_size=1)
    members = layout.members[layout.row_starts[0]:layout.row_starts[1]]
    at = 0
    for segment, i in enumerate(members, start=1):
        tokens, completion = examples.example(int(i))
        n = len(tokens) - 1
        assert inputs[0, at:at + n].tolist() == tokens[:-1].tolist()
        assert targets[0, at:at + n].tolist() == tokens[1:].tolist()
        assert mask[0, at:at + n].tolist() == completion[1:].astype(bool).tolist()
        assert positions[0, at:at + n].tolist() == list(range(n))
        assert set(segments[0, at:at + n].tolist()) == {segment}
        at += n
    assert not mask[0, at:].any() and set(segments[0, at:].tolist()) <= {0}
    _, _, all_mask, _, all_segments = packing.packed_batch(examples, layout, seed=0, step=0, batch_size=2,
                                                           loss_on="all")
    np.testing.assert_array_equal(all_mask, all_segments > 0)  # every target of every example, no padding


def test_long_examples_are_truncated_or_refused_naming_the_record(tmp_path):
    lines = ['{"question": "1+1", "answer": "2"}', '{"question": "1+1", "answer": "' + "9" * 40 + '"}',
             '{"question": "' + "7" * 40 + '", "answer": "3"}', '{"question": "2+2", "answer": "4"}']
    corpus = prepare_records(tmp_path, "\n".join(lines) + "\n", val_fraction=0.0)
    examples = corpus.examples["train"]
    layout = packing.plan(examples, 24, truncate="completion")
    assert (layout.truncated, layout.dropped) == (1, 1)
    assert layout.kept.tolist()[1] == 25 and layout.kept.tolist()[2] == 0
    with pytest.raises(DataError, match=r"r.jsonl:2: it is \d+ tokens, more than block_size \+ 1 = 25"):
        packing.plan(examples, 24, truncate="error")
    long_prompt = tmp_path / "long_prompt"
    long_prompt.mkdir()
    del lines[1]
    examples = prepare_records(long_prompt, "\n".join(lines) + "\n", val_fraction=0.0).examples["train"]
    with pytest.raises(DataError, match=r"r.jsonl:2: its prompt alone is \d+ tokens, more than block_size"):
        packing.plan(examples, 24, truncate="error")


# --- whole records runs -------------------------------------------------------------------------------


def records_run_config(tmp_path, run, **changes):
    config = default_config()
    config.data.update(source="generated:addition:80", format="records", tokenizer="char", val_fraction=0.1,
                       cache_dir=str(tmp_path / "cache"))
    config.data.records.template = "qa"
    config.model.update(n_layer=1, n_head=2, d_model=16, block_size=32)
    config.train.update(steps=6, batch_size=4, eval_batch_size=4, warmup_steps=1, decay_steps=12, eval_every=3,
                        ckpt_every=3, log_every=1, peak_flops=1e9, grad_accum=2)
    config.mesh.cpu_devices = 0
    config.run_dir = str(tmp_path / run)
    for key, value in changes.items():
        section, name = key.split(".")
        config[section][name] = value
    return config


def test_records_run_resumes_exactly(tmp_path):
    from jaxgpt.train.run import train
    from jaxgpt.train.rundir import load_run

    first = train(records_run_config(tmp_path, "split", **{"train.steps": 3}))
    resumed = train(records_run_config(tmp_path, "split"))
    whole = train(records_run_config(tmp_path, "whole"))
    assert first["step"] == 3 and resumed["step"] == whole["step"] == 6
    split_params, whole_params = load_run(tmp_path / "split", step=6)[0], load_run(tmp_path / "whole", step=6)[0]
    for a, b in zip(jax_leaves(split_params), jax_leaves(whole_params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert resumed["val_loss"] == pytest.approx(whole["val_loss"], abs=1e-6)


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_init_from_a_run_directory_takes_its_model_tokenizer_and_params_with_a_fresh_optimizer(tmp_path):
    import jax

    from jaxgpt.model import param_layout
    from jaxgpt.optim import make_optimizer
    from jaxgpt.train import rundir
    from jaxgpt.train.run import init_or_restore, open_run

    train_source = records_run_config(tmp_path, "source")
    from jaxgpt.train.run import train
    train(train_source)
    source_params, source_cfg, source_tokenizer = rundir.load_run(tmp_path / "source")

    config = records_run_config(tmp_path, "tuned", **{"model.n_layer": 3, "model.block_size": 24,
                                                      "data.source": "generated:addition:60"})  # its characters
    config.init_from = str(tmp_path / "source")
    run = open_run(config)
    try:
        assert run.model.n_layer == source_cfg.n_layer and run.model.block_size == 24  # architecture from the source
        assert run.corpus.tokenizer == source_tokenizer
        state, _, start = init_or_restore(run, make_optimizer(run.train, param_layout(run.gpt)), jax.random.key(1))
    finally:
        run.checkpoints.close()
        run.lock.release()
    assert start == 0 and int(state.step) == 0
    np.testing.assert_array_equal(state.params["wpe"]["embedding"], source_params["wpe"]["embedding"][:24])
    np.testing.assert_array_equal(state.params["h_0"]["mlp"]["c_fc"]["kernel"],
                                  source_params["h_0"]["mlp"]["c_fc"]["kernel"])
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state.opt_state) if np.ndim(x) >= 2)

    config.init_from = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="neither hf:PATH nor a jaxgpt run directory"):
        rundir.resolve_init_from(config)
