"""A client-side conversation for end-to-end tests: one turn through the gateway, the same turn on the
co-located baseline engine, and what the P engine computed for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.conversation import TurnTaking
from tests.e2e.stack import Stack


@dataclass
class Turn:
    text: str
    expected: str
    plan: str
    reason: str
    reused: int
    prompt_tokens: int
    completion_tokens: int
    computed: int           # prompt tokens P computed for this turn (sim oracle)
    conversation: str = ""  # the conversation's id in the store and the admin API (X-PD-Session)


@dataclass
class Chat(TurnTaking):
    stack: Stack
    session: str
    messages: list[dict] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    max_tokens: int = 200
    hop: bool = False           # send each turn to the next gateway replica

    def ask(self, *, stream: bool = False, replica: int | None = None) -> Turn:
        prefill = self.stack.prefill[0]
        before = self.stack.stats(prefill)["prompt_tokens_computed"]
        if replica is None:
            replica = len(self.turns) if self.hop else 0
        raw = self.stack.client(replica).chat.completions.with_raw_response.create(
            model="demo", messages=self.messages, stream=stream, max_tokens=self.max_tokens,
            extra_headers={"X-Session-Id": self.session},
            **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(raw.parse())
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = next(c.usage for c in chunks if c.usage)
        else:
            out = raw.parse()
            text, usage = out.choices[0].message.content, out.usage
        expected = self.stack.baseline_client().chat.completions.create(
            model="demo", messages=self.messages, max_tokens=self.max_tokens).choices[0].message.content
        return Turn(text, expected, raw.headers["x-pd-plan"], raw.headers["x-pd-reason"],
                    int(raw.headers["x-pd-reused-tokens"]), usage.prompt_tokens, usage.completion_tokens,
                    self.stack.stats(prefill)["prompt_tokens_computed"] - before,
                    raw.headers.get("x-pd-session", ""))
