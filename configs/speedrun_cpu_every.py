"""configs/speedrun_cpu_plus.py with every later technique that fits nanoGPT's CPU parameter
budget switched on, for the ablation that chose speedrun_cpu_plus's (docs/EXPERIMENTS.md, "The
later techniques"): beside its value embeddings, bigram table and NorMuon, U-net skips, the
smear, Polar Express coefficients and cautious weight decay (at 0.05), over 240 steps.

    python -m jaxgpt.sweep --config=configs/speedrun_cpu_every.py --ablate no_smear:model.smear=False …
"""

from jaxgpt.config import load_config


def get_config():
    config = load_config(__file__.replace("speedrun_cpu_every.py", "speedrun_cpu_plus.py"))  # the config it adds to
    config.model.update(unet_skips=True, smear=True)
    config.train.update(muon_coeffs="polar_express", cautious_weight_decay=True, weight_decay=0.05, steps=240)
    return config
