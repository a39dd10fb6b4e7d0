"""The chaos soak's client side (bench/chaos.py): one turn through a gateway replica, its answer read as JSON or
SSE, and what it tells recorded in the `Tally`: answered or failed with an OpenAI error, reused or not, hung, or
cut by its replica's kill (then sent again to another replica: bench/chaos_cluster.py)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from bench import chaos_cluster

if TYPE_CHECKING:
    from bench.chaos import Fleet

MODELS = ("demo", "demo-b")     # --models 2: engine pair 0 serves the first, pair 1 the second
HUNG_S = 30.0                  # a turn lasting longer is hung: every deadline of chaos.py's gateways sums to well under it


@dataclass
class Tally:
    turns: int = 0
    later_turns: int = 0           # answered turns after a conversation's first (reuse_rate's denominator)
    later_attempts: int = 0        # the same, answered or not: under load many fail and are not in reuse_rate
    reused: int = 0
    hung: int = 0
    failed: int = 0
    non_openai_errors: int = 0
    bad_input_5xx: int = 0
    disconnects: int = 0
    corrupt: int = 0
    leaked_pins: int = 0
    double_reads: Counter = field(default_factory=Counter)  # the engines' handles_double_read by kind (sim/handles.py)
    interrupted: int = 0           # turns cut by their gateway replica's kill (sent again to another replica)
    notes: list[str] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)     # X-PD-Reason of later turns planned `full`
    seconds: list[float] = field(default_factory=list)      # completed turns' durations
    timeline: Counter = field(default_factory=Counter)
    later: list[tuple[float, bool, str]] = field(default_factory=list)   # answered later turns: when, reused, replica
    fault_times: list[tuple[str, float, float]] = field(default_factory=list)   # name, began, ended (since `began`)
    cluster: str = ""              # --redis cluster: its findings' line
    began: float = field(default_factory=time.monotonic)



def openai_error(payload: object) -> bool:
    error = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


class StreamCut(Exception):
    """A stream that ended without [DONE] and without an error event."""


async def turn(http: aiohttp.ClientSession, fleet: Fleet, session: str, messages: list[dict], tally: Tally,
               *, disconnect: bool = False, model: str = MODELS[0], avoid: str = "") -> str | None:
    """One turn through a random replica (not `avoid`); returns the answer, or None when the turn did not
    complete. A turn cut by its replica's kill is sent again to another replica."""
    stream = disconnect or random.random() < 0.5
    body = {"model": model, "messages": messages, "max_tokens": 120, "stream": stream}
    replica = random.choice([g.url for g in fleet.gateways if g.url != avoid])
    began = time.monotonic()
    try:
        async with http.post(replica + "/v1/chat/completions", json=body, headers={"X-Session-Id": session}) as resp:
            answer = await (_read_stream(resp, tally, disconnect) if stream else _read_json(resp, tally))
            plan, reason = resp.headers.get("X-PD-Plan"), resp.headers.get("X-PD-Reason")
    except (aiohttp.ClientError, asyncio.TimeoutError, StreamCut) as exc:
        if chaos_cluster.cut(fleet, replica, began):
            tally.interrupted += 1
            tally.turns += 1
            return await turn(http, fleet, session, messages, tally, disconnect=disconnect, model=model, avoid=replica)
        tally.non_openai_errors += 1
        tally.notes.append(f"transport: {exc!r}")
        answer, plan, reason = None, None, None
    if time.monotonic() - began > HUNG_S:
        tally.hung += 1
    tally.turns += 1
    tally.later_attempts += len(messages) > 1
    if answer is not None:
        tally.seconds.append(time.monotonic() - began)
    if len(messages) > 1 and answer is not None:
        tally.later_turns += 1
        tally.reused += plan in ("reuse", "partial", "local")
        tally.later.append((time.monotonic() - tally.began, plan in ("reuse", "partial", "local"), replica))
        if plan not in ("reuse", "partial", "local"):
            tally.fallbacks[reason or "?"] += 1
    return answer


async def _read_json(resp: aiohttp.ClientResponse, tally: Tally) -> str | None:
    payload = await resp.json(content_type=None)
    if resp.status == 200:
        return payload["choices"][0]["message"]["content"]
    tally.failed += 1
    check_error(payload, tally, f"HTTP {resp.status}")
    return None


def check_error(payload: object, tally: Tally, where: str) -> None:
    if openai_error(payload):
        tally.errors[f"{where} {payload['error']['code']}"] += 1
        tally.timeline[(int(time.monotonic() - tally.began) // 5 * 5, str(payload["error"]["code"]))] += 1
    else:
        tally.non_openai_errors += 1
        tally.notes.append(f"{where}: not an OpenAI error: {str(payload)[:200]}")


async def _read_stream(resp: aiohttp.ClientResponse, tally: Tally, disconnect: bool) -> str | None:
    if resp.status != 200:
        return await _read_json(resp, tally)
    text, done = [], False
    async for line in resp.content:
        if disconnect:
            tally.disconnects += 1
            return None                     # leaving the `async with` closes the connection mid-stream
        if not line.startswith(b"data: "):
            continue
        if line.strip() == b"data: [DONE]":
            done = True
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            tally.failed += 1
            check_error(chunk, tally, "SSE event")
            return None
        if chunk.get("choices"):
            text.append(chunk["choices"][0]["delta"].get("content") or "")
    if not done:                            # the stream ended without [DONE] and without an error event
        raise StreamCut(f"stream cut without an error event after {len(text)} chunks")
    return "".join(text)
