"""nanoGPT's documented CPU recipe, the same hyperparameters so the two can be compared:
a character-level GPT on Tiny Shakespeare, the last 10% of the text for validation.

    python train.py --config=configs/shakespeare_char_cpu.py --config.data.source=PATH/input.txt
(or --config.data.source=tfds:tiny_shakespeare)
"""

from jaxgpt.config import default_config


def get_config():
    config = default_config()
    config.data.source = "../shared/data/tinyshakespeare.txt"
    config.data.tokenizer = "char"
    config.data.val_fraction = 0.1  # a single document: its last 10%
    # GPT-2's tanh GELU (the default): nanoGPT's MLP uses the erf GELU, whose backward pass is
    # slower here; both reached validation loss 1.901 on the CPU recipe (seed 0).
    config.model.update(n_layer=4, n_head=4, d_model=128, block_size=64, dropout=0.0, bias=False,
                        positions="learned", tie_embeddings=True)
    config.train.update(
        steps=2000, batch_size=12, lr=1e-3, min_lr=1e-4, warmup_steps=100, decay_steps=2000,
        b1=0.9, b2=0.99, weight_decay=0.1, clip=1.0, eval_every=250, ckpt_every=250, log_every=10,
        # nanoGPT's estimate (eval_iters=20): 20 batches of 12 rows from each of two splits, 30,720
        # tokens; here as many from the validation split, its first 480 windows (the whole split:
        # --config.train.eval_max_batches=None)
        eval_batch_size=48, eval_max_batches=10,
    )
    config.sample.update(prompt="\n", max_new_tokens=500)
    return config
