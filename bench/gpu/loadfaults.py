"""Faults under load (issue 35), on the timed simulators: `python bench/gpu/load.py --sim --faults`; on a
deployment's engines: `python bench/gpu/load.py --faults --gateway URL --prefill URL --decode URL ...`
(loadfaults_deploy.py).

pd-gateway with its defaults in front of one P and one D, the chat workload at 8 conversations at once, three
phases: D killed (SIGKILL) mid-run and started again on its port 2 s later; P the same; D at KV capacity (its KV a
fifth of the working set, so it queues and preempts). Judged per phase:
- every turn ends as a streamed answer or an OpenAI error (an `error` object, over HTTP or as an SSE event);
  a turn past the client's timeout is `hung`, anything else (a reset connection, a page) is `other`;
- recovery: from the engine answering /health again to the first turn started after it that was answered (the
  health loop runs every second here);
- no leaked blocks: once the gateway's conversations are dropped and D's leases have run out, D's KV usage is
  back to 0; without --smoke D pins for PIN_TTL_S and its usage is read again once that has passed (CI's size
  keeps the simulator's 480 s, too long to wait out);
- the simulators' oracle: no block of wrong KV read.
Last line: `faults: turns= answered= openai_errors= other_errors= hung= recovery_s= corrupt= kv_leaked=`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import loadstats as stats
from load import ADMIN_KEY, drop_conversations, kv_usage
from loadclient import Client, Point, Turn
from loadwork import SHAPES

from bench.servers import Servers, get_json
from gateway.processes import Server, start

LEASE_S = 4.0          # D's and P's kv_lease_duration here: leases run out soon after the load
# Without --smoke, D's decoder_kv_blocks_ttl (the H200's, serve.sh TTL_S): short enough to wait out after a phase,
# long enough that the gateway still holds every handle of a phase when it drops them (it stops using one 30 s
# before D unpins it, and what it no longer uses it leaves to D's TTL)
PIN_TTL_S = 120.0
ENGINE = ["--stream-kv-params", "--batched-steps", "--kv-lease-duration", str(LEASE_S)]
COUNTS = ("turns", "answered", "openai_errors", "other_errors", "hung")


def _restart(servers: Servers, old: Server, at_s: float, log: dict[str, float]) -> threading.Thread:
    """SIGKILL `old` after `at_s`, start it again on its port 2 s later; `log` gets when it answered again."""
    def go() -> None:
        time.sleep(at_s)
        old.stop(signal.SIGKILL)
        time.sleep(2)
        new = start(old.args, port=old.port)
        servers.callback(new.stop)
        log["back_at"] = time.perf_counter()
    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def phase(name: str, blocks: int, kill: str | None, duration_s: float, scale: float,
          ttl_s: float | None) -> dict[str, Any]:
    # imported here, not above: bench/local.py pulls in the agent bench and the gateway's insides, which the
    # deployment form (loadfaults_deploy.py, importing this module) has no use for
    from bench.local import TIMING
    flags = [*ENGINE, *TIMING]
    ttl, gw_ttl = (["--decoder-kv-blocks-ttl", str(ttl_s)], ["--decoder-kv-blocks-ttl-s", str(ttl_s)]) if ttl_s \
        else ([], [])
    with Servers() as s:
        p, d = s.sims([("prefill", f"f-p-{name}", [*flags, "--num-blocks", "6000"]),
                       ("decode", f"f-d-{name}", [*flags, *ttl, "--num-blocks", str(blocks)])])
        gw = s.gateways([([p], [d], ["--reuse-policy", "cost", "--local-prefill-max-tokens", "8192",
                                     "--decode-kv-lease-s", str(LEASE_S), "--health-interval-s", "1",
                                     "--admin-key", ADMIN_KEY, *gw_ttl])])[0]
        log: dict[str, float] = {}
        began = time.perf_counter()
        killer = _restart(s, {"D": d, "P": p}[kill], duration_s / 4, log) if kill else None
        point = Point("chat", SHAPES["chat"].scaled(scale), concurrency=8, duration_s=duration_s, think_scale=0.02)
        turns = asyncio.run(Client(gw.url, "demo", f"faults-{name}", turn_timeout_s=60).run(point))
        if killer:
            killer.join()
        ended = time.perf_counter()
        drop_conversations(gw.url, {t.session for t in turns if t.session})
        time.sleep(LEASE_S + 3)
        oracle = [get_json(e.url + "/sim/stats") for e in (p, d)]
        extra = {"corrupt": sum(o["kv_reads_corrupt"] for o in oracle), "kv_usage_after": round(kv_usage([d.url]), 4),
                 "d_handles_open": _open(oracle[1])}
        if ttl_s:
            extra.update(_after_ttl(d.url, ended, ttl_s))
        return judge(name, turns, log["back_at"] - began if "back_at" in log else None, extra)


def _after_ttl(url: str, ended: float, ttl_s: float) -> dict[str, Any]:
    """D's usage once it is 0 or once every pin the load made has run out (its TTL after the load ended)."""
    while (usage := kv_usage([url])) > 0 and time.perf_counter() < ended + ttl_s + 3:
        time.sleep(1)
    return {"kv_usage_after_ttl": round(usage, 4), "kv_idle_after_s": round(time.perf_counter() - ended, 1)
            if usage == 0 else None}


