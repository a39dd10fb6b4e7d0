"""Async load generator for multi-turn chats against an OpenAI endpoint (or, for the floor, P then D directly).

    python bench/loadgen.py --url http://127.0.0.1:8000 --conversations 64 --concurrency 64 --turns 4 \
        --new-tokens 64 [--think-s 0.5] [--open-rate 20] [--pid GATEWAY_PID]
    python bench/loadgen.py --floor --prefill http://P --decode http://D ...

Closed loop (default): `concurrency` conversations run at once, each turn after the previous reply plus a think
time. Open loop (`--open-rate R`): conversations start as a Poisson process of R per second, unbounded.
TTFT is the time from sending the turn to the first SSE event; for the floor, from sending P's leg.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

try:
    from bench.workload import Script, Workload
except ImportError:                          # run as a script: bench/ is on sys.path
    from workload import Script, Workload  # type: ignore[no-redef]

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
JSON = {"Content-Type": "application/json"}
FRESH_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass
class TurnResult:
    conversation: int
    turn: int
    ok: bool
    ttft_s: float = 0.0
    total_s: float = 0.0
    prompt_tokens: int = 0
    plan: str = ""
    reason: str = ""
    reused_tokens: int = 0
    error: str = ""
    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)


@dataclass
class Reply:
    """What one streamed answer carried."""
    ttft_s: float = 0.0
    content: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    error: str = ""
    handle: dict | None = None          # D's kv_transfer_params, when its stream carried them


async def read_stream(resp: aiohttp.ClientResponse, began: float, want_ids: bool) -> Reply:
    reply, first = Reply(), True
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        if first:
            reply.ttft_s, first = time.perf_counter() - began, False
        payload = line[5:].strip()
        if payload == b"[DONE]":
            continue            # read on to the end of the body: then the connection is kept for the next turn
        event = _decode(payload)
        if "error" in event:
            reply.error = str(event["error"])[:200]
            continue
        if want_ids and reply.prompt_ids is None:
            reply.prompt_ids = event.get("prompt_token_ids")
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                reply.content.append(delta["content"])
            if want_ids and choice.get("token_ids"):
                reply.output_ids.extend(choice["token_ids"])
        if event.get("usage"):
            reply.prompt_tokens = event["usage"].get("prompt_tokens", 0)
        reply.handle = event.get("kv_transfer_params") or reply.handle
    return reply


class Target:
    """Where a turn goes. `send` returns the reply plus what the response headers said."""

    async def send(self, http: aiohttp.ClientSession, script: Script, messages: list[dict], turn: int,
                   w: Workload) -> tuple[Reply, dict[str, str]]:
        raise NotImplementedError


def _body(messages: list[dict], turn: int, w: Workload, script: Script) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "demo", "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True}}
    if w.max_tokens:
        body["max_tokens"] = w.max_tokens
    if w.token_ids:
        body["return_token_ids"] = True
    if w.salt_each_turn:
        body["cache_salt"] = f"{script.session}-t{turn}-{uuid.uuid4().hex[:8]}"
    return body


class OpenAITarget(Target):
    """A gateway or proxy: one streamed chat request per turn, session in X-Session-Id."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/") + "/v1/chat/completions"

    async def send(self, http, script, messages, turn, w):
        headers = {**JSON, "X-Session-Id": script.session} if w.sessions else JSON
        began = time.perf_counter()
        async with http.post(self.url, data=_encode(_body(messages, turn, w, script)), headers=headers) as resp:
            if resp.status != 200:
                return Reply(error=f"HTTP {resp.status}: {(await resp.read())[:200]!r}"), {}
            reply = await read_stream(resp, began, w.token_ids)
            return reply, {k.lower(): v for k, v in resp.headers.items() if k.lower().startswith("x-pd-")}


