"""Faults under load (issue 35), on the timed simulators: `python bench/gpu/load.py --sim --faults`.

pd-gateway with its defaults in front of one P and one D, the chat workload at 8 conversations at once, three
phases: D killed (SIGKILL) mid-run and started again on its port 2 s later; P the same; D at KV capacity (its KV a
fifth of the working set, so it queues and preempts). Judged per phase:
- every turn ends as a streamed answer or an OpenAI error (an `error` object, over HTTP or as an SSE event);
  a turn past the client's timeout is `hung`, anything else (a reset connection, a page) is `other`;
- recovery: from the restart to the first turn started after it that was answered (the health loop runs every
  second here);
- no leaked blocks: once the gateway's conversations are dropped and D's leases have run out, D's KV usage is
  back to 0;
- the simulators' oracle: no block of wrong KV read.
Last line: `faults: turns= answered= openai_errors= other_errors= hung= recovery_s= corrupt= kv_leaked=`.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
import time
from typing import Any

import loadstats as stats
from load import ADMIN_KEY, drop_conversations, kv_usage
from loadclient import Client, Point
from loadwork import SHAPES

from bench.local import TIMING
from bench.servers import Servers, get_json
from gateway.processes import Server, start

LEASE_S = 4.0          # D's and P's kv_lease_duration here: leases run out soon after the load
FLAGS = ["--stream-kv-params", "--batched-steps", "--kv-lease-duration", str(LEASE_S), *TIMING]


def _restart(servers: Servers, old: Server, at_s: float, log: dict[str, float]) -> threading.Thread:
    """SIGKILL `old` after `at_s`, start it again on its port 2 s later; `log` gets when it answered again."""
    def go() -> None:
        time.sleep(at_s)
        old.stop(signal.SIGKILL)
        time.sleep(2)
        new = start(old.args, port=old.port)
        servers.callback(new.stop)
        log["restarted_at"] = time.perf_counter()
    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def phase(name: str, blocks: int, kill: str | None, duration_s: float, scale: float) -> dict[str, Any]:
    with Servers() as s:
        p, d = s.sims([("prefill", f"f-p-{name}", [*FLAGS, "--num-blocks", "6000"]),
                       ("decode", f"f-d-{name}", [*FLAGS, "--num-blocks", str(blocks)])])
        gw = s.gateways([([p], [d], ["--reuse-policy", "cost", "--local-prefill-max-tokens", "8192",
                                     "--decode-kv-lease-s", str(LEASE_S), "--health-interval-s", "1",
                                     "--admin-key", ADMIN_KEY])])[0]
        log: dict[str, float] = {}
        began = time.perf_counter()
        killer = _restart(s, {"D": d, "P": p}[kill], duration_s / 4, log) if kill else None
        point = Point("chat", SHAPES["chat"].scaled(scale), concurrency=8, duration_s=duration_s, think_scale=0.02)
        turns = asyncio.run(Client(gw.url, "demo", f"faults-{name}", turn_timeout_s=60).run(point))
        if killer:
            killer.join()
        drop_conversations(gw.url, {t.session for t in turns if t.session})
        time.sleep(LEASE_S + 3)
        oracle = [get_json(e.url + "/sim/stats") for e in (p, d)]
        return judge(name, turns, began, log, oracle, kv_usage([d.url]))


def judge(name: str, turns: list, began: float, log: dict[str, float], oracle: list[dict],
          usage: float) -> dict[str, Any]:
    kinds = [t.error_kind for t in turns if not t.ok]
    recovery = None
    if "restarted_at" in log:
        back = log["restarted_at"] - began
        after = [t.start_s for t in turns if t.ok and t.start_s >= back]
        recovery = round(min(after) - back, 2) if after else None
    row = {"phase": name, "turns": len(turns), "answered": sum(t.ok for t in turns),
           "openai_errors": kinds.count("openai"), "other_errors": kinds.count("other"), "hung": kinds.count("hung"),
           "recovery_s": recovery, "corrupt": sum(o["kv_reads_corrupt"] for o in oracle),
           "kv_usage_after": round(usage, 4), "d_handles_open": _open(oracle[1]),
           "plans": stats.row([t for t in turns if t.ok], 1.0)["plans"], "errors_seen": sorted(set(
               t.error[:80] for t in turns if not t.ok))[:4]}
    print(f"  {name}: {row}", flush=True)
    return row


def _open(s: dict) -> int:
    """Handles D issued that nobody read, released or let expire: what still holds its blocks."""
    return s["handles_leased"] + s["handles_pinned_total"] - s["handles_consumed"] - s["handles_expired"]


def run_faults(args: argparse.Namespace) -> str:
    duration, scale = (30.0, 0.1) if args.smoke else (60.0, 0.25)
    rows = [phase("d_killed", 6000, "D", duration, scale), phase("p_killed", 6000, "P", duration, scale),
            phase("d_at_capacity", 400 if args.smoke else 1500, None, duration, scale)]
    total = {k: sum(r[k] for r in rows) for k in ("turns", "answered", "openai_errors", "other_errors", "hung",
                                                  "corrupt")}
    recoveries = [r["recovery_s"] for r in rows if r["recovery_s"] is not None]
    line = (f"faults: turns={total['turns']} answered={total['answered']} openai_errors={total['openai_errors']} "
            f"other_errors={total['other_errors']} hung={total['hung']} "
            f"recovery_s={max(recoveries) if recoveries else 'na'} corrupt={total['corrupt']} "
            f"kv_leaked={max(r['kv_usage_after'] for r in rows):.4f}")
    args.faults_rows = rows
    return line
