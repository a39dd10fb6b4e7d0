"""The fixed, seeded suite `pd-gateway verify` sends: the shapes of traffic where PD can go wrong while a
co-located engine cannot. The texts come from a seeded word stream (the same on every run); only the run's
nonce, in each system prompt, differs, so that a run starts its own conversations.

A case is one conversation of one or more turns; each turn is one request, judged on its own. Later turns'
history is built from the gateway's own answers, and the baseline is sent exactly the same messages, so every
turn compares like with like.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

TOP_K = 20                  # vLLM's default --max-logprobs: the whole reported distribution
ANSWER_TOKENS = 16
QUICK_ANSWER_TOKENS = 8
SEED = 28
WORDS = ("river stone cloud light garden window silver orange market engine signal forest ocean valley summer "
         "winter number paper simple yellow bridge castle island planet rocket shadow thunder harbor lantern "
         "meadow pepper quiet rapid salt timber velvet wander anchor basket candle desert ember falcon glacier "
         "hollow ivory jungle kettle ladder marble needle orbit pebble quartz ribbon saddle tunnel").split()
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {
        "type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
ANSWER_SCHEMA = {"type": "json_schema", "json_schema": {"name": "summary", "schema": {
    "type": "object", "properties": {"title": {"type": "string"}, "words": {"type": "integer"},
                                     "final": {"type": "boolean"}}, "required": ["title", "words"]}}}

Endpoint = Literal["/v1/chat/completions", "/v1/completions"]
# A turn's messages from the history so far (the gateway's answers included): the last one is the new one.
Step = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


@dataclass(frozen=True)
class Turn:
    step: Step                                     # messages so far -> this turn's messages
    stream: bool = False
    extra: dict[str, Any] = field(default_factory=dict)    # tools, response_format, chat_template_kwargs


@dataclass(frozen=True)
class Case:
    name: str
    what: str                                      # one line for the report
    turns: tuple[Turn, ...]
    endpoint: Endpoint = "/v1/chat/completions"
    prompt: str | None = None                      # completions: the prompt text


class Text:
    """The seeded word stream: the same texts on every run."""

    def __init__(self, seed: int = SEED) -> None:
        self._rng = random.Random(seed)

    def words(self, n: int) -> str:
        return " ".join(self._rng.choice(WORDS) for _ in range(n))

    def sentence(self, n: int) -> str:
        return self.words(n).capitalize() + "."


def _user(text: str) -> Step:
    return lambda history: [*history, {"role": "user", "content": text}]


def _edited(index: int, text: str) -> Step:
    """The history with its `index`-th user message replaced, and a new question: an edit of the past."""
    def step(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        users = [i for i, m in enumerate(history) if m["role"] == "user"]
        out = [dict(m) for m in history]
        out[users[index]]["content"] = text
        return [*out, {"role": "user", "content": "Given that, what changes?"}]
    return step


def build(nonce: str, *, quick: bool = False, long_words: int = 900) -> list[Case]:
    """The suite. `long_words`: the long prompt's size in words (the caller fits it to max_model_len)."""
    t = Text()
    system = {"role": "system", "content": f"Verification run {nonce}. You answer briefly. " + t.sentence(20)}
    shared = {"role": "system", "content": f"Verification run {nonce}. Shared context: " + t.sentence(
        max(60, long_words // 3))}

    t_first, t_short, t_long = t.sentence(12), t.sentence(8), t.sentence(long_words)
    t_pair = (t.sentence(10), t.sentence(10))
    t_conv = (t.sentence(30), t.sentence(25), t.sentence(20))
    t_edit = (t.sentence(30), t.sentence(20), t.sentence(28))
    t_tool, t_json = t.words(1).capitalize(), t.sentence(30)
    t_reason = (t.sentence(20), t.sentence(15))
    t_completion = t.sentence(40)
    cases = [
        Case("short", "one short turn", (Turn(lambda _: [system, {"role": "user", "content": t_first}]),)),
        Case("short_stream", "one short turn, streamed",
             (Turn(lambda _: [system, {"role": "user", "content": t_short}], stream=True),)),
        Case("long", f"one long prompt (~{long_words} words)",
             (Turn(lambda _: [system, {"role": "user", "content": t_long}]),)),
        Case("prefix_cached", "a second request sharing a long prefix with the first (P's prefix cache)",
             (Turn(lambda _: [shared, {"role": "user", "content": t_pair[0]}]),)),
        Case("prefix_cached_2", "the pair's second request: only its last message is new",
             (Turn(lambda _: [shared, {"role": "user", "content": t_pair[1]}], stream=True),)),
        Case("conversation", "three turns reusing D's KV (streamed in the middle)",
             (Turn(lambda _: [system, {"role": "user", "content": t_conv[0]}]),
              Turn(_user(t_conv[1]), stream=True), Turn(_user(t_conv[2])))),
        Case("edit", "three turns, the third edits the first question (a diverged history)",
             (Turn(lambda _: [system, {"role": "user", "content": t_edit[0]}]), Turn(_user(t_edit[1])),
              Turn(_edited(0, t_edit[2])))),
        Case("tool_call", "a request that may call a tool (tool_choice auto)",
             (Turn(lambda _: [system, {"role": "user", "content": "What is the weather in " + t_tool + "?"}],
                   extra={"tools": [WEATHER_TOOL], "tool_choice": "auto"}),)),
        Case("json_schema", "structured output: response_format json_schema",
             (Turn(lambda _: [system, {"role": "user", "content": "Summarise: " + t_json}],
                   extra={"response_format": ANSWER_SCHEMA}),)),
        Case("reasoning", "two turns with the template's thinking on (where the model has one)",
             (Turn(lambda _: [system, {"role": "user", "content": t_reason[0]}],
                   extra={"chat_template_kwargs": {"enable_thinking": True}}),
              Turn(_user(t_reason[1]), stream=True, extra={"chat_template_kwargs": {"enable_thinking": True}}))),
        Case("completion", "a text completion (/v1/completions)", (Turn(lambda _: []),),
             endpoint="/v1/completions", prompt=f"Run {nonce}. " + t_completion),
    ]
    if quick:
        keep = {"short", "short_stream", "conversation", "edit", "json_schema", "completion"}
        cases = [c for c in cases if c.name in keep]
    return cases


def sampling(endpoint: Endpoint, *, quick: bool) -> dict[str, Any]:
    """What every request of the suite asks: greedy, its token ids, the first tokens' whole top-k."""
    body: dict[str, Any] = {"temperature": 0, "seed": SEED, "return_token_ids": True,
                            "return_tokens_as_token_ids": True,
                            "max_tokens": QUICK_ANSWER_TOKENS if quick else ANSWER_TOKENS}
    if endpoint == "/v1/chat/completions":
        body.update(logprobs=True, top_logprobs=TOP_K)
    else:
        body["logprobs"] = TOP_K
    return body
