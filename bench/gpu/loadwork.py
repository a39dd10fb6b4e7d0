"""The load bench's users: three seeded workloads of multi-turn conversations (bench/gpu/load.py).

Lengths are in tokens of the bench model's tokenizer (the project's demo tokenizer: one word of bench/workload.py's
list is ~2.8 tokens), drawn uniformly in each range:
- `chat` (ShareGPT-like): a system prompt of 200-2k tokens, questions of 20-300, answers of 100-500, 3-8 turns;
  think time log-normal, median 10 s (90th percentile ~28 s): a person reads the answer and types the next one.
- `long` (document or code-base questions): an opening document making the history 8k-24k tokens, questions of
  100-800, answers of 100-300, 3-5 turns (histories reach 32k); think time median 20 s.
- `agent` (a coding agent's loop): a 1.5k-3k system prompt (tool definitions), then 10-30 steps, each a tool
  result of 500-4k tokens and a short answer of 20-120 tokens; think time is the tool's run, median 1.5 s. A
  step that would take the history past `max_history` ends the conversation (as an agent compacts its context).
  The random-weight bench model cannot call tools, so each tool result is a user message: the KV pattern (long
  appended suffixes, short answers, many steps) is an agent's, the wire format is chat's.
Think times decide whether D's handles, leases and pins are still alive at the next turn; `think_scale` shrinks
them for short runs (the run's summary says by how much). Every conversation opens with its own tag (arm, seed,
index), so no two conversations, and no two arms, share a cached prefix.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu apple river stone cloud light garden window "
    "silver orange purple market engine signal forest ocean valley summer winter number paper simple yellow"
).split()
WORD_TOKENS = 2.8          # demo tokenizer, words of this list joined by spaces (bench/workload.py)
TEMPLATE_TOKENS = 8        # the chat template's tokens around each message


@dataclass(frozen=True)
class Shape:
    name: str
    system: tuple[int, int]
    opening: tuple[int, int]        # the first user message (the document, for `long`)
    question: tuple[int, int]       # each later user message (a tool result, for `agent`)
    answer: tuple[int, int]
    turns: tuple[int, int]
    think_median_s: float
    max_history: int = 32000

    def scaled(self, factor: float) -> Shape:
        """Every length times `factor` (at least 1 token): the small forms for the simulators and CI."""
        def s(r: tuple[int, int]) -> tuple[int, int]:
            return max(1, round(r[0] * factor)), max(1, round(r[1] * factor))
        return Shape(self.name, s(self.system), s(self.opening), s(self.question), s(self.answer), self.turns,
                     self.think_median_s, max(64, round(self.max_history * factor)))


SHAPES = {
    "chat": Shape("chat", (200, 2000), (20, 300), (20, 300), (100, 500), (3, 8), 10.0),
    "long": Shape("long", (200, 1000), (8000, 24000), (100, 800), (100, 300), (3, 5), 20.0),
    "agent": Shape("agent", (1500, 3000), (50, 300), (500, 4000), (20, 120), (10, 30), 1.5, max_history=30000),
}
THINK_SIGMA = 0.8          # log-normal spread: median x e^(1.28 sigma) ~ 2.8x at the 90th percentile


def words(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choices(WORDS, k=max(1, round(tokens / WORD_TOKENS))))


class Conversation:
    """The user side of one conversation: its messages so far, the next question, the answer length wanted."""

    def __init__(self, shape: Shape, tag: str, seed: int, index: int, think_scale: float = 1.0) -> None:
        self.shape, self.tag, self.index = shape, f"{tag}-{index}", index
        self.think_scale = think_scale
        self._rng = random.Random(f"{seed}:{shape.name}:{index}")
        self.turns = self._rng.randint(*shape.turns)
        system = self._draw(shape.system)
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"Conversation {self.tag}. " + words(self._rng, system)}]
        self.history = system + TEMPLATE_TOKENS
        self.turn = 0

    def _draw(self, r: tuple[int, int]) -> int:
        return self._rng.randint(*r)

    def next_question(self) -> int | None:
        """Appends the next user message and returns the answer's length in tokens; None when the conversation
        is over (its turns done, or the next step would take it past `max_history`)."""
        if self.turn >= self.turns:
            return None
        tokens = self._draw(self.shape.opening if self.turn == 0 else self.shape.question)
        answer = self._draw(self.shape.answer)
        if self.turn and self.history + tokens + answer + 2 * TEMPLATE_TOKENS > self.shape.max_history:
            return None
        self.messages.append({"role": "user", "content": words(self._rng, tokens)})
        self.history += tokens + TEMPLATE_TOKENS
        return answer

    def answered(self, text: str, tokens: int) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.history += tokens + TEMPLATE_TOKENS
        self.turn += 1

    def think_s(self) -> float:
        mu = math.log(self.shape.think_median_s * self.think_scale) if self.think_scale > 0 else None
        return self._rng.lognormvariate(mu, THINK_SIGMA) if mu is not None else 0.0
