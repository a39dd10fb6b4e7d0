"""D's streamed chunks on their way to the client: those that need no edit but the ids pass through as D's bytes.

A middle chunk of a streamed answer (one token: its text and, as the gateway asks D for them, its `token_ids`)
needs nothing of the gateway but to be read and, unless the client asked for them, to lose its ids. Such a
chunk is read into a small typed view (msgspec skips every field it does not name) and relayed as D's own
bytes, the ids' span cut out of them when the client must not see it. Everything else goes the whole way
(`DecodeCapture.take`: decoded, edited, re-encoded): the first chunk (D's echo of the prompt ids), the last
(finish reason, D's handle), errors, tool calls, anything not of the plain shape (byte checks decide,
conservatively). Most chunks of a streamed answer are middle chunks whose ids go: the whole way costs 3.9 µs a
chunk in process against 3.2 for the view and the cut, and more in the relay's loop (bench/README.md, issue 29).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from gateway.turns.legs.capture import DecodeCapture


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []


_view = msgspec.json.Decoder(_Chunk).decode
_encode = msgspec.json.Encoder().encode


def relay(capture: DecodeCapture, raw: bytes, want_token_ids: bool,
          decode: Callable[[bytes], dict[str, Any]]) -> bytes:
    """The client's payload for one of D's SSE payloads, the capture told what it says. `decode`: the whole way's
    decoder (`TurnRequest.decode_answer`)."""
    passed = _pass_through(capture, raw, want_token_ids)
    if passed is not None:
        return passed
    return _encode(capture.take(decode(raw), want_token_ids))


def _pass_through(capture: DecodeCapture, raw: bytes, want_token_ids: bool) -> bytes | None:
    """D's own bytes for a plain middle chunk (its ids cut out unless wanted), its text and ids captured; None:
    otherwise."""
    # Keys that send a chunk the whole way. A false alarm (the text inside a string) only costs the whole way; a
    # real key always shows as these bytes, since a quote inside a JSON string is escaped. (Spelt out: a loop
    # over a tuple of them costs more than the whole way's decode and encode of a small chunk.)
    if (b'"kv_transfer_params"' in raw or b'"prompt_token_ids"' in raw or b'"error"' in raw
            or b'"tool_calls"' in raw or b'"message"' in raw):
        return None
    try:
        chunk = _view(raw)
    except msgspec.DecodeError:         # not the shape named here (a list, a string where text was): whole way
        return None
    if len(chunk.choices) != 1:
        return None
    choice = chunk.choices[0]
    if choice.finish_reason is not None:
        return None
    out = raw
    if choice.token_ids is not None:
        if not want_token_ids and (out := _without_ids(raw)) is None:
            return None
        capture.output_ids_seen = True
        capture.output_ids.extend(choice.token_ids)
    elif not want_token_ids and b'"token_ids"' in raw:
        return None        # ids somewhere the view does not look: the whole way removes what it must
    piece = choice.delta.content if choice.delta is not None else choice.text
    if piece:
        capture.text.append(piece)
    return out


_IDS = b',"token_ids":['


def _without_ids(raw: bytes) -> bytes | None:
    """`raw` less its `"token_ids"` member, laid out as vLLM writes it (after another member, no spaces); None:
    any other layout. A quote inside a JSON string is escaped, so these bytes occur only as the key or as a string
    of exactly that text: one occurrence is the choice's own member, which the view read as a list of ints (so it
    ends at the next `]`)."""
    at = raw.find(_IDS)
    if at < 0 or raw.count(b'"token_ids"') != 1:
        return None
    end = raw.find(b"]", at + len(_IDS))
    return raw[:at] + raw[end + 1:]
