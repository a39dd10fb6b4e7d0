"""Per-gateway bounds: turns in flight and prompt tokens waiting for their prefill. Beyond them a turn is
refused at once with 429 and Retry-After, rather than queued in unbounded memory."""

from __future__ import annotations

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