class FloorTarget(Target):
    """No proxy: the load generator itself sends P's leg (max_tokens 1) then D's leg with P's handle.
    `reuse`: it also keeps each conversation's last D handle and hands it to P next turn, unchecked, so the
    engines do the same work as behind a stateful proxy (P reads the history from D) at no routing cost.
    Needs one D (the handle names it) and engines that stream the handle."""

    def __init__(self, prefill: list[str], decode: list[str], *, reuse: bool = False) -> None:
        self._p = itertools.cycle([u.rstrip("/") + "/v1/chat/completions" for u in prefill])
        self._d = itertools.cycle([u.rstrip("/") + "/v1/chat/completions" for u in decode])
        self._handles: dict[str, dict] | None = {} if reuse else None

    async def send(self, http, script, messages, turn, w):
        body = _body(messages, turn, w, script)
        prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "return_token_ids")}
        held = self._handles.pop(script.session, None) if self._handles is not None else None
        prefill.update(max_tokens=1, stream=False, kv_transfer_params=held or FRESH_PREFILL)
        began = time.perf_counter()
        async with http.post(next(self._p), data=_encode(prefill), headers=JSON) as resp:
            if resp.status != 200:
                return Reply(error=f"P HTTP {resp.status}"), {}
            handle = _decode(await resp.read()).get("kv_transfer_params")
        body["kv_transfer_params"] = handle
        async with http.post(next(self._d), data=_encode(body), headers=JSON) as resp:
            if resp.status != 200:
                return Reply(error=f"D HTTP {resp.status}"), {}
            reply = await read_stream(resp, began, w.token_ids)
        if self._handles is not None and reply.handle:
            self._handles[script.session] = reply.handle
        return reply, {}


async def conversation(http: aiohttp.ClientSession, target: Target, w: Workload, index: int, run: str,
                       out: list[TurnResult], deadline: float, warm: WarmGate | None = None) -> None:
    script = Script(w, index, run)
    messages = script.opening()
    if warm is None and (pause := script.think()):
        await asyncio.sleep(pause)          # arrivals spread over one think time, not one burst at t=0
    for turn in range(w.turns):
        if turn == 1 and warm is not None:
            await warm.wait()
        if time.perf_counter() > deadline:
            return
        messages.append(script.question(turn))
        began = time.perf_counter()
        try:
            reply, headers = await target.send(http, script, messages, turn, w)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            reply, headers = Reply(error=f"{type(exc).__name__}: {exc}"[:200]), {}
        result = TurnResult(index, turn, ok=not reply.error, ttft_s=reply.ttft_s,
                            total_s=time.perf_counter() - began, prompt_tokens=reply.prompt_tokens,
                            plan=headers.get("x-pd-plan", ""), reason=headers.get("x-pd-reason", ""),
                            reused_tokens=int(headers.get("x-pd-reused-tokens", 0) or 0), error=reply.error,
                            prompt_ids=reply.prompt_ids, output_ids=reply.output_ids)
        out.append(result)
        if not result.ok:
            if warm is not None and turn == 0:
                warm.leave()
            return
        messages.append({"role": "assistant", "content": "".join(reply.content)})
        if pause := script.think():
            await asyncio.sleep(pause)


@dataclass
class RunResult:
    turns: list[TurnResult]
    wall_s: float

    @property
    def ok(self) -> list[TurnResult]:
        return [t for t in self.turns if t.ok]

    @property
    def errors(self) -> int:
        return len(self.turns) - len(self.ok)

    @property
    def turns_per_s(self) -> float:
        return len(self.ok) / self.wall_s if self.wall_s else 0.0

    def ttft(self, *, later_turns: bool = False) -> list[float]:
        return [t.ttft_s for t in self.ok if t.turn >= (1 if later_turns else 0)]


async def run(target: Target, w: Workload, *, concurrency: int | None = None, open_rate: float | None = None,
              duration_s: float | None = None, run_id: str | None = None, first: int = 0,
              on_warm=None) -> RunResult:
    """Closed loop with `concurrency` conversations at a time, or open loop at `open_rate` conversations/s.
    `duration_s` stops starting new turns after that long (turns in flight finish). `on_warm`: called once
    every conversation has finished its first turn and before any second turn (all conversations at once,
    closed loop), to measure later turns apart; RunResult.wall_s then counts from there."""
    run_id = run_id or uuid.uuid4().hex[:8]
    out: list[TurnResult] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=600)
    began = time.perf_counter()
    deadline = began + duration_s if duration_s else float("inf")
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        if open_rate:
            rng = Script(w, -1, run_id)._rng
            tasks = []
            for index in range(first, first + w.conversations):
                tasks.append(asyncio.create_task(conversation(http, target, w, index, run_id, out, deadline)))
                await asyncio.sleep(rng.expovariate(open_rate))
                if time.perf_counter() > deadline:
                    break
            await asyncio.gather(*tasks)
        elif on_warm is not None:
            def warmed() -> None:
                nonlocal began
                on_warm()
                began = time.perf_counter()
            warm = WarmGate(w.conversations, warmed)
            await asyncio.gather(*(conversation(http, target, w, i, run_id, out, deadline, warm)
                                   for i in range(first, first + w.conversations)))
            out = [t for t in out if t.turn >= 1]
        else:
            queue = iter(range(first, first + w.conversations))

            async def worker() -> None:
                for index in queue:
                    await conversation(http, target, w, index, run_id, out, deadline)
            await asyncio.gather(*(worker() for _ in range(concurrency or w.conversations)))
    return RunResult(out, time.perf_counter() - began)


