"""A conversation through the gateway with the official openai client, each turn compared token by token with
the same turn on the co-located baseline engine, and what P and D loaded from each other (vLLM's own counters).
"""

from __future__ import annotations

import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

import openai

from tests.conversation import TurnTaking
from tests.servers import Server
from tests.vllm.engines import SERVED_MODEL, Engine

TIMEOUT_S = 120


@dataclass
class Turn:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    expected_text: str
    expected_ids: list[int]
    expected_prompt_ids: list[int]
    plan: str
    reason: str
    reused: int
    prefill_loaded: int          # prompt tokens P read from D (vllm:prompt_tokens_by_source_total)
    decode_loaded: int           # prompt tokens D read from P

    @property
    def exact(self) -> bool:
        return self.token_ids == self.expected_ids and self.prompt_ids == self.expected_prompt_ids


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

    def ask(self, *, stream: bool = False) -> Turn:
        before = self.prefill.loaded_tokens(), self.decode.loaded_tokens()
        headers = {"X-Session-Id": self.session} if self.session else {}
        raw = client(self.gateway.url).chat.completions.with_raw_response.create(
            model=SERVED_MODEL, messages=self.messages, max_tokens=self.max_tokens, temperature=0, stream=stream,
            extra_headers=headers, extra_body={"return_token_ids": True},
            **({"stream_options": {"include_usage": True}} if stream else {}))
        text, ids, prompt_ids = _streamed(raw.parse()) if stream else _whole(raw.parse())
        expected = self._baseline()
        return Turn(text, ids, prompt_ids, expected["choices"][0]["message"]["content"],
                    expected["choices"][0]["token_ids"], expected["prompt_token_ids"],
                    raw.headers["x-pd-plan"], raw.headers["x-pd-reason"], int(raw.headers["x-pd-reused-tokens"]),
                    int(self.prefill.loaded_tokens() - before[0]), int(self.decode.loaded_tokens() - before[1]))

    def _baseline(self) -> dict[str, Any]:
        """The same messages on one engine alone; a fresh cache salt so it computes everything itself."""
        return self.baseline.post("/v1/chat/completions", {
            "model": SERVED_MODEL, "messages": self.messages, "max_tokens": self.max_tokens, "temperature": 0,
            "return_token_ids": True, "cache_salt": uuid.uuid4().hex}, timeout_s=TIMEOUT_S)


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
    """One sample of the gateway's /metrics (0 when absent)."""
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == want:
            return float(value)
    return 0.0
