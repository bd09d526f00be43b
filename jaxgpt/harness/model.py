"""The harness's model "jaxgpt": a training run answering the harness's three request types.

- loglikelihood (context, continuation) → (log p(continuation | context), greedy?): encoded as
  the harness encodes for every causal model (`TemplateLM`), scored by
  `jaxgpt.score.likelihood.score_continuations`; a context longer than the block is cut from the left.
- loglikelihood_rolling (text,) → log p(text | <|eos|>) over the windows of jaxgpt's own
  evaluation (`jaxgpt.score.likelihood.score_texts`; stride: model_args, else the run's eval_stride).
- generate_until (context, gen_kwargs) → the text `jaxgpt.decode.sampling.stream` draws (its jitted step,
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

import jax
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm.auto import tqdm

from jaxgpt.harness import preload
from jaxgpt.harness.args import DEFAULT_BATCH_SIZE, KNOWN, ModelArgsError, check_args, parse_batch_size
from jaxgpt.harness.generation import generate_texts
from jaxgpt.score import likelihood

log = logging.getLogger(__name__)
MAX_GEN_TOKS = 256  # the harness's default for a task that names none
__all__ = ["DEFAULT_BATCH_SIZE", "KNOWN", "JaxGPT", "ModelArgsError"]


@register_model("jaxgpt")
class JaxGPT(TemplateLM):
    """A jaxgpt run as an `lm_eval.api.model.LM`."""

    def __init__(self, run_dir=None, step=None, batch_size=None, stride=None, seed=1234, **others):
        super().__init__()
        check_args(run_dir, step, stride, seed, others)
        self.batch_size = parse_batch_size(batch_size)
        background = preload.take(run_dir, step, stride)  # the command line's, loaded while the tasks were indexed
        if background is None:
            background = preload.Background(self.batch_size, loaded=preload.load(run_dir, step, stride))
        loaded = background.loaded()
        self.params, self.config, self.text_tokenizer, self.model = (loaded.params, loaded.config, loaded.tokenizer,
                                                                     loaded.model)
        self.stride, self.seed = loaded.stride, seed
        self.unknown = likelihood.UnknownTally(self.text_tokenizer)
        self._compiling = background  # the scoring programs compile while the harness builds its tasks

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
        self._compiling.wait()
        with tqdm(total=len(requests), disable=disable_tqdm, desc="jaxgpt loglikelihood") as bar:
            scores = likelihood.score_continuations(
                self.model, self.params, [(context, continuation) for _, context, continuation in requests],
                batch_size=self.batch_size, on_batch=lambda done, total: bar.update(
                    len(requests) * done // total - bar.n))
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
