"""nanoGPT's baby GPT for one GPU: a character-level GPT on Tiny Shakespeare.

    python train.py --config=configs/shakespeare_char.py --config.data.source=PATH/input.txt
"""

from jaxgpt.config import default_config


def get_config():
    config = default_config()
    config.data.source = "../shared/data/tinyshakespeare.txt"
    config.data.tokenizer = "char"
    config.data.val_fraction = 0.1
    # GPT-2's tanh GELU (the default): nanoGPT's MLP uses the erf GELU, whose backward pass is
    # slower here; both reached validation loss 1.901 on the CPU recipe (seed 0).
    config.model.update(n_layer=6, n_head=6, d_model=384, block_size=256, dropout=0.2, bias=False)
    config.compute.kernel = "blocked"  # the same attention, in query blocks that skip the masked keys
    config.train.update(
        steps=5000, batch_size=64, lr=1e-3, min_lr=1e-4, warmup_steps=100, decay_steps=5000,
        b1=0.9, b2=0.99, weight_decay=0.1, clip=1.0, eval_every=250, ckpt_every=250, log_every=10,
        eval_batch_size=64, eval_max_batches=50,
    )
    config.sample.update(prompt="\n", max_new_tokens=500)
    return config