class WarmGate:
    """Holds every conversation after its first turn until all got there, then calls `on_open` and lets them on."""

    def __init__(self, parties: int, on_open) -> None:
        self._left, self._on_open, self._open = parties, on_open, asyncio.Event()

    def leave(self) -> None:
        self._left -= 1
        if self._left == 0 and not self._open.is_set():
            self._on_open()
            self._open.set()

    async def wait(self) -> None:
        self.leave()
        await self._open.wait()


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); 0.0 for no data."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(result: RunResult) -> dict[str, float]:
    ttft = result.ttft()
    return {"turns": len(result.ok), "errors": result.errors, "turns_per_s": result.turns_per_s,
            "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p90_ms": percentile(ttft, 90) * 1e3,
            "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "ttft_mean_ms": statistics.fmean(ttft) * 1e3 if ttft else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="OpenAI base URL of a gateway or proxy")
    ap.add_argument("--floor", action="store_true", help="call --prefill then --decode directly (no proxy)")
    ap.add_argument("--prefill", action="append", default=[])
    ap.add_argument("--decode", action="append", default=[])
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=None, help="closed loop: conversations at once")
    ap.add_argument("--open-rate", type=float, default=None, help="open loop: new conversations per second")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--history-tokens", type=int, default=0)
    ap.add_argument("--think-s", type=float, default=0.0)
    ap.add_argument("--no-sessions", action="store_true")
    ap.add_argument("--duration-s", type=float, default=None)
    ap.add_argument("--pid", type=int, default=None, help="report this process's CPU per turn (the gateway)")
    args = ap.parse_args()
    w = Workload(conversations=args.conversations, turns=args.turns, new_tokens=args.new_tokens,
                 history_tokens=args.history_tokens, think_s=args.think_s, sessions=not args.no_sessions)
    target: Target = FloorTarget(args.prefill, args.decode) if args.floor else OpenAITarget(args.url)
    meter = CpuMeter(args.pid) if args.pid else None
    result = arun(run(target, w, concurrency=args.concurrency, open_rate=args.open_rate,
                             duration_s=args.duration_s))
    line = summary(result)
    if meter:
        line["cpu_ms_per_turn"] = meter.seconds() * 1e3 / max(1, line["turns"])
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in line.items()))


class CpuMeter:
    """CPU seconds (user + system, all threads) a process spent since this meter was made. Reads the scheduler's
    nanosecond counters (/proc/PID/task/*/schedstat) where there are some; else psutil's 10 ms ticks."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._proc = None
        self._start = self._now()

    def _now(self) -> float:
        tasks = f"/proc/{self._pid}/task"
        try:
            total = 0
            for tid in os.listdir(tasks):
                with open(f"{tasks}/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            return total / 1e9
        except OSError:
            import psutil

            self._proc = self._proc or psutil.Process(self._pid)
            times = self._proc.cpu_times()
            return times.user + times.system

    def seconds(self) -> float:
        return self._now() - self._start


class UserSystemMeter:
    """User and system CPU seconds (all threads) a process spent since this meter was made, apart: the kernel's
    share of a proxy's CPU (socket reads and writes) against its own code's. psutil's clock ticks, so measure at
    least a second of CPU."""

    def __init__(self, pid: int) -> None:
        import psutil

        self._proc = psutil.Process(pid)
        self._start = self._proc.cpu_times()

    def seconds(self) -> tuple[float, float]:
        now = self._proc.cpu_times()
        return now.user - self._start.user, now.system - self._start.system


def arun(coro):
    """asyncio.run on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    main()
