"""Per-gateway bounds: turns in flight and prompt tokens waiting for their prefill. Beyond them a turn is
refused at once with 429 and Retry-After, rather than queued in unbounded memory. And per D, the P path's D legs
waiting for their first token (`Handovers`): beyond that bound a leg waits its turn."""

from __future__ import annotations

import asyncio

from gateway.errors import OverloadedError

RETRY_AFTER_S = "1"


class Admission:
    def __init__(self, max_turns: int, max_queued_tokens: int) -> None:
        self.max_turns, self.max_queued_tokens = max_turns, max_queued_tokens
        self.turns = 0
        self.queued_tokens = 0

    def admit(self, prompt_tokens: int) -> Ticket:
        if self.turns >= self.max_turns:
            raise OverloadedError("too many turns in flight; retry shortly", headers={"Retry-After": RETRY_AFTER_S})
        if self.queued_tokens and self.queued_tokens + prompt_tokens > self.max_queued_tokens:
            raise OverloadedError("too many prompt tokens waiting for prefill; retry shortly",
                                  headers={"Retry-After": RETRY_AFTER_S})
        self.turns += 1
        self.queued_tokens += prompt_tokens
        return Ticket(self, prompt_tokens)


class Ticket:
    """A turn's hold on the bounds: its tokens leave the queue once prefilled, its slot when it ends."""

    def __init__(self, admission: Admission, prompt_tokens: int) -> None:
        self._admission, self._tokens, self._open = admission, prompt_tokens, True

    def prefilled(self) -> None:
        self._admission.queued_tokens -= self._tokens
        self._tokens = 0

    def close(self) -> None:
        if self._open:
            self._open = False
            self.prefilled()
            self._admission.turns -= 1


class Handovers:
    """Per D, the P path's D legs waiting for their first token while D reads P's KV: at most `limit` at once
    (`--decode-handover-limit`; 0: no limit), the rest sent in arrival order. On the H200 a burst's reads on D
    progressed together and finished together, after P's last answer (bench/GPU-RESULTS.md, "Where a burst's
    first turns wait"); a few at a time, they finish in order at the same total."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._gates: dict[str, asyncio.Semaphore] = {}

    async def enter(self, decode: str, first_byte_s: float) -> Slot | None:
        """Before a P-path D leg is sent to `decode` (None: no limit). The slot is freed at the first token or the
        leg's end, and at the latest when no first token can come any more (a stream no one read to its end must
        not hold it for good)."""
        if self.limit <= 0:
            return None
        gate = self._gates.setdefault(decode, asyncio.Semaphore(self.limit))
        await gate.acquire()
        return Slot(gate, first_byte_s)


class Slot:
    """One D leg's place among its D's hand-overs: released once, by the leg or by its timer."""

    def __init__(self, gate: asyncio.Semaphore, within_s: float) -> None:
        self._gate: asyncio.Semaphore | None = gate
        self._timer = asyncio.get_running_loop().call_later(within_s, self.release)

    def release(self) -> None:
        if self._gate is not None:
            self._gate.release()
            self._gate = None
            self._timer.cancel()
