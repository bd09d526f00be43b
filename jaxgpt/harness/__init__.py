"""jaxgpt as a model of EleutherAI's lm-evaluation-harness (the `eval` extra: pip install -e ".[eval]").

Importing this package registers the model "jaxgpt" with the harness (its `register_model`), so

    import jaxgpt.harness, lm_eval
    lm_eval.simple_evaluate(model="jaxgpt", model_args="run_dir=runs/x", tasks=["hellaswag"])

works from Python, and `python -m jaxgpt.harness` is the harness's own command line with the
model registered (the harness has no plugin entry point to find it otherwise):

    python -m jaxgpt.harness --model jaxgpt --model_args run_dir=runs/x,batch_size=16 --tasks hellaswag

`jaxgpt.harness.model` holds the model; `jaxgpt.likelihood` computes its scores.
"""

from jaxgpt.harness.model import JaxGPT, ModelArgsError

__all__ = ["JaxGPT", "ModelArgsError"]
