"""The relay's ceiling (issue 40): streamed tokens per second at saturation through pd-gateway with 1, 2, 4 and 8
workers (`serve --workers N`) and through vllm-router (stateless PD), on zero-timing simulators whose every answer
is long, in one run.

    python bench/scaleout.py [--quick] [--workers 1,2,4,8] [--pin] [--duration-s 15] [--streams 256]

A stream is a closed loop of one-turn conversations (a fresh session id each, answers of STREAM_TOKENS tokens,
one SSE chunk each), so every turn is a P leg, a D leg and a stored handle, and the rest is relaying D's chunks.
Tokens are D's own count (/sim/stats) over a window of `--duration-s` once every stream runs; CPU is the
proxy's process tree (the supervisor and its workers) over the same window. With `--pin` the proxy under test
has `--proxy-cpus` CPUs (every arm the same ones), each simulator one of its own, and the load generator's
processes the rest; without it everything shares the machine (a 2-core check that it runs, not a measure).

Last line: scaleout: tokens_per_s_1= tokens_per_s_2= tokens_per_s_4= tokens_per_s_8= router_tokens_per_s=
scaling_8=   (scaling_8: 8 workers' tokens/s over 8 x one worker's)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import arun  # noqa: E402
from bench.servers import ProxyCpus, Servers  # noqa: E402
from bench.streaming import STREAM_SIM, STREAM_TOKENS, generated  # noqa: E402

DECODE_SIMS = 4     # one D simulator streams a 1,000-token answer in about 20 ms: several keep D off the critical path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="workers 1,2 only (a check that it runs)")
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--duration-s", type=float, default=15.0)
    ap.add_argument("--streams", type=int, default=256, help="concurrent streams in all (closed loop)")
    ap.add_argument("--clients", type=int, default=3, help="load-generator processes")
    ap.add_argument("--pin", action="store_true", help="each part on CPUs of its own (see the docstring)")
    ap.add_argument("--proxy-cpus", type=int, default=8)
    ap.add_argument("--no-router", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.workers = "1,2"
    counts = [int(n) for n in args.workers.split(",")]
    layout = Layout.of(args.proxy_cpus, args.clients) if args.pin else None
    results, notes = run(counts, args, layout)
    print_table(results, notes, layout)
    print(summary(results))


class Layout:
    """Which CPUs each part runs on: the proxy, the simulators (one each, redis beside P), the load generator."""

    def __init__(self, proxy: list[int], sims: list[list[int]], clients: list[int]) -> None:
        self.proxy, self.sims, self.clients = proxy, sims, clients

    @classmethod
    def of(cls, proxy_cpus: int, clients: int) -> Layout:
        cpus = sorted(os.sched_getaffinity(0))
        need = proxy_cpus + 1 + DECODE_SIMS + clients
        if len(cpus) < need:
            raise SystemExit(f"--pin needs {need} CPUs ({proxy_cpus} proxy, {1 + DECODE_SIMS} simulators, {clients} "
                             f"load generators); this machine has {len(cpus)}")
        proxy, rest = cpus[:proxy_cpus], cpus[proxy_cpus:]
        sims, clients_cpus = [[c] for c in rest[:1 + DECODE_SIMS]], rest[1 + DECODE_SIMS:]
        return cls(proxy, sims, clients_cpus)

    def describe(self) -> str:
        return (f"proxy on CPUs {self.proxy[0]}-{self.proxy[-1]} ({len(self.proxy)}); simulators one CPU each "
                f"({', '.join(str(s[0]) for s in self.sims)}; Redis with P); load generator on CPUs "
                f"{','.join(map(str, self.clients))}")


def run(counts: list[int], args: argparse.Namespace, layout: Layout | None) -> tuple[dict[str, dict], list[str]]:
    results: dict[str, dict] = {}
    notes: list[str] = []
    with Servers() as s:
        if layout:
            s.proxy_cpus = ProxyCpus(layout.proxy, per_proxy=len(layout.proxy))
        redis = s.redis()
        if layout:
            os.sched_setaffinity(redis.pid, set(layout.sims[0]))
        specs = [("prefill", "p0", STREAM_SIM)] + [("decode", f"d{i}", STREAM_SIM) for i in range(DECODE_SIMS)]
        sims = s.sims(specs, cpus=[set(c) for c in layout.sims] if layout else None)
        p, ds = sims[:1], sims[1:]
        for n in counts:
            gw = s.gateway(p, ds, "--workers", str(n), "--redis-url", redis.url)
            results[f"workers_{n}"] = measure(gw.url, gw.proc.pid, ds, args, layout)
            print(f"{n} workers: {results[f'workers_{n}']}", flush=True)
            gw.stop()
        if not args.no_router:
            try:
                router = s.router(p, ds)
            except Exception as exc:   # not installed or not runnable here: say so
                notes.append(f"vllm-router not run: {str(exc).splitlines()[0][:200]}")
            else:
                results["router"] = measure(router.url, router.proc.pid, ds, args, layout)
                print(f"vllm-router: {results['router']}", flush=True)
    return results, notes


def measure(url: str, pid: int, ds: list, args: argparse.Namespace, layout: Layout | None) -> dict:
    """Tokens/s and CPU per token over a window in which every stream runs."""
    warm_s = 3.0
    until = time.time() + warm_s + args.duration_s + 2.0
    per_client = max(1, args.streams // args.clients)
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.clients) as pool:
        jobs = [pool.apply_async(_client, (url, per_client, until, layout.clients if layout else None))
                for _ in range(args.clients)]
        time.sleep(warm_s)
        tokens0, cpu0, t0 = _tokens(ds), _cpu(pid), time.perf_counter()
        time.sleep(args.duration_s)
        tokens1, cpu1, t1 = _tokens(ds), _cpu(pid), time.perf_counter()
        turns, errors = (sum(x) for x in zip(*(j.get(timeout=120) for j in jobs)))
    tokens = tokens1 - tokens0
    return {"tokens_per_s": round(tokens / (t1 - t0)), "cpu_us_per_token": round((cpu1 - cpu0) * 1e6 / max(1, tokens), 2),
            "cpus_busy": round((cpu1 - cpu0) / (t1 - t0), 2), "turns": turns, "errors": errors}


def _tokens(ds: list) -> int:
    return sum(generated(d) for d in ds)


def _cpu(pid: int) -> float:
    """User + system seconds of the process and its children (a supervisor's workers)."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _client(url: str, streams: int, until: float, cpus: list[int] | None) -> tuple[int, int]:
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    return arun(_streams(url, streams, until))


async def _streams(url: str, streams: int, until: float) -> tuple[int, int]:
    counts = [0, 0]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        async def loop() -> None:
            while time.time() < until:
                ok = await _turn(http, url)
                counts[0 if ok else 1] += 1
        await asyncio.gather(*(loop() for _ in range(streams)))
    return counts[0], counts[1]


async def _turn(http: aiohttp.ClientSession, url: str) -> bool:
    """One streamed turn of a fresh conversation, drained: the client's cost per chunk is a line read."""
    body = {"model": "demo", "stream": True, "max_tokens": STREAM_TOKENS,
            "messages": [{"role": "user", "content": f"tell me a long story {uuid.uuid4().hex}"}]}
    try:
        async with http.post(url + "/v1/chat/completions", json=body,
                             headers={"X-Session-Id": uuid.uuid4().hex}) as resp:
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    return resp.status == 200
            return False
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


def print_table(results: dict[str, dict], notes: list[str], layout: Layout | None) -> None:
    print(f"\n{layout.describe() if layout else 'not pinned: everything shares the machine'}; "
          f"{DECODE_SIMS} D simulators and one P, zero timing, answers of {STREAM_TOKENS} tokens\n")
    print("| proxy | streamed tokens/s | proxy CPU µs/token | proxy CPUs busy | turns | errors |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        label = name.replace("workers_", "pd-gateway, ") + (" workers" if name.startswith("workers_") else "")
        print(f"| {label} | {r['tokens_per_s']} | {r['cpu_us_per_token']} | {r['cpus_busy']} | {r['turns']} | "
              f"{r['errors']} |")
    for note in notes:
        print(f"\n{note}")
    print()


def summary(results: dict[str, dict]) -> str:
    tps = {name: r["tokens_per_s"] for name, r in results.items()}
    one, eight = tps.get("workers_1"), tps.get("workers_8")
    scaling = f"{eight / (8 * one):.2f}" if one and eight else "na"
    fields = [f"tokens_per_s_{n}={tps.get(f'workers_{n}', 'na')}" for n in (1, 2, 4, 8)]
    return f"scaleout: {' '.join(fields)} router_tokens_per_s={tps.get('router', 'na')} scaling_8={scaling}"


if __name__ == "__main__":
    main()
