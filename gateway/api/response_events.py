"""A streamed chat answer as the Responses API's typed events:

    response.created, response.in_progress
    per text:      response.output_item.added, response.content_part.added, response.output_text.delta ...,
                   response.output_text.done, response.content_part.done, response.output_item.done
    per call:      response.output_item.added, response.function_call_arguments.delta ...,
                   response.function_call_arguments.done, response.output_item.done (one item per chat
                   tool-call index, its arguments accumulated)
    response.completed (or response.incomplete at max_output_tokens, response.failed on an engine error)

Every event carries `sequence_number`. The chat chunks come from the D leg as it relays D (`data:` frames, an
error event then `[DONE]` after a failure); the final event is sent only after `finish` (which stores the
response) has run, so a client that follows up at once with `previous_response_id` finds it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import msgspec

from gateway.api.responses import call_item, message_item, new_id, output_text, usage

log = logging.getLogger("gateway.api")
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
Finish = Callable[[str, list[dict[str, Any]], dict[str, Any] | None, str | None, dict[str, Any] | None],
                  Awaitable[dict[str, Any]]]


class ResponseEvents:
    """`start` is the response object in progress; `finish(status, output, usage, finish_reason, error)` returns
    the final one (after storing it). One output item per text run and one per tool call: a call's item is found
    by its chat `index`, so its argument fragments land in it whatever came between them (OpenAI's stream format
    lets calls interleave); call items stay open until text resumes or the answer ends."""

    def __init__(self, start: dict[str, Any], finish: Finish) -> None:
        self.start, self.finish = start, finish
        self.sequence = 0
        self.output: list[dict[str, Any]] = []        # every item so far, open or closed (output_index: position)
        self.text: int | None = None                  # the open message item's output index
        self.calls: dict[int, int] = {}               # open call items: chat tool-call index -> output index
        self.done: set[int] = set()                   # chat tool-call indexes whose item is closed
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
        if self.text is None and not piece.strip():
            self.blank += piece            # whitespace around tool calls is no message of its own
            return []
        out = []
        if self.text is None:
            out += self._close()
            self.text, self.pieces = self._open(message_item("", status="in_progress"), out), []
            out.append(self._event("response.content_part.added", item_id=self.output[self.text]["id"],
                                   output_index=self.text, content_index=0, part=output_text("")))
            piece, self.blank = self.blank + piece, ""
        self.pieces.append(piece)
        out.append(self._event("response.output_text.delta", item_id=self.output[self.text]["id"],
                               output_index=self.text, content_index=0, delta=piece, logprobs=[]))
        return out

    def _call_delta(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        key = call.get("index", 0)
        function = call.get("function") or {}
        if key in self.done:
            log.warning("response %s: arguments for tool call %s after its item closed, dropped",
                        self.start.get("id"), key)
            return out
        if key not in self.calls:
            if self.text is not None:
                out += self._close()
            self.blank = ""
            item = call_item({"id": call.get("id") or new_id("call"), "function": {"name": function.get("name")}},
                             status="in_progress")
            self.calls[key] = self._open(item, out)
        index = self.calls[key]
        item = self.output[index]
        if function.get("name") and not item["name"]:
            item["name"] = function["name"]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                   delta=function["arguments"]))
        return out

    def _open(self, item: dict[str, Any], out: list[bytes]) -> int:
        self.output.append(item)
        out.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        return len(self.output) - 1

    def _close(self) -> list[bytes]:
        """The open items' closing events, in output order."""
        out: list[bytes] = []
        for index in sorted([*self.calls.values(), *([self.text] if self.text is not None else [])]):
            item = self.output[index]
            if item["type"] == "message":
                text = "".join(self.pieces)
                done = self.output[index] = message_item(text, item_id=item["id"])
                out += [self._event("response.output_text.done", item_id=done["id"], output_index=index,
                                    content_index=0, text=text, logprobs=[]),
                        self._event("response.content_part.done", item_id=done["id"], output_index=index,
                                    content_index=0, part=output_text(text)),
                        self._event("response.output_item.done", output_index=index, item=done)]
                continue
            item["status"] = "completed"
            out += [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=item["name"], arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        self.done.update(self.calls)
        self.text, self.calls = None, {}
        return out

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
