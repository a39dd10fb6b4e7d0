"""What D's answer tells the gateway, read as it passes through to the client."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.engines import kv
from gateway.turns.legs.bodies import prompt_ids_of
from gateway.turns.intake.tools import merge_calls

# Engine-internal fields a client never sees unless it asked for token ids.
_TOKEN_FIELDS = ("prompt_token_ids", "token_ids")


@dataclass
class DecodeCapture:
    """What D's answer tells the gateway: its real prompt ids, its output ids, its handle, how it ended."""
    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    handle: kv.Handle | None = None
    finish_reason: str | None = None
    error: bool = False
    output_ids_seen: bool = False
    text: list[str] = field(default_factory=list)      # the answer's text as the client got it
    tool_calls: list[dict[str, Any]] = field(default_factory=list)     # and its tool calls
    cached_tokens: int = 0          # the turn's prompt tokens not computed (`Turn.cached_tokens`), for usage

    def _usage(self, payload: dict[str, Any]) -> None:
        """The answer's usage tells the client what was reused, as OpenAI's cache does: D's own figure (where it
        reports one) counts every token P sent it as cached, so the gateway's own replaces it."""
        usage = payload.get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}),
                                              "cached_tokens": self.cached_tokens}

    def take(self, payload: dict[str, Any], want_token_ids: bool) -> dict[str, Any]:
        """Record one response or chunk, and return the client's view of it (engine internals removed)."""
        if "error" in payload:
            self.error = True
            return payload
        self.handle = kv.take(payload) or self.handle
        self._usage(payload)
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
