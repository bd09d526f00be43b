"""Supervised fine-tuning on records, on a task with a checkable answer: multi-digit addition
that the project generates (jaxgpt.data.generated; nothing is downloaded). Each record
{"question": "482+37", "answer": "519"} becomes the prompt "Question: 482+37\\nAnswer: " and
the completion "519<|eos|>"; the loss falls on the completion, and examples are packed into
rows with attention kept within each.

    python train.py --config=configs/finetune_records.py
    python eval.py --run_dir=runs/finetune_records --records     # exact match on held-out records
    python sample.py --run_dir=runs/finetune_records --record='{"question": "123+456"}'

Your own records: --config.data.source=PATH (.jsonl, .json, .csv, .tsv) with
--config.data.template (prompt_completion, alpaca, qa, chat) or your own
--config.data.prompt_template / completion_template.
"""

from jaxgpt.config import default_config


def get_config():
    config = default_config()
    config.data.update(source="generated:addition", format="records", template="qa", tokenizer="char",
                       val_fraction=0.05, loss_on="completion", packing="pack")
    config.model.update(n_layer=4, n_head=4, d_model=128, block_size=64, dropout=0.0, bias=False)
    config.train.update(
        steps=1500, batch_size=32, lr=2e-3, min_lr=1e-4, warmup_steps=100, b1=0.9, b2=0.99, weight_decay=0.1,
        eval_every=500, ckpt_every=500, eval_batch_size=64, log_every=50,
    )
    config.sample.update(prompt="Question: 123+456\nAnswer: ", max_new_tokens=8, temperature=0.0)
    return config
