"""A driver of our own that sends what vLLM's multi-turn benchmark client sends
(`benchmarks/multi_turn/benchmark_serving_multi_turn.py` with its `generate_multi_turn.json`), so the gateway
can be tried as that client tries it, with and without `--send-conversation-id`. Not the client itself: that
needs `vllm.benchmarks` and a Project Gutenberg book; this follows its rules, read from its source:

- conversations: one common prefix for all (500 tokens of text, then "."), then per conversation
  "<id> is a nice number... ", a first-turn context (lognormal, mean 1000 tokens, max 5000) and
  "Please rewrite the following text and add more content: " plus text up to the turn's size (uniform
  120..160 tokens); 12..18 messages (6..9 user turns); each dataset answer 80..120 tokens, used only as the
  turn's `max_tokens` (the real answer replaces it in the history);
- requests: `{"model", "messages", "stream": true, "stream_options": {"include_usage": false}, "max_tokens"}`,
  and with conversation ids also `"conversation_id"` in the body and an `X-Session-ID` header; the history
  carries the streamed answer's text;
- clients each keep a few conversations active and take them round robin, one request at a time.

The text is a seeded word stream rather than the book (content does not matter here, only the shape).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass, field

import httpx
import numpy as np
from transformers import AutoTokenizer

from gateway.turns.intake.render import BUILTIN_DIR

BASE_PROMPT = "Please rewrite the following text and add more content: "
WORDS = ("the count of monte cristo sailed from marseilles harbour at dawn while dantes watched the old "
         "fortress and thought of mercedes his father the letter the island and a treasure hidden in rock").split()


@dataclass
class Shape:
    conversations: int = 24
    messages: tuple[int, int] = (12, 18)
    common_prefix: int = 500
    context_mean: float = 1000.0
    context_max: int = 5000
    prompt: tuple[int, int] = (120, 160)
    answer: tuple[int, int] = (80, 120)
    clients: int = 2
    active_per_client: int = 3
    seed: int = 0


@dataclass
class Conversation:
    id: str
    messages: list[dict]
    next: int = 0           # index of the next user message


@dataclass
class Result:
    turns: int = 0
    failed: int = 0
    plans: dict[str, int] = field(default_factory=dict)
    how: dict[str, int] = field(default_factory=dict)


def generate(shape: Shape, tokenizer) -> list[Conversation]:
    rng = np.random.default_rng(shape.seed)
    text = tokenizer.encode(" ".join(rng.choice(WORDS, 400_000)), add_special_tokens=False)
    decode = tokenizer.decode
    common = decode(text[:shape.common_prefix - 2]) + "."
    offset = shape.common_prefix
    sigma = 0.6
    out = []
    for c in range(shape.conversations):
        n = int(rng.integers(shape.messages[0], shape.messages[1] + 1))
        n += n % 2
        sizes = rng.integers(shape.prompt[0], shape.prompt[1] + 1, n)
        context = int(min(shape.context_max, round(rng.lognormal(np.log(shape.context_mean) - sigma ** 2 / 2, sigma))))
        messages = []
        for t in range(n):
            if t % 2:
                answer = int(rng.integers(shape.answer[0], shape.answer[1] + 1))
                messages.append({"role": "assistant", "content": decode(text[:answer])})
                continue
            content = (common if t == 0 else "") + f"{c} is a nice number... "
            left = int(sizes[t]) - len(tokenizer.encode(content, add_special_tokens=False))
            if t == 0:
                content += f"{c}, " + decode(text[offset:offset + context])
                offset += context
            content += BASE_PROMPT
            left -= len(tokenizer.encode(BASE_PROMPT, add_special_tokens=False))
            if left > 0:
                start = offset + t * int(sizes.max())
                content += decode(text[start:start + left])
            messages.append({"role": "user", "content": content})
        offset += n
        out.append(Conversation(f"CONV_ID_{c}", messages))
    return out


async def send_turn(http: httpx.AsyncClient, url: str, conv: Conversation, max_tokens: int, with_ids: bool,
                    result: Result) -> bool:
    messages = conv.messages[:conv.next + 1]
    body = {"model": "demo", "messages": messages, "stream": True, "stream_options": {"include_usage": False},
            "max_tokens": max_tokens}
    headers = {"Content-Type": "application/json"}
    if with_ids:
        body["conversation_id"] = conv.id
        headers["X-Session-ID"] = conv.id
    text = []
    async with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            await resp.aread()
            result.failed += 1
            return False
        plan = f"{resp.headers['x-pd-plan']}/{resp.headers['x-pd-reason']}"
        result.plans[plan] = result.plans.get(plan, 0) + 1
        how = resp.headers.get("x-pd-conversation", "?")
        result.how[how] = result.how.get(how, 0) + 1
        async for line in resp.aiter_lines():
            line = line.strip().removeprefix("data: ")
            if line and line != "[DONE]":
                delta = json.loads(line)["choices"][0].get("delta", {})
                text.append(delta.get("content") or "")
    answer = conv.next + 1
    if answer < len(conv.messages):
        conv.messages[answer] = {"role": "assistant", "content": "".join(text)}
    conv.next += 2
    result.turns += 1
    return True


async def client(http, url, queue: deque, shape: Shape, tokenizer, with_ids: bool, result: Result) -> None:
    active: deque[Conversation] = deque()
    while queue or active:
        while queue and len(active) < shape.active_per_client:
            active.append(queue.popleft())
        conv = active.pop()
        answer = conv.messages[conv.next + 1]["content"] if conv.next + 1 < len(conv.messages) else ""
        max_tokens = max(1, len(tokenizer.encode(answer, add_special_tokens=False)))
        if await send_turn(http, url, conv, max_tokens, with_ids, result) and conv.next < len(conv.messages):
            active.appendleft(conv)


async def run(url: str, shape: Shape, *, with_ids: bool) -> Result:
    tokenizer = AutoTokenizer.from_pretrained(str(BUILTIN_DIR / "demo"))
    queue = deque(generate(shape, tokenizer))
    result = Result()
    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(client(http, url, queue, shape, tokenizer, with_ids, result)
                               for _ in range(shape.clients)))
    return result
