"""The gateway from several source trees (and interpreters), side by side in one run: a change measured against
its base on the same engines, Redis and load. The set-ups take turns A B ... B A with `floor with reuse` among
them, so a change in the machine's load hits all alike (on a shared 2-core machine nothing else is comparable).

    python bench/ab.py base=/tmp/base-tree new=.[:/path/to/python3.12] [--rounds 4] [--conversations 64] \
        [--concurrency 64] [--turns 4] [--think-s 1]

A tree is a checkout of this repository (`git archive REF | tar -x -C DIR`); `:PYTHON` runs its gateway under
another interpreter (one with the gateway's dependencies installed). Per set-up: TTFT p50/p90 and added over the
floor, the gateway's CPU per turn, its own time per span (`pdgw_gateway_seconds`) and its phase means.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.compare import GATEWAY_TTL, ZERO_SIM, _delta, _gateway_spans, _phase_means, alternate, drive  # noqa: E402
from bench.loadgen import FloorTarget, OpenAITarget, percentile  # noqa: E402
from bench.servers import Servers, _await, engine_flags, metrics  # noqa: E402
from bench.workload import Workload  # noqa: E402
from gateway.processes import Server, stop_process  # noqa: E402

FLOOR = "floor with reuse"


def gateway(s: Servers, tree: str, python: str, prefill: list[Server], decode: list[Server],
            flags: list[str]) -> Server:
    """`pd-gateway serve` from `tree` (its own `gateway` package first on the path)."""
    tmp = Path(tempfile.mkdtemp(prefix="pdgw-ab-"))
    args = [python, "-m", "gateway", "serve", "--log-level", "warning", "--reuse-policy", "always", *flags,
            *engine_flags(prefill, decode), "--host", "127.0.0.1", "--port", "0", "--port-file", str(tmp / "port")]
    log = open(tmp / "log", "wb")
    path = [str(Path(tree).resolve()), os.environ.get("PYTHONPATH", "")]    # the tree's package first, then the
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}  # rest (the host's wheels: host/run.sh)
    proc = subprocess.Popen(args, cwd=tree, stdout=log, stderr=subprocess.STDOUT, env=env)
    s.callback(stop_process, proc)
    return _await(proc, tmp / "port", tmp / "log", args)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="NAME=TREE[:PYTHON]")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--think-s", type=float, default=1.0)
    args = ap.parse_args(argv)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    w = Workload(conversations=args.conversations, turns=args.turns, new_tokens=48, think_s=args.think_s, seed=1)
    with Servers() as s:
        redis = s.redis()
        p, d = s.sims([("prefill", "zp0", ZERO_SIM), ("decode", "zd0", ZERO_SIM)])
        flags = ["--redis-url", redis.url, *GATEWAY_TTL]
        gateways = {}
        for variant in args.variants:
            name, _, spec = variant.partition("=")
            tree, _, python = spec.partition(":")
            gateways[name] = gateway(s, tree, python or sys.executable, [p], [d], flags)
        targets = {FLOOR: (FloorTarget([p.url], [d.url], reuse=True), None),
                   **{name: (OpenAITarget(g.url), g) for name, g in gateways.items()}}
        for target, _ in targets.values():
            drive(target, replace(w, conversations=8, turns=2, think_s=0.0, seed=99), concurrency=8)
        before = {name: metrics(g.url) for name, g in gateways.items()}
        runs, cpu = alternate(targets, [p, d], w, rounds=args.rounds, concurrency=args.concurrency)
        own = {name: _delta(before[name], metrics(g.url)) for name, g in gateways.items()}
    floor = runs[FLOOR].ttft()
    print(f"load average at start: {load}; at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, run in runs.items():
        t = run.ttft()
        line = (f"{name}: {len(run.ok)} turns, {run.errors} errors, TTFT p50 {percentile(t, 50) * 1e3:.2f} ms, "
                f"p90 {percentile(t, 90) * 1e3:.2f}")
        if name != FLOOR:
            line += (f", added p50 {(percentile(t, 50) - percentile(floor, 50)) * 1e3:+.2f}, p90 "
                     f"{(percentile(t, 90) - percentile(floor, 90)) * 1e3:+.2f}, CPU {cpu[name]:.2f} ms/turn\n"
                     f"  own time p50: {_gateway_spans(own[name])}\n  phases: {_phase_means(own[name])}")
        print(line)


if __name__ == "__main__":
    main()
