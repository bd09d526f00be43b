"""The harness's model "jaxgpt": a training run answering the harness's three request types.

- loglikelihood (context, continuation) → (log p(continuation | context), greedy?): encoded as
  the harness encodes for every causal model (`TemplateLM`), scored by
  `jaxgpt.likelihood.score_continuations`; a context longer than the block is cut from the left.
- loglikelihood_rolling (text,) → log p(text | <|eos|>) over the windows of jaxgpt's own
  evaluation (`jaxgpt.likelihood.score_texts`; stride: model_args, else the run's eval_stride).
- generate_until (context, gen_kwargs) → the text `jaxgpt.sampling.stream` draws (its jitted step,
  greedy unless the task samples), up to max_gen_toks tokens or <|eos|>, stopped and cut at the
  first of the task's `until` strings. The context keeps its last block_size − max_gen_toks
  tokens, as the harness's hf backend keeps them.

model_args: run_dir (required), step (a checkpoint; default the best by validation loss),
batch_size (default 16; it wins over the harness's --batch_size, whose default is 1), stride,
seed (for sampled generations). Text a char or word tokenizer has no token for is read as
<|unk|>, and each call says so once, with the count.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import lm_eval.models  # noqa: F401  the harness's own models, registered before ours (its lookup needs them then)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm.auto import tqdm

from jaxgpt import likelihood, rundir
from jaxgpt.checkpoint import CheckpointError
from jaxgpt.harness.generation import generate_texts
from jaxgpt.model import GPT

log = logging.getLogger(__name__)
DEFAULT_BATCH_SIZE = 16
MAX_GEN_TOKS = 256  # the harness's default for a task that names none
HARNESS_ARGS = ("max_batch_size", "device")  # what the harness passes every model: JAX chooses its own device
KNOWN = ("run_dir", "step", "batch_size", "stride", "seed")


class ModelArgsError(ValueError):
    """model_args that name no usable run or setting; the message says what to give."""


@register_model("jaxgpt")
class JaxGPT(TemplateLM):
    """A jaxgpt run as an `lm_eval.api.model.LM`."""

    def __init__(self, run_dir=None, step=None, batch_size=None, stride=None, seed=1234, **others):
        super().__init__()
        check_args(run_dir, step, stride, seed, others)
        try:
            self.params, self.config, self.text_tokenizer = rundir.load_run(run_dir, step=step)
        except CheckpointError as err:
            raise ModelArgsError(f"model_args step={step}: {err}") from None
        except ValueError as err:
            raise ModelArgsError(f"model_args run_dir={run_dir}: {err}") from None
        self.model = GPT(self.config)
        self.batch_size = parse_batch_size(batch_size)
        self.stride, self.seed = run_stride(run_dir, stride, self.config.block_size), seed
        self.unknown = likelihood.UnknownTally(self.text_tokenizer)

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        """model_args' own batch_size wins over the harness's --batch_size (which is 1 when not given)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # --- what the harness asks of a model ---------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return likelihood.prefix_id(self.text_tokenizer)

    @property
    def prefix_token_id(self) -> int:
        return likelihood.prefix_id(self.text_tokenizer)

    @property
    def max_length(self) -> int:
        return self.config.block_size

    @property
    def tokenizer_name(self) -> str:
        return f"jaxgpt-{self.text_tokenizer.kind}-{self.text_tokenizer.vocab_size}"

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.text_tokenizer.encode(string)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        for request in requests:
            self.unknown.add("".join(request.args))
        results = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        self._say_unknown()
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        with tqdm(total=len(requests), disable=disable_tqdm, desc="jaxgpt loglikelihood") as bar:
            scores = likelihood.score_continuations(
                self.model, self.params, [(context, continuation) for _, context, continuation in requests],
                batch_size=self.batch_size, on_batch=lambda done, total: bar.update(
                    min(len(requests), done * self.batch_size) - bar.n))
        for (strings, _, _), answer in zip(requests, scores, strict=True):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [request.args[0] for request in requests]
        for text in texts:
            self.unknown.add(text)
        tokens = [[self.prefix_token_id, *self.tok_encode(text)] for text in texts]
        scores = likelihood.score_texts(self.model, self.params, tokens, batch_size=self.batch_size,
                                        stride=self.stride)
        for text, score in zip(texts, scores, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), score)
        self._say_unknown()
        return scores

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}  # requests with the same generation kwargs share batches
        for index, request in enumerate(requests):
            self.unknown.add(request.args[0])
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        results = [""] * len(requests)
        for indices in groups.values():
            texts = self._generate([requests[i].args[0] for i in indices], requests[indices[0]].args[1])
            for i, text in zip(indices, texts, strict=True):
                results[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        self._say_unknown()
        return results

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, MAX_GEN_TOKS))
        eos_text = self.text_tokenizer.decode([self.eot_token_id], keep_special=True)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        max_gen_toks = kwargs.pop("max_gen_toks")
        keep = max(1, self.config.block_size - max_gen_toks)
        prompts = [(self.tok_encode(context) or [self.prefix_token_id])[-keep:] for context in contexts]
        texts = generate_texts(self.params, self.config, self.text_tokenizer, prompts, kwargs, until,
                               max_new_tokens=max_gen_toks, batch_size=self.batch_size,
                               key=jax.random.key(self.seed))
        return [postprocess_generated_text(text, until, None) for text in texts]

    def _say_unknown(self) -> None:
        message = self.unknown.message()
        if message:
            log.warning("jaxgpt: %s", message)


def check_args(run_dir, step, stride, seed, others: dict) -> None:
    """ModelArgsError for model_args jaxgpt cannot use."""
    unknown = sorted(set(others) - set(HARNESS_ARGS))
    if unknown:
        raise ModelArgsError(f"model_args {', '.join(unknown)}: jaxgpt takes {', '.join(KNOWN)} "
                             "(run_dir=RUN is required)")
    if run_dir is None or run_dir == "":
        raise ModelArgsError("model_args needs run_dir=RUN, the directory a jaxgpt training run wrote")
    for name, value, least in (("step", step, 0), ("stride", stride, 1), ("seed", seed, 0)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise ModelArgsError(f"model_args {name}={value!r}: must be an integer ≥ {least}")


def run_stride(run_dir, stride: int | None, block_size: int) -> int | None:
    """The stride of loglikelihood_rolling's windows: model_args', else the run's data.eval_stride."""
    if stride is None:
        saved = json.loads((Path(run_dir) / rundir.CONFIG_FILE).read_text(encoding="utf-8"))
        stride = saved.get("data", {}).get("eval_stride")
    if stride is not None and stride > block_size:
        raise ModelArgsError(f"model_args stride={stride}: must be at most the model's block_size={block_size}")
    return stride


def parse_batch_size(value) -> int:
    """An integer ≥ 1; None and the harness's 'auto' (which jaxgpt does not search) give DEFAULT_BATCH_SIZE."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH_SIZE
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1 or isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ModelArgsError(f"batch_size={value!r}: must be a positive integer (or auto: {DEFAULT_BATCH_SIZE})")
    return size
