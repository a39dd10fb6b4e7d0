"""Server-sent-event framing as vLLM writes it: `data: <payload>\n\n` per event."""

from __future__ import annotations

DONE = b"[DONE]"


class EventSplitter:
    """Cuts a byte stream into SSE event payloads (the `data:` lines of each event, joined)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        if not self._buffer and (events := _whole_frames(chunk)) is not None:
            return events
        # A big event arriving in many reads is appended and scanned once, not re-copied and re-scanned per read.
        start = max(0, len(self._buffer) - 1)
        self._buffer += chunk
        events = []
        while True:
            end = self._buffer.find(b"\n\n", start)
            if end < 0:
                return events
            raw = bytes(self._buffer[:end])
            del self._buffer[:end + 2]
            start = 0
            data = [line[5:].lstrip(b" ") for line in raw.split(b"\n") if line.startswith(b"data:")]
            if data:
                events.append(b"\n".join(data))


def _whole_frames(chunk: bytes) -> list[bytes] | None:
    """The payloads of a read that is whole `data: <payload>\n\n` frames and nothing else (how vLLM writes,
    nearly every read), cut without the general parser; None: anything else (a partial frame, other fields,
    several data lines, a second space after the colon), for the general parser."""
    if not (chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")) or b"data:  " in chunk:
        return None
    events = chunk[6:-2].split(b"\n\ndata: ")
    # Every newline is a frame's end: no frame holds a line but its `data:` line.
    return events if chunk.count(b"\n") == 2 * len(events) else None


def frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
