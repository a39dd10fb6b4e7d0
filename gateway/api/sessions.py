"""Which conversation a request names: the session id, from the configured header, else from a header a coding
agent sends of its own accord (`agent_session_headers`), else from the body's `conversation_id` / `session_id`.

An agent harness's id names its run, not one conversation: Claude Code sends one id per process for its main loop
and its side requests (titles, command checks, subagents), each with a system prompt of its own. So a harness id
is scoped by a digest of the request's system prompt: `<id>#<16 hex>`, one conversation per system prompt in
the run, and a side request never takes the main loop's handle. The configured header stays exact.
"""

from __future__ import annotations

from hashlib import blake2b
from typing import Any

import msgspec

from gateway.errors import InvalidRequestError

MAX_SESSION_CHARS = 256
MAX_AGENT_SESSION_CHARS = MAX_SESSION_CHARS - 17          # room for the system prompt's digest
_encode = msgspec.json.Encoder().encode


def session_id(headers: Any, body: dict[str, Any], header: str, agent_headers: list[str],
               system: bytes | None = None) -> str | None:
    """`system`: the system prompt's bytes when the caller has them (Responses' instructions, Messages' system);
    else the first chat message when it is a system message."""
    given = headers.get(header)
    if given is not None:
        return _checked(given, MAX_SESSION_CHARS)
    for name in agent_headers:
        value = headers.get(name)
        if value:
            return f"{_checked(value, MAX_AGENT_SESSION_CHARS)}#{_digest(system, body)}"
    given = body.get("conversation_id") or body.get("session_id")
    return None if given is None else _checked(given, MAX_SESSION_CHARS)


def _checked(session: Any, limit: int) -> str:
    if not isinstance(session, str) or not 0 < len(session) <= limit:
        raise InvalidRequestError(f"session id must be a string of 1..{limit} characters", param="session_id")
    return session


def _digest(system: bytes | None, body: dict[str, Any]) -> str:
    if system is None:
        messages = body.get("messages") or ()
        first = messages[0] if messages else None
        system = b""
        if isinstance(first, dict) and first.get("role") in ("system", "developer"):
            known = getattr(messages, "known", None)     # parsed messages carry their bytes (intake/messages.py)
            system = known[0].json if known else _encode(first)
    return blake2b(system, digest_size=8).hexdigest()
