"""The simulated model: a deterministic answer from the KV it actually attends to.

The answer is a pure function of the *effective context* (the `(token, position)` every prompt slot's KV
really encodes) and the seed, so wrong KV yields a different answer, like a real model fed wrong KV.
Answers are ASCII words; `canonical` answers are `encode(text)`, so re-encoding the text gives the same ids.
"""

from __future__ import annotations

import hashlib
import random
import struct
from dataclasses import dataclass

from gateway.sim.blocks import Slot
from gateway.sim.chat_render import Renderer
from gateway.sim.structured import document
from gateway.sim.hermes_tools import Style, ToolSpec, compose

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu apple river stone cloud light "
    "garden window silver orange purple market engine signal forest ocean valley summer winter number "
    "paper simple yellow bridge castle dragon island planet rocket shadow thunder"
).split()
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_WORDS = (4, 12)


def context_digest(slots: list[Slot]) -> bytes:
    h = hashlib.sha256()
    for token, pos in slots:
        h.update(struct.pack("<qq", token, pos))
    return h.digest()


@dataclass(frozen=True)
class Answer:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    stop_reason: str | int | None = None


class Model:
    """Turns a context digest into the answer's token ids, honouring max/min tokens, EOS and stop strings."""

    def __init__(self, renderer: Renderer, *, output_tokens: tuple[int, int], canonical: bool = True,
                 reasoning: bool = False, tool_call_rate: float = 0.5, tool_call_style: Style = "template") -> None:
        self.renderer = renderer
        self.tool_call_rate, self.tool_call_style = tool_call_rate, tool_call_style
        self.output_tokens = output_tokens
        self.canonical = canonical
        self.reasoning = reasoning
        self.word_ids = {w: renderer.encode(w) for w in WORDS} | {" " + w: renderer.encode(" " + w) for w in WORDS}
        self.split_ids = {w: [t for ch in w for t in renderer.encode(ch)] for w in self.word_ids}

    def answer(self, digest: bytes, *, seed: int | None, max_tokens: int, min_tokens: int = 0,
               ignore_eos: bool = False, stop: list[str] | None = None, tools: ToolSpec | None = None,
               schema: dict | None = None) -> Answer:
        rng = random.Random(digest + struct.pack("<q", seed or 0))
        natural = rng.randint(*self.output_tokens)
        ids: list[int] = self._opening(rng)
        calls = compose(rng, tools, rate=self.tool_call_rate, style=self.tool_call_style) if tools else None
        if calls is None and schema is not None:
            calls = document(rng, schema)           # guided decoding: the document, then EOS
        if calls is not None:
            ids += self.renderer.encode(calls)      # a tool call's (or document's) length is its JSON's
        first = True
        while calls is None and (len(ids) < max(natural, min_tokens) or (ignore_eos and len(ids) < max_tokens)):
            ids += self._word(rng, first=first)
            first = False
        ids = ids[:max_tokens]
        if stop:
            cut = self._stop_cut(ids, stop)
            if cut is not None:
                return Answer(ids[:cut[0]], "stop", cut[1])
        if len(ids) < max_tokens and not ignore_eos:
            return Answer(ids + [self.renderer.eos_token_id], "stop")
        return Answer(ids, "length")

    def _opening(self, rng: random.Random) -> list[int]:
        if not self.reasoning:
            return []
        words = [rng.choice(WORDS) for _ in range(rng.randint(*REASONING_WORDS))]
        return self.renderer.encode(THINK_OPEN + " ".join(words) + THINK_CLOSE + "\n\n")

    def _word(self, rng: random.Random, *, first: bool) -> list[int]:
        word = ("" if first else " ") + rng.choice(WORDS)
        # Non-canonical: some words as one token per character: same text, different ids on re-encoding.
        if not self.canonical and rng.random() < 0.3:
            return self.split_ids[word]
        return self.word_ids[word]

    def _stop_cut(self, ids: list[int], stop: list[str]) -> tuple[int, str] | None:
        """First token whose text completes a stop string; the stop string itself is not returned."""
        for n in range(1, len(ids) + 1):
            text = self.renderer.decode(ids[:n])
            for s in stop:
                if s and s in text:
                    return n - 1, s
        return None
