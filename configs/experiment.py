"""A tiny GPT for experiments on 2 CPU cores: a character model of the first 2 MB of the Python
standard library's source (present everywhere), 400 steps in under a minute. Sweep one piece of
the math with it, e.g. the position scheme or where the norm goes:

    python -m jaxgpt.sweep --config=configs/experiment.py \\
        --grid model.positions=learned,sinusoidal,rope,alibi,none --out runs/sweep-positions
    python -m jaxgpt.sweep --config=configs/experiment.py \\
        --grid model.norm_position=pre,post --grid model.parallel_block=False,True --out runs/sweep-norms
"""

from jaxgpt.config import default_config


def get_config():
    config = default_config()
    config.data.update(source="stdlib", tokenizer="char", max_bytes=2_000_000, val_fraction=0.05)
    config.model.update(n_layer=2, n_head=4, d_model=64, block_size=64, dropout=0.0, bias=False)
    config.train.update(
        steps=400, batch_size=16, lr=2e-3, min_lr=2e-4, warmup_steps=40, eval_every=100, ckpt_every=200,
        eval_batch_size=32, eval_max_batches=10, log_every=20,
    )
    config.sample.update(prompt="def ", max_new_tokens=100)
    return config
