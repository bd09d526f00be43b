"""configs/speedrun_cpu_plus.py as it stood before the trigram table and the key offset (value
embeddings, a 64-row bigram table, NorMuon, d_ff 480, 180 steps): the config the ablations in
docs/EXPERIMENTS.md ran against, kept so that their commands give their tables again.

    python train.py --config=configs/speedrun_cpu_plus_v1.py --config.data.source=PATH/input.txt
"""

from jaxgpt.config import load_config


def get_config():
    config = load_config(__file__.replace("speedrun_cpu_plus_v1.py", "speedrun_cpu.py"))  # the recipe it adds to
    config.model.update(d_ff=480, value_embeds=((0, -1), (1, -2)), bigram_table=64)
    config.train.update(normuon=True, steps=180)
    return config
