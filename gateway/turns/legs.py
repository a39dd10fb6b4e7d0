"""The two legs of a turn as vLLM wants them (PROTOCOL.md §3): request bodies, and what to read back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import msgspec

from gateway.store import Answer
from gateway.turns.tools import merge_calls

Endpoint = Literal["/v1/chat/completions", "/v1/completions"]

# Fields that only make sense on the leg that produces the client's answer.
_DECODE_ONLY = ("stream", "stream_options", "min_tokens", "max_completion_tokens", "logprobs", "top_logprobs")
# Engine-internal fields a client never sees unless it asked for token ids.
_TOKEN_FIELDS = ("prompt_token_ids", "token_ids")
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

    @cached_property
    def prompt_json(self) -> bytes:
        """The prompt ids as JSON, once per turn: joined from the rendering's cached pieces when it has them."""
        return getattr(self.prompt_ids, "as_json", None) or msgspec.json.encode(self.prompt_ids)

    @cached_property
    def forwarded(self) -> dict[str, Any]:
        """The body both legs start from, its bulky parts (the history, the ids) encoded once for both."""
        body = dict(self.body)
        if isinstance(body.get("messages"), list):
            body["messages"] = msgspec.Raw(msgspec.json.encode(body["messages"]))
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


def prefill_body(req: TurnRequest, params: dict[str, Any], *, confirm_ids: bool = True) -> dict[str, Any]:
    """P's leg. The history and the ids are msgspec.Raw (already-encoded JSON) shared with D's leg.
    `confirm_ids`: have P echo its prompt ids (checked when P reads D's KV; otherwise an echo of the whole
    prompt, 32k ids for a 32k-token history, would be received for nothing)."""
    body = {k: v for k, v in req.forwarded.items() if k not in _DECODE_ONLY}
    body.update(max_tokens=1, stream=False, return_token_ids=confirm_ids, kv_transfer_params=_pinned(req, params))
    return _with_prompt(req, body)


def decode_body(req: TurnRequest, prefill_handle: dict[str, Any] | None) -> dict[str, Any]:
    body = dict(req.forwarded)
    body.update(return_token_ids=True, kv_transfer_params=_pinned(req, prefill_handle or {}))
    return _with_prompt(req, body)


def _pinned(req: TurnRequest, params: dict[str, Any]) -> dict[str, Any]:
    """vLLM 0.32+ chat uses kv_transfer_params.prompt_token_ids instead of rendering: the verified ids."""
    if req.endpoint != "/v1/chat/completions":
        return params
    return {**params, "prompt_token_ids": msgspec.Raw(req.prompt_json)}


def _with_prompt(req: TurnRequest, body: dict[str, Any]) -> dict[str, Any]:
    if req.endpoint == "/v1/completions":
        body["prompt"] = msgspec.Raw(req.prompt_json)
    return body


def prompt_ids_of(response: dict[str, Any]) -> list[int] | None:
    """Chat puts prompt ids at the top level, completions in the choice."""
    ids = response.get("prompt_token_ids")
    if ids is None and response.get("choices"):
        ids = response["choices"][0].get("prompt_token_ids")
    return ids


@dataclass
class DecodeCapture:
    """What D's answer tells the gateway: its real prompt ids, its output ids, its handle, how it ended."""
    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    handle: dict[str, Any] | None = None
    finish_reason: str | None = None
    error: bool = False
    output_ids_seen: bool = False
    text: list[str] = field(default_factory=list)      # the answer's text as the client got it
    tool_calls: list[dict[str, Any]] = field(default_factory=list)     # and its tool calls

    def take(self, payload: dict[str, Any], want_token_ids: bool) -> dict[str, Any]:
        """Record one response or chunk, and return the client's view of it (engine internals removed)."""
        if "error" in payload:
            self.error = True
            return payload
        self.handle = payload.pop("kv_transfer_params", None) or self.handle
        if self.prompt_ids is None:
            self.prompt_ids = prompt_ids_of(payload)
        for choice in payload.get("choices") or ():
            ids = choice.get("token_ids")
            if ids is not None:
                self.output_ids_seen = True
                self.output_ids.extend(ids)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            message = choice.get("message") or choice.get("delta") or {}
            piece = message.get("content") if message else choice.get("text")
            if piece:
                self.text.append(piece)
            merge_calls(self.tool_calls, message.get("tool_calls"))
            if not want_token_ids:
                for key in _TOKEN_FIELDS:
                    choice.pop(key, None)
        if not want_token_ids:
            payload.pop("prompt_token_ids", None)
        return payload

    @property
    def finished(self) -> bool:
        return not self.error and self.finish_reason in ("stop", "length", "tool_calls")
