"""Synthetic multi-turn chats: what each simulated user says, deterministic per (seed, conversation, turn).

Text is drawn from a small word list; with the demo tokenizers one word is about WORD_TOKENS tokens, so a turn
of `new_tokens` tokens is `new_tokens / WORD_TOKENS` words. Every conversation opens with its own id, so no
two conversations share a prefix-cache block (the reuse figures then come from the conversation alone).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu apple river stone cloud light garden window "
    "silver orange purple market engine signal forest ocean valley summer winter number paper simple yellow"
).split()
WORD_TOKENS = 2.8      # measured: demo tokenizer, words of this list joined by spaces


@dataclass(frozen=True)
class Workload:
    conversations: int = 64
    turns: int = 4
    new_tokens: int = 64            # per user message
    history_tokens: int = 0         # a system prompt this long opens every conversation
    think_s: float = 0.0            # mean pause between a reply and the next question (uniform in 0..2x)
    think_range_s: tuple[float, float] | None = None  # instead: uniform in this range (bench/pressure.py)
    seed: int = 0
    sessions: bool = True           # send X-Session-Id (False: stateless PD, plan `full`)
    salt_each_turn: bool = False    # a fresh cache_salt per turn: no prefix-cache hit anywhere (true full prefill)
    token_ids: bool = False         # ask for return_token_ids (lets the bench compute the ideal reuse)
    max_tokens: int | None = None


def words(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choices(WORDS, k=max(1, round(tokens / WORD_TOKENS))))


class Script:
    """The user side of one conversation."""

    def __init__(self, workload: Workload, conversation: int, run: str) -> None:
        self.w, self.index = workload, conversation
        self.session = f"{run}-c{conversation}"
        self._rng = random.Random(f"{workload.seed}:{conversation}")

    def opening(self) -> list[dict[str, str]]:
        messages = []
        if self.w.history_tokens:
            messages.append({"role": "system",
                             "content": f"conversation {self.session}. " + words(self._rng, self.w.history_tokens)})
        return messages

    def question(self, turn: int) -> dict[str, str]:
        head = "" if self.w.history_tokens else f"conversation {self.session}. "
        return {"role": "user", "content": (head if turn == 0 else "") + words(self._rng, self.w.new_tokens)}

    def think(self) -> float:
        if self.w.think_range_s is not None:
            return self._rng.uniform(*self.w.think_range_s)
        return self._rng.uniform(0, 2 * self.w.think_s) if self.w.think_s > 0 else 0.0
