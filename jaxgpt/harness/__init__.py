"""jaxgpt as a model of EleutherAI's lm-evaluation-harness (the `eval` extra: pip install -e ".[eval]").

Importing this package registers the model "jaxgpt" with the harness (by name: the model's
module, with JAX, is imported when the harness first asks for it), so

    import jaxgpt.harness, lm_eval
    lm_eval.simple_evaluate(model="jaxgpt", model_args="run_dir=runs/x", tasks=["hellaswag"])

works from Python, and `python -m jaxgpt.harness` is the harness's own command line with the
model registered (the harness has no plugin entry point to find it otherwise):

    python -m jaxgpt.harness --model jaxgpt --model_args run_dir=runs/x,batch_size=16 --tasks hellaswag

`jaxgpt.harness.model` holds the model, `jaxgpt.harness.args` checks its model_args,
`jaxgpt.harness.preload` loads its run ahead; `jaxgpt.likelihood` computes its scores.
"""

import lm_eval.models  # noqa: F401  the harness's own models first: its lookup imports them only into an empty registry
from lm_eval.api.registry import model_registry

from jaxgpt.harness.args import ModelArgsError

if "jaxgpt" not in model_registry:
    model_registry.register("jaxgpt", target="jaxgpt.harness.model:JaxGPT")

__all__ = ["JaxGPT", "ModelArgsError"]


def __getattr__(name: str):
    if name == "JaxGPT":
        from jaxgpt.harness.model import JaxGPT

        return JaxGPT
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
