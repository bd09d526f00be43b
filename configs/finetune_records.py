"""Supervised fine-tuning on records, on a task with a checkable answer: look-ups in a table
that the project generates (jaxgpt.data.sources.generated; nothing is downloaded). Each record

    {"context": "fruit=fig city=Lima color=red metal=tin", "question": "What is the city?", "answer": "Lima"}

becomes, by the qa template, the prompt "Context: …\\nQuestion: What is the city?\\nAnswer: "
and the completion "Lima<|eos|>". The answer is in the record, not in the model's memory, so
held-out records measure what it learned: to find the field asked for and copy its value.
The loss falls on the completion; examples are packed four to a row with attention kept
within each. About 2½ minutes on 2 CPU cores; 5% of the records are held out.

    python train.py --config=configs/finetune_records.py
    python eval.py --run_dir=runs/finetune_records --records     # exact match on the held-out records

Your own records: --config.data.source=PATH (.jsonl, .json, .csv, .tsv) with
--config.data.records.template (prompt_completion, alpaca, qa, chat), or your own templates
in place of this preset's qa:

    python train.py --config=configs/finetune_records.py --config.data.source=my.jsonl \
        --config.data.records.template=None --config.data.records.prompt_template='Q: {question}\nA: ' \
        --config.data.records.completion_template='{answer}'
"""

from jaxgpt.config import default_config


def get_config():
    config = default_config()
    config.data.update(source="generated:lookup", format="records", tokenizer="bpe", vocab_size=512, val_fraction=0.05)
    config.data.records.update(template="qa", loss_on="completion", packing="pack")
    config.model.update(n_layer=4, n_head=8, d_model=128, block_size=112, dropout=0.0, bias=False)
    config.train.update(
        steps=1000, batch_size=16, lr=2e-3, min_lr=1e-4, warmup_steps=100, b1=0.9, b2=0.99, weight_decay=0.1,
        eval_every=250, ckpt_every=250, eval_batch_size=50, log_every=50,
    )
    # the final sample: a held-out kind of record, its prompt made by the run's own templates (qa here, or yours)
    config.sample.update(record='{"context": "city=Oslo animal=owl metal=gold fruit=kiwi", '
                                '"question": "What is the metal?"}', max_new_tokens=8, temperature=0.0)
    return config
