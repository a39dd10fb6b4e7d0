"""The same gateway behind two ASGI servers, side by side in one run: uvicorn (uvloop + httptools, what
`pd-gateway serve` uses) and granian (Rust HTTP, `bench/granian_gateway.py`). Issue 16 item 3.

    python bench/asgi_servers.py [--rounds 2] [--conversations 64] [--turns 2] [--think-s 1]

Both gateways share the zero-timing sims and Redis of `bench/compare.py`'s first phase; the set-ups take turns
(A B ... B A) so a change in the machine's load hits both alike. Per server: TTFT p50/p99 added over `floor with
reuse`, the gateway's own p50 (`pdgw_gateway_seconds{span="internal"}`), its CPU per turn at this load and at
saturation. granian must be importable (it is not a dependency of the gateway). Last line:
    asgi_servers: uvicorn_added_p50_ms= granian_added_p50_ms= uvicorn_cpu_ms= granian_cpu_ms= \
        uvicorn_sat_cpu_ms= granian_sat_cpu_ms=
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.compare import GATEWAY_TTL, ZERO_SIM, _delta, alternate, drive, gateway_quantile, reset  # noqa: E402
from bench.loadgen import FloorTarget, OpenAITarget, percentile  # noqa: E402
from bench.servers import Servers, _spawn, engine_flags, free_port, metrics  # noqa: E402
from bench.workload import Workload  # noqa: E402

FLOOR = "floor with reuse"


def granian(s: Servers, prefill, decode, flags: list[str]):
    port = free_port()
    server = _spawn([sys.executable, str(ROOT / "bench" / "granian_gateway.py"), "--log-level", "warning", *flags,
                     *engine_flags(prefill, decode), "--host", "127.0.0.1", "--port", str(port)], port=port)
    s.callback(server.stop)
    return server


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument("--saturation-s", type=float, default=2.0)
    args = ap.parse_args(argv)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    w = Workload(conversations=args.conversations, turns=args.turns, new_tokens=48, think_s=args.think_s, seed=1)
    with Servers() as s:
        redis = s.redis()
        p, d = s.sims([("prefill", "zp0", ZERO_SIM), ("decode", "zd0", ZERO_SIM)])
        flags = ["--redis-url", redis.url, *GATEWAY_TTL]
        servers = {"uvicorn": s.gateway([p], [d], *flags), "granian": granian(s, [p], [d], flags)}
        targets = {FLOOR: (FloorTarget([p.url], [d.url], reuse=True), None),
                   **{name: (OpenAITarget(g.url), g) for name, g in servers.items()}}
        for target, _ in targets.values():
            drive(target, replace(w, conversations=8, turns=2, think_s=0.0, seed=99), concurrency=8)
        before = {name: metrics(g.url) for name, g in servers.items()}
        runs, cpu = alternate(targets, [p, d], w, rounds=args.rounds, concurrency=args.concurrency)
        internal = {name: gateway_quantile(_delta(before[name], metrics(g.url)), "internal", 0.5)
                    for name, g in servers.items()}
        saturated = {}
        for name, g in servers.items():
            reset(p, d)
            run, used = drive(OpenAITarget(g.url), replace(w, think_s=0.0, conversations=100_000, seed=2),
                              concurrency=args.concurrency, duration_s=args.saturation_s, pid=g.proc.pid)
            saturated[name] = (run.turns_per_s, used, run.errors)
    floor = runs[FLOOR].ttft()
    lines = [f"load average at start: {load}", "",
             "| server | turns | errors | TTFT p50 ms | p99 | added p50 ms | added p99 ms | gateway internal p50 ms "
             "| CPU ms/turn | saturated turns/s | CPU ms/turn saturated |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    added = {}
    for name, run in runs.items():
        t = run.ttft()
        p50, p99 = percentile(t, 50) * 1e3, percentile(t, 99) * 1e3
        if name == FLOOR:
            lines.append(f"| {name} | {len(run.ok)} | {run.errors} | {p50:.2f} | {p99:.2f} | — | — | — | — | — | — |")
            continue
        added[name] = ((percentile(t, 50) - percentile(floor, 50)) * 1e3, (percentile(t, 99) - percentile(floor, 99)) * 1e3)
        tps, sat_cpu, sat_err = saturated[name]
        lines.append(f"| {name} | {len(run.ok)} | {run.errors + sat_err} | {p50:.2f} | {p99:.2f} | {added[name][0]:+.2f} | "
                     f"{added[name][1]:+.2f} | {internal[name] or float('nan'):.3f} | {cpu[name]:.2f} | {tps:.0f} | "
                     f"{sat_cpu or float('nan'):.2f} |")
    final = (f"asgi_servers: uvicorn_added_p50_ms={added['uvicorn'][0]:.3f} granian_added_p50_ms="
             f"{added['granian'][0]:.3f} uvicorn_cpu_ms={cpu['uvicorn']:.3f} granian_cpu_ms={cpu['granian']:.3f} "
             f"uvicorn_sat_cpu_ms={saturated['uvicorn'][1] or float('nan'):.3f} "
             f"granian_sat_cpu_ms={saturated['granian'][1] or float('nan'):.3f}")
    print("\n".join(lines))
    print(final)
    return final


if __name__ == "__main__":
    main()
