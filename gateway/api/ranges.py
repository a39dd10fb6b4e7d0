"""The ranges the engines enforce, enforced first: a value vLLM cannot take is the client's 400 here, naming its
field, never an engine's 500 relayed as a 502 (issue 38: `seed` = 2**80 was "engine answered HTTP 500").

From vLLM 0.32: its protocol models bound `seed` and `priority` to int64 (`Field(ge=_INT64_MIN, le=_INT64_MAX)`,
entrypoints/openai/chat_completion/protocol.py), and every integer it passes on travels to the engine core by
MessagePack, which holds 64 bits and no more (sampling_params.py `_verify_extra_args`); `SamplingParams._verify_args`
refuses the penalties, `top_p`, `top_k`, `min_p`, `min_tokens` (at least 0, at most `max_tokens`) and empty stop
strings checked here. The sampling fields the gateway does not read are still forwarded as sent: this only refuses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gateway.errors import InvalidRequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Fields that carry text or schemas the engines render or compile, not sampling numbers: not walked here.
_NOT_SAMPLING = frozenset({"messages", "tools", "tool_choice", "response_format", "metadata",
                           "chat_template_kwargs", "prompt", "structured_outputs", "stream_options"})

Check = Callable[[float], bool]
# field: (what must hold, how the error says it); checked when the value is a number (a bool is not one)
_BOUNDS: dict[str, tuple[Check, str]] = {
    "presence_penalty": (lambda v: -2 <= v <= 2, "must be in [-2, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "must be in [-2, 2]"),
    "repetition_penalty": (lambda v: 0 < v and math.isfinite(v), "must be greater than zero"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "min_p": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "top_k": (lambda v: v >= -1, "must be 0 (disable), -1, or at least 1"),
    "min_tokens": (lambda v: v >= 0, "must be at least 0"),
    "truncate_prompt_tokens": (lambda v: v >= -1, "must be at least -1"),
}


def check(body: dict[str, Any]) -> None:
    """Refuse, as InvalidRequestError naming the field, what the engines would refuse or fail on."""
    for name, value in body.items():
        if name in _NOT_SAMPLING:
            continue
        _int64(name, value)
        bound = _BOUNDS.get(name)
        if bound is not None and _number(value) and not bound[0](value):
            raise InvalidRequestError(f"{name} {bound[1]}, got {value}", param=name)
    stop = body.get("stop")
    if isinstance(stop, list) and any(s == "" for s in stop) or stop == "":
        raise InvalidRequestError("stop cannot contain an empty string", param="stop")
    least, most = body.get("min_tokens"), body.get("max_completion_tokens", body.get("max_tokens"))
    if _number(least) and _number(most) and least > most:
        raise InvalidRequestError(f"min_tokens must be less than or equal to max_tokens={most}, got {least}",
                                  param="min_tokens")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int64(name: str, value: Any) -> None:
    """An integer outside int64, at the field or in its lists and maps (stop_token_ids, logit_bias, ...)."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, int) and not isinstance(item, bool) and not INT64_MIN <= item <= INT64_MAX:
            raise InvalidRequestError(f"{name} holds {item}, outside the 64-bit integers the engines take",
                                      param=name)
        if isinstance(item, list):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