def judge(name: str, turns: list[Turn], back_s: float | None, extra: dict[str, Any]) -> dict[str, Any]:
    """One phase's row; `back_s`: when the killed engine answered /health again, in seconds since the load began."""
    kinds = [t.error_kind for t in turns if not t.ok]
    recovery = None
    if back_s is not None:
        after = [t.start_s for t in turns if t.ok and t.start_s >= back_s]
        recovery = round(min(after) - back_s, 2) if after else None
    row = {"phase": name, "turns": len(turns), "answered": sum(t.ok for t in turns),
           "openai_errors": kinds.count("openai"), "other_errors": kinds.count("other"), "hung": kinds.count("hung"),
           "recovery_s": recovery, **extra, "plans": stats.row([t for t in turns if t.ok], 1.0)["plans"],
           "errors_seen": sorted(set(t.error[:80] for t in turns if not t.ok))[:4]}
    print(f"  {name}: {row}", flush=True)
    return row


def _open(s: dict) -> int:
    """Handles D issued that nobody read, released or let expire: what still holds its blocks."""
    return s["handles_leased"] + s["handles_pinned_total"] - s["handles_consumed"] - s["handles_expired"]


def summary(rows: list[dict[str, Any]], corrupt: str, leaked: str) -> str:
    total = {k: sum(r[k] for r in rows) for k in COUNTS}
    recoveries = [r["recovery_s"] for r in rows if r["recovery_s"] is not None]
    return (f"faults: turns={total['turns']} answered={total['answered']} openai_errors={total['openai_errors']} "
            f"other_errors={total['other_errors']} hung={total['hung']} "
            f"recovery_s={max(recoveries) if recoveries else 'na'} corrupt={corrupt} kv_leaked={leaked}")


def save(out: str, result: dict[str, Any]) -> None:
    if out != "-":
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "faults.json").write_text(json.dumps(result, indent=1, default=str))


def run_faults(args: argparse.Namespace) -> str:
    """The three phases, on simulators started here (--sim) or on the deployment given; faults.json in --out."""
    if not args.sim:
        from loadfaults_deploy import run_deployment
        return run_deployment(args)
    duration, scale = (30.0, 0.1) if args.smoke else (60.0, 0.25)
    ttl = None if args.smoke else PIN_TTL_S
    rows = [phase("d_killed", 6000, "D", duration, scale, ttl), phase("p_killed", 6000, "P", duration, scale, ttl),
            phase("d_at_capacity", 400 if args.smoke else 1500, None, duration, scale, ttl)]
    line = summary(rows, str(sum(r["corrupt"] for r in rows)), f"{max(r['kv_usage_after'] for r in rows):.4f}")
    save(args.out, {"phases": rows, "summary": line})
    return line
