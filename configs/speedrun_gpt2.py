"""The modern recipe at GPT-2 small's size (124M in its blocks), for FineWeb through the prepare
path: 12 layers, 12 heads, d_model 768, block 1024, ~0.5M tokens per step (512 rows × 1024
tokens = 524,288; the rows per device chosen to fit, as in configs/gpt2_124m.py), 3,250 steps
(1.7B tokens).

    python train.py --config=configs/speedrun_gpt2.py --config.data.source=SOURCE \\
        --config.mesh.fsdp=-1 --config.mesh.data=1
    python -m jaxgpt.compile --config=configs/speedrun_gpt2.py --topology=v5e:2x4 --config.mesh.fsdp=-1 \\
        --config.mesh.data=1 --config.train.grad_accum=4 --config.train.batch_size=128

Muon (momentum 0.95, Nesterov) for the blocks' weight matrices; AdamW (β 0.8, 0.95) with their
own learning rates for the token embedding, the untied unembedding and the gains. QK-norm,
ReLU², logits soft-capped at 15, zero-initialised output projections, RoPE and RMSNorm without
biases, a warmup–stable–decay schedule whose last 40% decays to zero. From the later records, the
two that helped on the CPU (docs/EXPERIMENTS.md, "The later techniques"): three value-embedding
tables and a bigram hash table, and NorMuon. configs/gpt2_124m.py is the
2019 recipe at the same size (AdamW, GELU, tied embeddings, warmup-cosine).
"""

from jaxgpt.config import default_config


def get_config():
    config = default_config()
    config.data.source = "hf:HuggingFaceFW/fineweb-edu:sample-10BT:train"  # the hf extra; or your files
    config.data.tokenizer = "bpe"  # or the path of a saved tokenizer file, e.g. GPT-2's own
    config.data.vocab_size = 50257
    config.model.update(vocab_size=50304,  # the tokenizer's 50257 padded to a multiple of 64
                        n_layer=12, n_head=12, d_model=768, block_size=1024, dropout=0.0, bias=False,
                        positions="rope", norm="rmsnorm", activation="relu2", qk_norm=True, logit_softcap=15.0,
                        zero_init_out=True, tie_embeddings=False,
                        # the later techniques the CPU ablation kept (docs/EXPERIMENTS.md): three value-embedding
                        # tables (layers 0 and 9, 1 and 10, 2 and 11) and a bigram hash table of the vocabulary's size
                        value_embeds=((0, -3), (1, -2), (2, -1)), bigram_table=50304)
    config.compute.update(kernel="auto", dtype="bfloat16", param_dtype="float32", loss_chunk=4096)
    config.train.update(
        optimizer="muon", normuon=True, lr=0.05, embed_lr=0.3, head_lr=0.008, scalar_lr=0.04, min_lr=0.0,
        b1=0.8, b2=0.95, eps=1e-10, weight_decay=0.0, clip=0.0,
        schedule="wsd", warmup_steps=0, cooldown_fraction=0.4,
        steps=3250, rows_per_step=512, batch_size=0, grad_accum=0,
        eval_every=250, ckpt_every=250, log_every=10, eval_batch_size=16, eval_max_batches=200,
    )
    config.sample.update(prompt="The", max_new_tokens=200)
    return config
