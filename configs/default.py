"""The README's main job: a small GPT on the Python standard library's own source code
(present on every machine with Python, so nothing is downloaded), 3–5 minutes on 2 CPU cores
(2 min 49 s – 2 min 54 s on an Intel Xeon, 5 min 10 s on an AMD EPYC: docs/RESULTS.md); it
evaluates, saves checkpoints, plots its loss and ends by printing a sample.
"""

from jaxgpt.config import default_config


def get_config():
    config = default_config()
    config.data.source = "stdlib"
    config.data.tokenizer = "bpe"
    config.data.vocab_size = 2048
    config.model.update(n_layer=4, n_head=4, d_model=128, block_size=128, dropout=0.0, bias=False)
    config.train.update(
        steps=1000, batch_size=16, lr=1e-3, min_lr=1e-4, warmup_steps=50, b1=0.9, b2=0.99, weight_decay=0.1,
        eval_every=250, ckpt_every=250, eval_batch_size=32, eval_max_batches=20, log_every=10,
    )
    config.sample.update(prompt="def ", max_new_tokens=200, temperature=0.8, top_k=40)
    return config
