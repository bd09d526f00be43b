"""configs/speedrun_cpu_plus.py as it stood before its sequence-length schedule (value embeddings,
bigram and trigram hash tables, the key offset, NorMuon, d_ff 448, 160 steps of whole rows): the
config the Newton–Schulz and schedule ablations in docs/EXPERIMENTS.md ran against, kept so that
their commands give their tables again.

    python train.py --config=configs/speedrun_cpu_plus_v2.py --config.data.source=PATH/input.txt
"""

from jaxgpt.config import load_config


def get_config():
    config = load_config(__file__.replace("speedrun_cpu_plus_v2.py", "speedrun_cpu.py"))  # the recipe it adds to
    config.model.update(d_ff=448, value_embeds=((0, -1), (1, -2)), bigram_table=64, trigram_table=256,
                        key_offset=True)
    config.train.update(normuon=True, steps=160)
    return config
