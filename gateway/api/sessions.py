"""Which conversation a request names: the session id, from the configured header, else from a header a coding
agent sends of its own accord (`agent_session_headers`), else from the body's `conversation_id` / `session_id`.

A session id names a run, not always one conversation: Claude Code sends one id per process for its main loop
and its side requests (titles, command checks, subagents), OpenCode its `X-Session-Id` for its main loop and its
title request, each with a system prompt and tools of their own. So a session id is scoped by a digest of the
conversation's head, the system prompt and the tools that open every prompt: `<id>#<16 hex>`, one conversation
per head in the run, and a side request never takes the main loop's handle (it could not have reused it: its
prompt differs from the first token on). `session_scope: exact` keeps the configured header's and the body's
ids as given; a harness header is always scoped.
"""

from __future__ import annotations

from hashlib import blake2b
from typing import Any

import msgspec

from gateway.config import SessionScope
from gateway.errors import InvalidRequestError

MAX_SESSION_CHARS = 256
MAX_SCOPED_SESSION_CHARS = MAX_SESSION_CHARS - 17          # room for the head's digest
_encode = msgspec.json.Encoder().encode


def session_id(headers: Any, body: dict[str, Any], header: str, agent_headers: list[str],
               system: bytes | None = None, tools: Any = None, scope: SessionScope = "head") -> str | None:
    """`system`: the system prompt's bytes when the caller has them (Responses' instructions, Messages' system);
    else the first chat message when it is a system message. `tools`: the request's tools (chat's, as sent to the
    engines); None: the body's."""
    given = headers.get(header)
    exact = scope == "exact"
    if given is None:
        for name in agent_headers:
            value = headers.get(name)
            if value:
                given, exact = value, False
                break
        else:
            given = body.get("conversation_id") or body.get("session_id")
    if given is None:
        return None
    if exact:
        return _checked(given, MAX_SESSION_CHARS)
    head = _head(system, body.get("tools") if tools is None else tools, body)
    return f"{_checked(given, MAX_SCOPED_SESSION_CHARS)}#{head}"


def _checked(session: Any, limit: int) -> str:
    if not isinstance(session, str) or not 0 < len(session) <= limit:
        raise InvalidRequestError(f"session id must be a string of 1..{limit} characters", param="session_id")
    return session


def _head(system: bytes | None, tools: Any, body: dict[str, Any]) -> str:
    if system is None:
        messages = body.get("messages") or ()
        first = messages[0] if messages else None
        system = b""
        if isinstance(first, dict) and first.get("role") in ("system", "developer"):
            known = getattr(messages, "known", None)     # parsed messages carry their bytes (intake/message_cache.py)
            system = known[0].json if known else _encode(first)
    digest = blake2b(system, digest_size=8)
    if tools:
        digest.update(b"\x00tools\x00" + _encode(tools))
    return digest.hexdigest()
