"""A turn's request as the gateway runs it: the client's body, cleaned, and the prompt ids it verified."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import msgspec

from gateway.store import Answer
from gateway.turns.intake.clock import TurnClock

Endpoint = Literal["/v1/chat/completions", "/v1/completions"]

_PROMPT_IDS_KEY = b'"prompt_token_ids":'
_decode = msgspec.json.Decoder().decode


@dataclass
class TurnRequest:
    endpoint: Endpoint
    body: dict[str, Any]              # the client's body, minus session fields and kv_transfer_params
    model: str
    prompt_ids: list[int]             # what the gateway rendered and verified
    stream: bool
    want_token_ids: bool              # the client itself asked for return_token_ids
    include_usage: bool
    request_id: str
    # history_tokens "generated": renders again with past answers as D generated them (see generated.py)
    rerender: Callable[[list[Answer]], list[int]] | None = None
    # the gateway's own time on this turn (pdgw_gateway_seconds); the handler gives one that reports
    clock: TurnClock = field(default_factory=lambda: TurnClock(None))
    # called with D's answer as captured (a legs.capture.DecodeCapture) once the turn's outcome is recorded,
    # before the client's end of stream: the Responses API keeps D's exact ids with its stored response
    on_recorded: Callable[[Any], None] | None = None

    @cached_property
    def prompt_json(self) -> bytes:
        """The prompt ids as JSON, once per turn: joined from the rendering's cached pieces when it has them."""
        return getattr(self.prompt_ids, "as_json", None) or msgspec.json.encode(self.prompt_ids)

    @cached_property
    def forwarded(self) -> dict[str, Any]:
        """The body both legs start from, its bulky parts (the history, the ids) encoded once for both."""
        body = dict(self.body)
        messages = body.get("messages")
        if isinstance(messages, list):     # parsed messages carry their encoding already (turns/intake/message_cache.py)
            body["messages"] = msgspec.Raw(getattr(messages, "json", None) or msgspec.json.encode(messages))
        return body

    @cached_property
    def stubbed(self) -> dict[str, Any]:
        """`forwarded` with only the last message, for an engine proven to use the pinned ids (docs/protocol.md
        §5.1): the ids carry the history, so its text would be bytes the engine never reads."""
        body = dict(self.forwarded)
        messages = self.body.get("messages")
        if isinstance(messages, list) and len(messages) > 1:
            body["messages"] = msgspec.Raw(msgspec.json.encode(messages[-1:]))
        return body

    def decode_answer(self, raw: bytes) -> dict[str, Any]:
        """An engine's JSON answer (or SSE event) as a dict. A top-level `prompt_token_ids` that is byte for byte
        this request's own encoding becomes `self.prompt_ids` itself: an echo of a 32k-token prompt then costs
        a memory compare, not decoding and comparing 32k ints."""
        at = raw.find(_PROMPT_IDS_KEY) if self.endpoint == "/v1/chat/completions" else -1
        if at < 0:
            return _decode(raw)
        start = at + len(_PROMPT_IDS_KEY)
        end = start + len(self.prompt_json)
        if (raw[start:end] != self.prompt_json or raw[end:end + 1] not in (b",", b"}")
                or raw.find(_PROMPT_IDS_KEY, end) >= 0 or raw.rfind(_PROMPT_IDS_KEY, 0, at) >= 0):
            return _decode(raw)                   # another key of that name: nothing clever
        answer = _decode(raw[:at] + b'"prompt_token_ids":null' + raw[end:])
        if answer.get("prompt_token_ids", 0) is not None:     # the key sat in a nested object: decode plainly
            return _decode(raw)
        answer["prompt_token_ids"] = self.prompt_ids
        return answer
