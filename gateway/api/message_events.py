"""A streamed chat answer as the Messages API's events, `event: NAME` + `data: JSON` each:

    message_start                              the message, empty, with its input tokens
    content_block_start, content_block_delta ..., content_block_stop
                                               per text block (text_delta) and per tool call (tool_use,
                                               input_json_delta with the arguments as they come): one block
                                               per chat tool-call index
    message_delta                              stop_reason, stop_sequence, output tokens
    message_stop
An engine failure after the first byte ends the stream with an `error` event (Anthropic's error shape).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from gateway.api.messages import message, stop_reason
from gateway.api.response_events import DONE, payloads

log = logging.getLogger("gateway.api")
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class MessageEvents:
    """One content block per text run and one per tool call: a call's block is found by its chat `index`, so its
    argument fragments land in it whatever came between them (OpenAI's stream format lets calls interleave), and
    stays open until text resumes or the answer ends."""

    def __init__(self, message_id: str, model: str, input_tokens: int, cached_tokens: int = 0) -> None:
        self.message_id, self.model = message_id, model
        self.input_tokens, self.cached_tokens = input_tokens, cached_tokens
        self.blocks = 0                       # content blocks started so far (the next one's index)
        self.text: int | None = None          # the open text block's index
        self.calls: dict[int, int] = {}       # open tool_use blocks: chat tool-call index -> block index
        self.done: set[int] = set()           # chat tool-call indexes whose block is closed
        self.finish: str | None = None
        self.matched: Any = None
        self.output_tokens = 0
        self.error: dict[str, Any] | None = None
        self.blank = ""                       # whitespace not yet shown

    async def relay(self, chat: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        start = message(self.message_id, self.model, content=[], stop=(None, None), input_tokens=self.input_tokens,
                        output_tokens=0, cached_tokens=self.cached_tokens)
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
            if piece and self.text is None and not piece.strip():
                self.blank += piece            # whitespace around tool calls is no text block of its own
            elif piece:
                if self.text is None:
                    out += self._close()
                    self.text = self._start({"type": "text", "text": ""}, out)
                    piece, self.blank = self.blank + piece, ""
                out.append(_event("content_block_delta", index=self.text,
                                  delta={"type": "text_delta", "text": piece}))
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            self.finish = choice.get("finish_reason") or self.finish
            self.matched = choice.get("stop_reason", self.matched)
        return out

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        key = call.get("index", 0)
        function = call.get("function") or {}
        if key in self.done:
            log.warning("message %s: arguments for tool call %s after its block closed, dropped",
                        self.message_id, key)
            return out
        if key not in self.calls:
            if self.text is not None:
                out += self._close()
            self.blank = ""
            block = {"type": "tool_use", "id": call.get("id") or f"toolu_{self.message_id}_{self.blocks}",
                     "name": function.get("name") or "", "input": {}}
            self.calls[key] = self._start(block, out)
        if function.get("arguments"):
            out.append(_event("content_block_delta", index=self.calls[key],
                              delta={"type": "input_json_delta", "partial_json": function["arguments"]}))
        return out

    def _start(self, block: dict[str, Any], out: list[bytes]) -> int:
        out.append(_event("content_block_start", index=self.blocks, content_block=block))
        self.blocks += 1
        return self.blocks - 1

    def _close(self) -> list[bytes]:
        """Stop every open block, in block order."""
        open_ = sorted([*self.calls.values(), *([self.text] if self.text is not None else [])])
        self.done.update(self.calls)
        self.text, self.calls = None, {}
        return [_event("content_block_stop", index=index) for index in open_]


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode({"type": kind, **fields}) + b"\n\n"
