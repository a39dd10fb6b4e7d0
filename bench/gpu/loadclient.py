"""The load bench's client: conversations streamed against one arm's OpenAI URL, closed or open loop.

Closed loop: `concurrency` conversations at once, each turn sent after the previous answer plus a think time, a
new conversation as soon as one ends; they all start together, so the first turns are a burst. Open loop: new
conversations arrive as a Poisson process of `rate` per second, however many are running. Either way no new turn
starts after `duration_s` (turns in flight finish). TTFT is the time to the first chunk carrying content; ITL the
gaps between content chunks (vLLM streams one token a chunk).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

try:
    from loadwork import Conversation, Shape
except ImportError:                            # imported as bench.gpu.loadclient
    from bench.gpu.loadwork import Conversation, Shape

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
TOP_K = 20
ERROR_PAUSE_S = 1.0
KEEPALIVE_S = 4.0          # below vLLM's 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): no request on a connection it closes
SAMPLE_EVERY = 20          # 1 in 20 later turns asks for logprobs and its prompt ids, replayed on C afterwards


@dataclass
class Turn:
    conv: int
    turn: int
    start_s: float                          # since the point began
    ok: bool = False
    ttft_s: float = 0.0
    total_s: float = 0.0
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    plan: str = ""
    reason: str = ""
    reused: int = 0
    session: str = ""                       # the gateway's name for the conversation (X-PD-Session, else ours)
    error: str = ""
    error_kind: str = ""                    # "openai" (an error object, HTTP or SSE), "hung" (past the timeout), "other"
    sample: dict[str, Any] | None = None    # prompt ids and the first token's top-k, on sampled turns

    @property
    def later(self) -> bool:
        return self.turn > 0


@dataclass(frozen=True)
class Point:
    workload: str
    shape: Shape
    concurrency: int = 0                    # closed loop
    rate: float = 0.0                       # open loop: new conversations per second
    conversations: int = 0
    duration_s: float = 60.0
    think_scale: float = 1.0
    seed: int = 0

    @property
    def name(self) -> str:
        loop = f"c{self.concurrency}" if self.concurrency else f"o{self.rate:g}"
        return f"{self.workload}:{loop}"


class Client:
    def __init__(self, url: str, model: str, tag: str, *, sample: bool = False, turn_timeout_s: float = 300,
                 headers: dict[str, str] | None = None) -> None:
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.turn_timeout_s = turn_timeout_s
        self.model, self.tag, self.sample = model, tag, sample
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    async def run(self, point: Point) -> list[Turn]:
        out: list[Turn] = []
        began = time.perf_counter()
        deadline = began + point.duration_s
        timeout = aiohttp.ClientTimeout(total=self.turn_timeout_s)     # a turn past it counts as hung
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                                         timeout=timeout) as http:
            convs = (Conversation(point.shape, self.tag, point.seed, i, point.think_scale)
                     for i in range(point.conversations or 10**6))
            if point.concurrency:
                async def worker() -> None:
                    for conv in convs:
                        if time.perf_counter() > deadline:
                            return
                        await self._conversation(http, conv, began, deadline, out)
                await asyncio.gather(*(worker() for _ in range(point.concurrency)))
            else:
                rng, tasks = random.Random(point.seed), []
                for conv in convs:
                    if time.perf_counter() > deadline:
                        break
                    tasks.append(asyncio.create_task(self._conversation(http, conv, began, deadline, out)))
                    await asyncio.sleep(rng.expovariate(point.rate))
                await asyncio.gather(*tasks)
        return out

    async def _conversation(self, http: aiohttp.ClientSession, conv: Conversation, began: float,
                            deadline: float, out: list[Turn]) -> None:
        while time.perf_counter() < deadline and (answer := conv.next_question()) is not None:
            turn = Turn(conv.index, conv.turn, time.perf_counter() - began)
            sampled = self.sample and conv.turn > 0 and (conv.index * 7 + conv.turn) % SAMPLE_EVERY == 0
            text = await self._turn(http, conv, answer, sampled, turn)
            out.append(turn)
            if not turn.ok:
                await asyncio.sleep(ERROR_PAUSE_S)      # a user retries later, not in a tight loop
                return
            conv.answered(text, turn.output_tokens)
            await asyncio.sleep(conv.think_s())

    def _body(self, conv: Conversation, answer: int, sampled: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": conv.messages, "stream": True,
                                "stream_options": {"include_usage": True}, "max_tokens": answer,
                                "min_tokens": answer, "ignore_eos": True, "temperature": 0}
        if sampled:
            body.update(logprobs=True, top_logprobs=TOP_K, return_token_ids=True, return_tokens_as_token_ids=True)
        return body

    async def _turn(self, http: aiohttp.ClientSession, conv: Conversation, answer: int, sampled: bool,
                    turn: Turn) -> str:
        headers = {**self.headers, "X-Session-Id": conv.tag}
        t0 = time.perf_counter()
        pieces: list[str] = []
        try:
            async with http.post(self.url, data=_encode(self._body(conv, answer, sampled)), headers=headers) as r:
                h = r.headers
                turn.plan, turn.reason = h.get("x-pd-plan", ""), h.get("x-pd-reason", "")
                turn.reused = int(h.get("x-pd-reused-tokens", 0) or 0)
                turn.session = h.get("x-pd-session", conv.tag)
                if r.status != 200:
                    raw = await r.read()
                    turn.error, turn.error_kind = f"HTTP {r.status}: {raw[:200]!r}", _kind(raw)
                    return ""
                await self._read(r, t0, turn, pieces, sampled)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            turn.error = f"{type(exc).__name__}: {exc}"[:200]
            turn.error_kind = "hung" if isinstance(exc, asyncio.TimeoutError) else "other"
        turn.total_s = time.perf_counter() - t0
        turn.ok = not turn.error and turn.ttft_s > 0
        if not turn.error and not turn.ok:
            turn.error, turn.error_kind = "no content streamed", "other"
        return "".join(pieces)

    async def _read(self, r: aiohttp.ClientResponse, t0: float, turn: Turn, pieces: list[str],
                    sampled: bool) -> None:
        last = 0.0
        async for line in r.content:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            chunk = _decode(line[5:].strip())
            if "error" in chunk:
                turn.error, turn.error_kind = str(chunk["error"])[:200], "openai"
                continue
            if sampled and turn.sample is None and chunk.get("prompt_token_ids"):
                turn.sample = {"prompt_ids": chunk["prompt_token_ids"]}
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if not content:
                    continue
                now = time.perf_counter()
                if last:
                    turn.gaps.append(now - last)
                else:
                    turn.ttft_s = now - t0
                last = now
                pieces.append(content)
                tops = ((choice.get("logprobs") or {}).get("content") or [None])[0]
                if sampled and tops and turn.sample is not None and "top" not in turn.sample:
                    turn.sample["top"] = {e["token"]: e["logprob"] for e in tops["top_logprobs"]}
            if usage := chunk.get("usage"):
                turn.prompt_tokens = usage.get("prompt_tokens", 0)
                turn.output_tokens = usage.get("completion_tokens", 0)
                turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _kind(body: bytes) -> str:
    """An HTTP error's body: the API's error object, or anything else (a stack trace, a proxy's page)."""
    try:
        return "openai" if isinstance(err := _decode(body).get("error"), dict) and err.get("message") else "other"
    except (msgspec.DecodeError, AttributeError):
        return "other"
