"""jaxgpt as a model of EleutherAI's lm-evaluation-harness (the `eval` extra: pip install -e ".[eval]").

Importing this package registers the model "jaxgpt" with the harness (by name: the model's
module, with JAX, is imported when the harness first asks for it), so

    import jaxgpt.harness, lm_eval
    lm_eval.simple_evaluate(model="jaxgpt", model_args="run_dir=runs/x", tasks=["hellaswag"])

works from Python, and `python -m jaxgpt.harness` is the harness's own command line with the
model registered (lm_eval 0.4.13 has no plugin entry point to find it otherwise; the entry point
"jaxgpt" in pyproject.toml's group "lm_eval.models" is for the harness's releases that load them):

    python -m jaxgpt.harness --model jaxgpt --model_args run_dir=runs/x,batch_size=16 --tasks hellaswag

Without the harness installed the package still imports, so that `python -m jaxgpt.harness`
can say in one line what to install (HARNESS_MISSING is then the ImportError).

`jaxgpt.harness.model` holds the model, `jaxgpt.harness.args` checks its model_args,
`jaxgpt.harness.preload` loads its run ahead; `jaxgpt.score.likelihood` computes its scores.
"""

from jaxgpt.harness.args import ModelArgsError

INSTALL = "pip install -e '.[eval]'"

__all__ = ["INSTALL", "JaxGPT", "ModelArgsError"]


def _register() -> ImportError | None:
    """Register "jaxgpt" with the harness; the ImportError where the harness cannot be imported."""
    try:
        # the harness's own models first: its lookup imports them only into an empty registry
        import lm_eval.models  # noqa: F401
        from lm_eval.api.registry import model_registry
    except ImportError as err:
        return err
    if "jaxgpt" not in model_registry:
        model_registry.register("jaxgpt", target="jaxgpt.harness.model:JaxGPT")
    return None


HARNESS_MISSING = _register()


def __getattr__(name: str):
    if name == "JaxGPT":
        if HARNESS_MISSING is not None:
            raise ImportError(f"jaxgpt.harness.JaxGPT needs the lm-evaluation-harness ({HARNESS_MISSING}): {INSTALL}")
        from jaxgpt.harness.model import JaxGPT

        return JaxGPT
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
