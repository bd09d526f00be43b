"""The modern recipe on nanoGPT's CPU task: a character-level GPT on Tiny Shakespeare, the last
10% of the text for validation, no more parameters than nanoGPT's CPU recipe
(configs/shakespeare_char_cpu.py) and no longer a context (64).

    python train.py --config=configs/speedrun_cpu.py --config.data.source=PATH/input.txt

Muon for the blocks' weight matrices, AdamW with their own learning rates for the embedding,
the untied unembedding and the gains; QK-norm, ReLU², soft-capped logits, zero-initialised
output projections, RoPE and RMSNorm without biases; a warmup–stable–decay schedule.
bench/bench_time_to_loss.py times it against nanoGPT; the README has the grids that tuned it
and the ablation.
"""

from jaxgpt.config import default_config


def get_config():
    config = default_config()
    config.data.source = "../shared/data/tinyshakespeare.txt"
    config.data.tokenizer = "char"
    config.data.val_fraction = 0.1
    # 4×4×128 like nanoGPT's CPU recipe; RoPE needs no position table, which pays for the untied
    # unembedding, and d_ff 504 for the 4 special tokens jaxgpt's vocabulary has beyond nanoGPT's 65
    config.model.update(n_layer=4, n_head=4, d_model=128, d_ff=504, block_size=64, dropout=0.0, bias=False,
                        positions="rope", norm="rmsnorm", activation="relu2", qk_norm=True, logit_softcap=15.0,
                        zero_init_out=True, tie_embeddings=False)
    config.train.update(
        optimizer="muon", lr=0.02, embed_lr=0.1, head_lr=0.006, scalar_lr=0.01, min_lr=0.0,
        b1=0.8, b2=0.95, weight_decay=0.0, clip=0.0,
        schedule="wsd", warmup_steps=20, cooldown_fraction=0.4,
        steps=240, batch_size=16,
        eval_every=40, ckpt_every=240, log_every=10, eval_batch_size=48,
    )
    config.sample.update(prompt="\n", max_new_tokens=500)
    return config
