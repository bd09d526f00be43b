"""jaxgpt: a GPT language model in JAX/Flax whose code reads like its mathematics.

The names below are imported when first used, so that `import jaxgpt.tokenizers` (e.g. in a
data-preparation worker) does not start JAX."""

from jaxgpt.lazy import alias_moved, lazy_exports
from jaxgpt.platforms import skip_absent_gpu, skip_absent_tpu

# an accelerator's library installed on a machine without the accelerator: JAX starts no backend for it,
# and the CUDA plugin is not even loaded (jaxgpt.platforms)
skip_absent_gpu()
skip_absent_tpu()

_EXPORTS = {
    "GPTConfig": "jaxgpt.model_config", "ComputeConfig": "jaxgpt.model_config",
    "KVCache": "jaxgpt.attention", "LinearCache": "jaxgpt.attention", "RingCache": "jaxgpt.attention",
    "init_cache": "jaxgpt.attention",
    "GPT": "jaxgpt.model", "flops_per_token": "jaxgpt.model", "param_count": "jaxgpt.model",
}
__all__ = ["GPT", "ComputeConfig", "GPTConfig", "KVCache", "LinearCache", "RingCache", "init_cache", "param_count",
           "flops_per_token"]
__version__ = "0.1.0"

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

# The modules that moved into the packages by concern, importable by their old names (one module each)
MOVED = {f"jaxgpt.{old}": f"jaxgpt.{new}" for old, new in {
    "compile_args": "compile.args", "compile_counts": "compile.counts", "compile_gpu": "compile.gpu",
    "compile_table": "compile.table", "gpus": "compile.gpus", "run": "train.run", "opening": "train.opening",
    "preflight": "train.preflight", "micro_batch": "train.micro_batch", "training": "train.step",
    "evaluation": "train.evaluation", "rundir": "train.rundir", "sampling": "decode.sampling",
    "decoding": "decode.logits", "beam": "decode.beam", "text": "decode.text", "likelihood": "score.likelihood",
    "choices": "score.choices", "completions": "score.completions", "sweep_summary": "sweep.summary",
    "chunked": "loss.chunked", "multi_token": "loss.multi_token", "muon": "optim.muon"}.items()}
alias_moved(MOVED)
