"""What is wrong with a JSON body's text when the decoder refuses it, said in the client's terms: which field
holds bytes that are not UTF-8, or a `\\uD800`-style escape that is half of a surrogate pair.

msgspec reports both as it meets them deep inside its scan ("Invalid UTF-8 encoded string", "Input data was
truncated", "unexpected end of hex escape"), without a place, and an invalid byte inside a value that is only
decoded later surfaced as an unhandled error (HTTP 500). This module finds the first such fault and the JSON
path of the value holding it. Used only on the error path, so it may be slow: a walk over the bytes in Python.
"""

from __future__ import annotations

import re

# A \\u escape of a high surrogate not followed by an escaped low one, or a low one on its own. The lookbehind
# skips an escaped backslash (`\\\\ud800` is the text "\\ud800", not an escape).
_LONE_SURROGATE = re.compile(
    rb"(?<!\\)(?:\\\\)*\\u(d[89ab][0-9a-f]{2})(?!\\ud[c-f][0-9a-f]{2})"
    rb"|(?<!\\)(?:\\\\)*(?<!\\ud[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})", re.I)


def fault(raw: bytes) -> tuple[str, str | None] | None:
    """(what is wrong, the JSON path of the value holding it) for the first invalid UTF-8 byte or lone
    surrogate escape in `raw`; None when the text has neither (the decoder's own message then says it)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        path = path_at(raw, exc.start)
        return f"{_where(path)} is not valid UTF-8 text (it holds the byte 0x{raw[exc.start]:02x})", path
    match = _LONE_SURROGATE.search(raw)
    if match is None:
        return None
    escape = (match.group(1) or match.group(2)).decode()
    offset = match.end() - 6
    path = path_at(raw, offset)
    half = "high" if match.group(1) else "low"
    return (f"{_where(path)} holds the escape \\u{escape}, half of a UTF-16 surrogate pair without its other half "
            f"(a {half} surrogate alone is not a character): send the character itself, or both escapes of "
            "its pair"), path


def _where(path: str | None) -> str:
    return f"`{path}`" if path else "the request body"


def path_at(raw: bytes, offset: int) -> str | None:
    """The path (`messages[0].content`, `model`; a key's own bytes count as its value's) of the innermost value
    whose text contains byte `offset`; None at the top level or when the text breaks off before it."""
    stack: list[str | int | None] = []   # per open container: the current key (object) or index (array)
    kinds: list[str] = []
    i, n = 0, min(len(raw), offset + 1)
    expecting_key = False
    while i < n:
        c = raw[i]
        if c == 0x22:                                    # a string: a key, or a value
            end = _string_end(raw, i)
            if expecting_key and kinds and kinds[-1] == "{":
                stack[-1] = raw[i + 1:end].decode("utf-8", "replace")
                expecting_key = False
            if end >= offset:
                return _render(stack)
            i = end + 1
            continue
        if c in b"{[":
            kinds.append(chr(c))
            stack.append(None if c == 0x7B else 0)
            expecting_key = c == 0x7B
        elif c in b"}]":
            if kinds:
                kinds.pop()
                stack.pop()
        elif c == 0x2C and kinds:                        # a comma: next key, or next index
            if kinds[-1] == "{":
                expecting_key = True
            else:
                stack[-1] = (stack[-1] or 0) + 1
        i += 1
    return _render(stack)


def _string_end(raw: bytes, start: int) -> int:
    """The index of the quote closing the string that opens at `start` (or the last byte if it never closes)."""
    i = start + 1
    while i < len(raw):
        if raw[i] == 0x5C:
            i += 2
            continue
        if raw[i] == 0x22:
            return i
        i += 1
    return len(raw) - 1


def _render(stack: list[str | int | None]) -> str | None:
    out = ""
    for part in stack:
        if part is None:
            break
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or None
