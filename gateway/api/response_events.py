"""A streamed chat answer as the Responses API's typed events:

    response.created, response.in_progress
    per text:      response.output_item.added, response.content_part.added, response.output_text.delta ...,
                   response.output_text.done, response.content_part.done, response.output_item.done
    per call:      response.output_item.added, response.function_call_arguments.delta ...,
                   response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete at max_output_tokens, response.failed on an engine error)

Every event carries `sequence_number`. The chat chunks come from the D leg as it relays D (`data:` frames, an
error event then `[DONE]` after a failure); the final event is sent only after `finish` (which stores the
response) has run, so a client that follows up at once with `previous_response_id` finds it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import msgspec

from gateway.api.responses import call_item, message_item, new_id, output_text, usage

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
Finish = Callable[[str, list[dict[str, Any]], dict[str, Any] | None, str | None, dict[str, Any] | None],
                  Awaitable[dict[str, Any]]]


class ResponseEvents:
    """`start` is the response object in progress; `finish(status, output, usage, finish_reason, error)` returns
    the final one (after storing it)."""

    def __init__(self, start: dict[str, Any], finish: Finish) -> None:
        self.start, self.finish = start, finish
        self.sequence = 0
        self.output: list[dict[str, Any]] = []        # closed items, in order
        self.item: dict[str, Any] | None = None       # the item being streamed (output_index: len(output))
        self.key: str | int | None = None             # "text", or the chat tool-call index it streams
        self.pieces: list[str] = []                   # the open message's text so far
        self.blank = ""                               # whitespace not yet shown: the text between calls
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None

    async def relay(self, chat: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        yield self._event("response.created", response=self.start)
        yield self._event("response.in_progress", response=self.start)
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
        tail = self._close()
        status = "failed" if self.error else "completed"
        final = await self.finish(status, self.output, self.usage, self.finish_reason, self.error)
        kind = {"failed": "response.failed", "incomplete": "response.incomplete"}.get(final["status"],
                                                                                      "response.completed")
        yield b"".join([*tail, self._event(kind, response=final)])

    # -- chat chunks ---------------------------------------------------------------------------------------
    def _chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        if "error" in chunk:
            self.error = {"code": (chunk["error"] or {}).get("code") or "server_error",
                          "message": (chunk["error"] or {}).get("message") or "the engine failed"}
            return []
        if chunk.get("usage"):
            self.usage = usage(chunk["usage"])
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call_delta(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return out

    def _text_delta(self, piece: str) -> list[bytes]:
        if self.key != "text" and not piece.strip():
            self.blank += piece            # whitespace around tool calls is no message of its own
            return []
        out = []
        if self.key != "text":
            out += self._close()
            self.item, self.key, self.pieces = message_item("", status="in_progress"), "text", []
            out.append(self._event("response.output_item.added", output_index=len(self.output), item=self.item))
            out.append(self._event("response.content_part.added", item_id=self.item["id"],
                                   output_index=len(self.output), content_index=0, part=output_text("")))
            piece, self.blank = self.blank + piece, ""
        self.pieces.append(piece)
        out.append(self._event("response.output_text.delta", item_id=self.item["id"], output_index=len(self.output),
                               content_index=0, delta=piece, logprobs=[]))
        return out

    def _call_delta(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        key = call.get("index", 0)
        function = call.get("function") or {}
        if self.key != key:
            out += self._close()
            self.blank = ""
            self.item = call_item({"id": call.get("id") or new_id("call"), "function": {"name": function.get("name")}},
                                  status="in_progress")
            self.key = key
            out.append(self._event("response.output_item.added", output_index=len(self.output), item=self.item))
        elif function.get("name"):
            self.item["name"] = function["name"]
        if function.get("arguments"):
            self.item["arguments"] += function["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=self.item["id"],
                                   output_index=len(self.output), delta=function["arguments"]))
        return out

    def _close(self) -> list[bytes]:
        """The open item's closing events; it joins the output."""
        item, index = self.item, len(self.output)
        if item is None:
            return []
        self.item, self.key = None, None
        if item["type"] == "message":
            text = "".join(self.pieces)
            done = message_item(text, item_id=item["id"])
            self.output.append(done)
            return [self._event("response.output_text.done", item_id=done["id"], output_index=index,
                                content_index=0, text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=done["id"], output_index=index,
                                content_index=0, part=output_text(text)),
                    self._event("response.output_item.done", output_index=index, item=done)]
        item["status"] = "completed"
        self.output.append(item)
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _event(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        body = _encode({"type": kind, "sequence_number": self.sequence - 1, **fields})
        return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


DONE = b"[DONE]"


def payloads(frames: bytes) -> list[bytes]:
    """The `data:` payloads of whole SSE events (the D leg yields whole events, several per write at times)."""
    out = []
    for event in frames.split(b"\n\n"):
        data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))
    return out
