"""One push-mode pair (docs/protocol.md §8.2): the request id its two legs share, and P's identity as D's leg
names it. A new pair, and a new id, for every attempt at the pair; the id is the gateway's own, never the
client's X-Request-Id alone (two dispatches with one id can pair one prompt's KV with another's blocks)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from gateway.engines import kv


@dataclass(frozen=True)
class PushPair:
    request_id: str                   # the X-Request-Id of both legs
    target: kv.PushTarget | None      # P's identity; None: not known yet, so P goes first and its handle says it
    decode_wait_s: float              # D's own deadline: vLLM never ends a D waiting for a WRITE

    @classmethod
    def new(cls, client_request_id: str, target: kv.PushTarget | None, decode_wait_s: float) -> PushPair:
        # the client's id first, for the engines' logs; vLLM strips only its own `-<8 hex>` when pairing
        return cls(f"{client_request_id}-pair-{secrets.token_hex(8)}", target, decode_wait_s)
