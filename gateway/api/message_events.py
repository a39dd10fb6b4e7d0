"""A streamed chat answer as the Messages API's events, `event: NAME` + `data: JSON` each:

    message_start                              the message, empty, with its input tokens
    content_block_start, content_block_delta ..., content_block_stop
                                               per text block (text_delta) and per tool call (tool_use,
                                               input_json_delta with the arguments as they come)
    message_delta                              stop_reason, stop_sequence, output tokens
    message_stop
An engine failure after the first byte ends the stream with an `error` event (Anthropic's error shape).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from gateway.api.messages import message, stop_reason
from gateway.api.response_events import DONE, payloads

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class MessageEvents:
    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self.message_id, self.model, self.input_tokens = message_id, model, input_tokens
        self.block = -1                       # index of the open content block (-1: none yet)
        self.open: str | None = None          # "text", or the chat tool-call index of the open tool_use block
        self.finish: str | None = None
        self.matched: Any = None
        self.output_tokens = 0
        self.error: dict[str, Any] | None = None
        self.blank = ""                       # whitespace not yet shown

    async def relay(self, chat: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        start = message(self.message_id, self.model, content=[], stop=(None, None), input_tokens=self.input_tokens,
                        output_tokens=0)
        yield _event("message_start", message=start)
        try:
            async for frame in chat:
                out = []
                for payload in payloads(frame):
                    if payload != DONE:
                        out += self._chunk(_decode(payload))
                if out:
                    yield b"".join(out)
        finally:
            await chat.aclose()
        if self.error is not None:
            yield b"".join([*self._close(), _event("error", error=self.error)])
            return
        stop, sequence = stop_reason(self.finish, self.matched)
        yield b"".join([*self._close(),
                        _event("message_delta", delta={"stop_reason": stop, "stop_sequence": sequence},
                               usage={"output_tokens": self.output_tokens}),
                        _event("message_stop")])

    def _chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        if "error" in chunk:
            self.error = {"type": "api_error", "message": (chunk["error"] or {}).get("message") or "the engine failed"}
            return []
        if chunk.get("usage"):
            self.output_tokens = chunk["usage"].get("completion_tokens") or self.output_tokens
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            piece = delta.get("content")
            if piece and self.open != "text" and not piece.strip():
                self.blank += piece            # whitespace around tool calls is no text block of its own
            elif piece:
                if self.open != "text":
                    out += self._start({"type": "text", "text": ""}, "text")
                    piece, self.blank = self.blank + piece, ""
                out.append(self._delta({"type": "text_delta", "text": piece}))
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            self.finish = choice.get("finish_reason") or self.finish
            self.matched = choice.get("stop_reason", self.matched)
        return out

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        index = f"call {call.get('index', 0)}"
        function = call.get("function") or {}
        if self.open != index:
            self.blank = ""
            block = {"type": "tool_use", "id": call.get("id") or f"toolu_{self.message_id}_{self.block + 1}",
                     "name": function.get("name") or "", "input": {}}
            out += self._start(block, index)
        if function.get("arguments"):
            out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return out

    def _start(self, block: dict[str, Any], kind: str) -> list[bytes]:
        out = self._close()
        self.block += 1
        self.open = kind
        return [*out, _event("content_block_start", index=self.block, content_block=block)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", index=self.block, delta=delta)

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.block)]


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode({"type": kind, **fields}) + b"\n\n"
