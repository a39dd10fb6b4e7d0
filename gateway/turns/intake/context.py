"""Context-length admission: a request the engines would refuse for its length never reaches them.

vLLM refuses a prompt of `max_model_len` tokens or more, and a prompt plus `max_tokens` (or
`max_completion_tokens`) over `max_model_len`, with HTTP 400 (its OpenAI serving layer, e.g. v0.10.2
`serving_engine.py` `_validate_input`). Sending such a request on costs an engine its tokenization and, for a
huge prompt, its health: so the gateway says the same words itself, before any engine sees the request.

Counting the tokens of a huge prompt is itself slow (about a second per MB of text), so a cheap bound comes
first: no token spells more characters than the vocabulary's longest entry, so a text of `c` characters is at
least `c // longest` tokens. A text that is over the limit even by that bound is refused without tokenizing.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequestError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16     # vLLM's /v1/completions default when the client sends none


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token spells: the longest vocabulary entry (byte-level and
    sentencepiece entries are at least as long as the text they decode to; added tokens included)."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return 0
    return max(map(len, vocab), default=0)


class ContextLimit:
    """`max_model_len`: the smallest any engine reported (None: unknown, nothing is checked here)."""

    def __init__(self, max_model_len: int | None, max_token_chars: int = 0) -> None:
        self.max_model_len = max_model_len
        self.max_token_chars = max_token_chars

    def check_text(self, text: str, param: str) -> None:
        """Refuse, without tokenizing, a text that is too long even at the longest token per position."""
        limit = self.max_model_len
        if limit is None or self.max_token_chars <= 0:
            return
        at_least = len(text) // self.max_token_chars
        if at_least >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your request has at least "
                f"{at_least} input tokens. Please reduce the length of the input messages.", param=param)

    def check_tokens(self, prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        """vLLM's two checks, in its order and its words."""
        limit = self.max_model_len
        if limit is None:
            return
        if prompt_tokens >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_tokens} input tokens. Please reduce the length of the input messages.", param=param)
        if max_tokens is not None and prompt_tokens + max_tokens > limit:
            raise InvalidRequestError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                f"context length is {limit} tokens and your request has {prompt_tokens} input tokens "
                f"({max_tokens} > {limit} - {prompt_tokens}).", param="max_tokens")
