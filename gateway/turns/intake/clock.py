"""The gateway's own share of a turn's latency, measured inside it: the time a turn spends in the gateway's code
rather than waiting for an engine or the client.

Spans (`pdgw_gateway_seconds{span=...}`), each observed once per turn when the client gets its first byte:
- `to_prefill`: request in (the handler starts) -> P's request body encoded, handed to aiohttp;
- `prefill_to_decode`: P's answer read -> D's request body encoded, handed to aiohttp;
- `to_decode`: request in -> D's request body encoded, on a turn without a P leg (the local path);
- `to_client`: D's first byte (a streamed leg's first event; a JSON leg's whole answer read) -> the client's
  first byte handed to the ASGI server;
- `internal`: request in -> client's first byte, minus every wait for an engine (failed attempts included).
  Without retries it is the sum of the three spans; with them it still counts only the gateway's own time.

End-to-end added latency (bench/compare.py) also holds the loopback hops, the server's parsing and the cores
the gateway takes from the engines; this separates those from the code's own cost. aiohttp's own write and
read of a leg count as engine wait here (they sit between the marks), which is small beside the legs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import Histogram

SPANS = ("to_prefill", "prefill_to_decode", "to_decode", "to_client", "internal")
_now = time.perf_counter


class TurnClock:
    """Marks taken on one turn's critical path. Cheap: a perf_counter read per mark, no allocation."""

    __slots__ = ("_histogram", "_leg_began", "decode_first", "decode_sent", "delivered_at", "prefill_answered",
                 "prefill_sent", "received", "waited")

    def __init__(self, histogram: Histogram | None, received: float | None = None) -> None:
        self._histogram = histogram
        self.received = _now() if received is None else received
        self.prefill_sent = self.prefill_answered = self.decode_sent = self.decode_first = 0.0
        self.delivered_at = 0.0
        self.waited = 0.0                   # summed time spent waiting for engines
        self._leg_began: float | None = None

    # Passed to the engine client as callbacks: `*_out` once the body is encoded, just before aiohttp sends it;
    # `*_in` once the answer's bytes are read (P, JSON D) or D's first event is split out (streamed D).
    def prefill_out(self) -> None:
        self.prefill_sent = self._leg_out()

    def prefill_in(self) -> None:
        self.prefill_answered = self._leg_in()

    def decode_out(self) -> None:
        self.decode_sent = self._leg_out()

    def decode_in(self) -> None:
        now = self._leg_in()
        self.decode_first = self.decode_first or now

    def delivered(self) -> None:
        """The client's first byte was handed to the server: observe the spans (once per turn)."""
        if self.delivered_at:
            return
        now = self.delivered_at = _now()
        self._settle(now)
        if self._histogram is None:
            return
        for span, seconds in self.spans().items():
            self._histogram.labels(span).observe(seconds)

    def spans(self) -> dict[str, float]:
        """The spans whose two marks were both taken (a turn that failed before D answered has fewer)."""
        out = {}
        if self.prefill_sent:
            out["to_prefill"] = self.prefill_sent - self.received
        if self.prefill_answered and self.decode_sent >= self.prefill_answered:
            out["prefill_to_decode"] = self.decode_sent - self.prefill_answered
        elif self.decode_sent and not self.prefill_sent:
            out["to_decode"] = self.decode_sent - self.received
        if self.decode_first and self.delivered_at:
            out["to_client"] = self.delivered_at - self.decode_first
        if self.delivered_at:
            out["internal"] = self.delivered_at - self.received - self.waited
        return out

    def _leg_out(self) -> float:
        now = _now()
        self._settle(now)
        self._leg_began = now
        return now

    def _leg_in(self) -> float:
        now = _now()
        self._settle(now)
        return now

    def _settle(self, now: float) -> None:
        """Close an engine wait still open (a leg whose attempt ended without an `answered` mark)."""
        if self._leg_began is not None:
            self.waited += now - self._leg_began
            self._leg_began = None

