"""Text in and out around sampling: a prompt checked and encoded, text continued with
`jaxgpt.decode.sampling.generate`, the likeliest next tokens as a line, and tokens decoded for
printing as they come."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxgpt import tokenizers
from jaxgpt.config import GPTConfig
from jaxgpt.decode.sampling import SamplingOptions, generate


def encode_prompt(tokenizer: tokenizers.Tokenizer, text: str) -> list[int]:
    """The token ids of a prompt; ValueError for an empty prompt or one that holds characters
    (char tokenizer) or words (word tokenizer) that the tokenizer has no token for."""
    if not text:
        raise ValueError("the prompt is empty: give at least one character for the model to continue")
    if tokenizer.count_unknown(text):
        if tokenizer.kind == "char":
            what, pieces = "characters", dict.fromkeys(c for c in text if tokenizer.count_unknown(c))
        else:
            what, pieces = "words", dict.fromkeys(w for w in text.split() if tokenizer.count_unknown(w))
        shown = ", ".join(map(repr, pieces))
        raise ValueError(f"the prompt holds {what} the tokenizer cannot encode: {shown} (it knows only the {what} of "
                         "its training text); remove or replace them")
    return tokenizer.encode(text)


def document_start(tokenizer: tokenizers.Tokenizer) -> list[int]:
    """The context of an unconditional sample: a new document, as after each <|eos|> of the
    corpus; a new line for a tokenizer without <|eos|>. ValueError when it has neither."""
    if tokenizer.eos_id is not None:
        return [tokenizer.eos_id]
    if not tokenizer.count_unknown("\n"):
        return tokenizer.encode("\n")
    raise ValueError("the tokenizer has neither <|eos|> nor a new line to start a sample from: give a prompt")


def prompt_or_start(tokenizer: tokenizers.Tokenizer, text: str) -> list[int]:
    """The prompt's ids (encode_prompt), or for no prompt ('') a new document (document_start)."""
    return encode_prompt(tokenizer, text) if text else document_start(tokenizer)


def generate_text(params, config: GPTConfig, tokenizer: tokenizers.Tokenizer, prompts: str | Sequence[str],
                  seed: int = 0, *, max_new_tokens: int = 256, temperature=1.0, top_k: int | None = None,
                  top_p=None, stop_at_eos: bool = True) -> str | list[str]:
    """Text in, text out: the continuation of each prompt (without the prompt), drawn with
    `generate`. One prompt gives one string, a list of prompts a list."""
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids = [encode_prompt(tokenizer, text) for text in texts]
    eos_id = tokenizer.eos_id if stop_at_eos and tokenizer.eos_id is not None else None
    options = SamplingOptions(max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id)
    result = generate(params, config, ids, seed, options)  # the key is made in the sampler's program
    continuations = [tokenizer.decode(row) for row in result.new_tokens()]
    return continuations[0] if isinstance(prompts, str) else continuations


def format_next_tokens(tokenizer: tokenizers.Tokenizer, context: Sequence[int], top_ids, top_logprobs,
                       context_chars: int = 40) -> str:
    """One line: the end of the context, ↦, then the likeliest next tokens with their
    probabilities, e.g. "…The Steenrod problem for ↦ ' closed' 29%, ' spaces' 24%"."""
    text = tokenizer.decode(list(context), keep_special=True)
    shown = ("…" + text[-context_chars:] if len(text) > context_chars else text).replace("\n", "⏎")
    choices = ", ".join(f"{tokenizer.decode([int(i)], keep_special=True)!r} {_percent(float(np.exp(lp)))}"
                        for i, lp in zip(top_ids, top_logprobs, strict=True))
    return f"{shown} ↦ {choices}"


def _percent(p: float) -> str:
    return f"{p:.0%}" if p >= 0.01 else "<1%"


class TextStream:
    """Decoding token by token for printing text as it comes: `push(id)` returns the new
    text, holding back a character whose UTF-8 bytes have not all arrived; `finish()`
    returns what is still held back."""

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids)
        return "" if text.endswith("\ufffd") else self._show(text)

    def finish(self) -> str:
        return self._show(self.tokenizer.decode(self.ids))

    def _show(self, text: str) -> str:
        """The part of `text` not shown yet (printed text cannot change: none if it did)."""
        new = text[len(self.shown):] if text.startswith(self.shown) else ""
        self.shown = text
        return new
