"""A conversation through the gateway with the official openai client, each turn compared token by token with
the same turn on the co-located baseline engine, and what P and D loaded from each other (vLLM's own counters).

The baseline gets the same messages (vLLM renders them: checks the gateway renders as vLLM does), or with
`baseline_by_ids` the very prompt ids the gateway sent (`history_tokens: generated` sends past answers as D's
ids, which differ from the re-encoded text when an answer does not re-tokenize to itself).
"""

from __future__ import annotations

import copy
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import openai

from tests.conversation import TurnTaking
from tests.servers import Server, labelled_sum
from tests.vllm.engines import SERVED_MODEL, Engine

TIMEOUT_S = 120


@dataclass
class Turn:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    plan: str
    reason: str
    reused: int
    prefill_loaded: int          # prompt tokens P read from D (vllm:prompt_tokens_by_source_total)
    decode_loaded: int           # prompt tokens D read from P
    prefill_computed: int = 0    # prompt tokens P computed itself
    expected: tuple[str, list[int], list[int]] | None = None   # the baseline's text, answer ids, prompt ids

    @property
    def exact(self) -> bool:
        _, ids, prompt_ids = self._expected()
        return self.token_ids == ids and self.prompt_ids == prompt_ids

    @property
    def expected_text(self) -> str:
        return self._expected()[0]

    def _expected(self) -> tuple[str, list[int], list[int]]:
        assert self.expected is not None, "not compared with the baseline yet (Chat.compare)"
        return self.expected


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


@dataclass
class Chat(TurnTaking):
    gateway: Server
    prefill: Engine
    decode: Engine
    baseline: Engine
    session: str | None = field(default_factory=lambda: uuid.uuid4().hex)
    # A system line of its own keeps one conversation's prompts out of the others' prefix caches.
    messages: list[dict[str, str]] = field(
        default_factory=lambda: [{"role": "system", "content": f"Conversation {uuid.uuid4().hex[:12]}."}])
    turns: list[Turn] = field(default_factory=list)
    max_tokens: int = 80
    baseline_by_ids: bool = False
    cache_salt: str | None = None         # sent to the gateway (and so to P and D): keeps other tests' prompts out
    tools: list[dict] | None = None
    # Compare each turn with the baseline only in `compare()`, after the conversation: turns then follow each other
    # as a client's would, not a baseline computation apart (on a loaded machine that outlasts D's short pin TTL).
    compare_later: bool = False
    _uncompared: list[tuple[Turn, Callable[[], tuple[str, list[int], list[int]]]]] = field(default_factory=list)

    def ask(self, *, stream: bool = False) -> Turn:
        before = self.prefill.loaded_tokens(), self.decode.loaded_tokens(), self.prefill.computed_tokens()
        headers = {"X-Session-Id": self.session} if self.session else {}
        raw = client(self.gateway.url).chat.completions.with_raw_response.create(
            model=SERVED_MODEL, messages=self.messages, max_tokens=self.max_tokens, temperature=0, stream=stream,
            extra_headers=headers, **({"tools": self.tools} if self.tools else {}),
            extra_body={"return_token_ids": True, **({"cache_salt": self.cache_salt} if self.cache_salt else {})},
            **({"stream_options": {"include_usage": True}} if stream else {}))
        text, ids, prompt_ids = _streamed(raw.parse()) if stream else _whole(raw.parse())
        loaded = int(self.prefill.loaded_tokens() - before[0]), int(self.decode.loaded_tokens() - before[1])
        computed = int(self.prefill.computed_tokens() - before[2])
        turn = Turn(text, ids, prompt_ids, raw.headers["x-pd-plan"], raw.headers["x-pd-reason"],
                    int(raw.headers["x-pd-reused-tokens"]), *loaded, computed)
        baseline = (partial(self._baseline_ids, prompt_ids, self.max_tokens) if self.baseline_by_ids
                    else partial(self._baseline, copy.deepcopy(self.messages), self.max_tokens))   # tests edit messages
        self._uncompared.append((turn, baseline))
        if not self.compare_later:
            self.compare()
        return turn

    def compare(self) -> None:
        """Each turn not yet compared gets the baseline's answer to the same prompt."""
        for turn, baseline in self._uncompared:
            turn.expected = baseline()
        self._uncompared.clear()

    def _baseline(self, messages: list[dict], max_tokens: int) -> tuple[str, list[int], list[int]]:
        """The same messages on one engine alone; a fresh cache salt so it computes everything itself."""
        out = self.baseline.post("/v1/chat/completions", {
            "model": SERVED_MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "cache_salt": uuid.uuid4().hex, **({"tools": self.tools} if self.tools else {})},
            timeout_s=TIMEOUT_S)
        choice = out["choices"][0]
        return choice["message"]["content"], choice["token_ids"], out["prompt_token_ids"]

    def _baseline_ids(self, prompt_ids: list[int], max_tokens: int) -> tuple[str, list[int], list[int]]:
        """The gateway's prompt ids on one engine alone (completions take ids as they are)."""
        out = self.baseline.post("/v1/completions", {
            "model": SERVED_MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "cache_salt": uuid.uuid4().hex}, timeout_s=TIMEOUT_S)
        choice = out["choices"][0]
        return choice["text"], choice["token_ids"], choice["prompt_token_ids"]


def _whole(out) -> tuple[str, list[int], list[int]]:
    choice = out.choices[0]
    return choice.message.content, list(choice.token_ids), list(out.prompt_token_ids)


def _streamed(chunks) -> tuple[str, list[int], list[int]]:
    text, ids, prompt_ids = "", [], []
    for chunk in chunks:
        prompt_ids = getattr(chunk, "prompt_token_ids", None) or prompt_ids
        for choice in chunk.choices:
            text += choice.delta.content or ""
            ids += getattr(choice, "token_ids", None) or []
    return text, ids, list(prompt_ids)


def gateway_metric(gateway: Server, name: str, **labels: str) -> float:
    """The gateway's /metrics samples of `name` whose labels include `labels`, summed (0 when absent: a turn's
    families also carry its `model`); with an admin key configured, sent with it."""
    key = gateway.args[gateway.args.index("--admin-key") + 1] if "--admin-key" in gateway.args else None
    request = urllib.request.Request(gateway.url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return labelled_sum(resp.read().decode(), name, labels)
