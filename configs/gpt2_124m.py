"""GPT-2 small (124M): 12 layers, 12 heads, d_model 768, block 1024, tied embeddings,
bfloat16 compute with float32 parameters, ~0.5M tokens per step (512 rows × 1024 tokens =
524,288). For GPUs or a TPU slice:

    python train.py --config=configs/gpt2_124m.py --config.data.source=SOURCE --config.mesh.fsdp=-1 --config.mesh.data=1

The rows each device takes at once are chosen from the device count and the memory of one
device (jaxgpt.train.micro_batch; the run says what it chose), the rest of the 512 rows by gradient
accumulation: 64 rows per chip in one micro-batch on v5e-8 (the loss 4096 tokens at a time,
compute.loss_chunk, holds no row's logits). An explicit train.batch_size and train.grad_accum
(their product the rows per step) win.
"""

from jaxgpt.config import default_config


def get_config():
    config = default_config()
    config.data.source = "hf:HuggingFaceFW/fineweb-edu:sample-10BT:train"  # the hf extra; or your files
    config.data.tokenizer = "bpe"  # or the path of a saved tokenizer file, e.g. GPT-2's own
    config.data.vocab_size = 50257
    config.model.update(vocab_size=50304,  # the tokenizer's 50257 padded to a multiple of 64, as GPUs like
                        n_layer=12, n_head=12, d_model=768, block_size=1024, dropout=0.0, bias=True,
                        tie_embeddings=True)
    # how it runs (any of it may change on resume): the platform's own attention kernel, flash on a TPU; the
    # unembedding and the loss 4096 tokens at a time on each device, so the logits never take a row's memory
    config.compute.update(kernel="auto", dtype="bfloat16", param_dtype="float32", loss_chunk=4096)
    config.train.update(
        steps=600_000, rows_per_step=512, batch_size=0, grad_accum=0, lr=6e-4, min_lr=6e-5,
        warmup_steps=2000, decay_steps=600_000, b1=0.9, b2=0.95, weight_decay=0.1, clip=1.0,
        eval_every=500, ckpt_every=500, log_every=10, eval_batch_size=16, eval_max_batches=200,
    )
    config.sample.update(prompt="The", max_new_tokens=200)
    return config
