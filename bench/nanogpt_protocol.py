# A config file for nanoGPT's train.py (its configurator runs it in train.py's globals, before
# the model and the loop exist), given by bench/bench_time_to_loss.py. It changes two things
# and no part of the training:
#   - the seed: torch.manual_seed(s) becomes torch.manual_seed(s + TTL_SEED);
#   - the evaluation: the function train.py decorates as estimate_loss is replaced, when it is
#     decorated, by the bench's shared protocol: the mean cross-entropy over the first
#     TTL_WINDOWS windows of TTL_BLOCK + 1 characters of the text in TTL_VAL (window w starts at
#     character w·TTL_BLOCK; every target counted), in batches of 48, with model.eval() and
#     no gradients. It prints "protocol: step S, val loss L, evaluation E s" and returns L for
#     both splits, so the loop's checkpoint rule and log see that loss. torch.save prints
#     "protocol: checkpoint C s", so the bench can leave the writes out of the time too.
import os as _os
import time as _time

import torch as _torch

_SEED = int(_os.environ["TTL_SEED"])
_SET_SEED = _torch.manual_seed
_torch.manual_seed = lambda seed: _SET_SEED(seed + _SEED)


def _protocol_windows(stoi):
    block, count = int(_os.environ["TTL_BLOCK"]), int(_os.environ["TTL_WINDOWS"])
    with open(_os.environ["TTL_VAL"], encoding="utf-8") as f:
        ids = _torch.tensor([stoi[c] for c in f.read()], dtype=_torch.long)
    windows = _torch.stack([ids[w * block: w * block + block + 1] for w in range(count)])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _shared_evaluation(train_globals):
    import pickle

    with open(_os.path.join(train_globals["data_dir"], "meta.pkl"), "rb") as f:
        inputs, targets = _protocol_windows(pickle.load(f)["stoi"])

    def evaluate():
        start = _time.perf_counter()
        model = train_globals["model"]
        model.eval()
        total = 0.0
        with _torch.no_grad():
            for first in range(0, len(inputs), 48):
                _, loss = model(inputs[first:first + 48], targets[first:first + 48])
                total += loss.item() * targets[first:first + 48].numel()
        model.train()
        val = total / targets.numel()
        print(f"protocol: step {train_globals['iter_num']}, val loss {val:.6f}, "
              f"evaluation {_time.perf_counter() - start:.4f} s", flush=True)
        return {"train": _torch.tensor(val), "val": _torch.tensor(val)}

    return evaluate


class _NoGrad(_torch.no_grad):
    def __call__(self, function):
        if getattr(function, "__name__", "") == "estimate_loss":
            return _shared_evaluation(function.__globals__)
        return super().__call__(function)


_torch.no_grad = _NoGrad
_SAVE = _torch.save


def _timed_save(*args, **kwargs):
    start = _time.perf_counter()
    _SAVE(*args, **kwargs)
    print(f"protocol: checkpoint {_time.perf_counter() - start:.4f} s", flush=True)


_torch.save = _timed_save
