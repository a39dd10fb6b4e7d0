"""Faults under load on a deployment's engines (issue 35; the simulators' form is loadfaults.py):

    python bench/gpu/load.py --faults --gateway URL --prefill URL --decode URL \
        --d-pidfile RUN/D.pid --d-restart "setsid bash RUN/run_D.sh" \
        --p-pidfile RUN/P.pid --p-restart "setsid bash RUN/run_P.sh" [--coloc URL] --out DIR

Phases, each `--faults-duration-s` of closed-loop load through the gateway:
- d_killed, p_killed: the chat workload at `--faults-concurrency`; a quarter into the load the engine's process
  group gets SIGKILL (vLLM's engine-core processes die with its API server, as in an OOM kill), 2 s later its
  restart command runs (detached, output appended to the pid file's `.log`), and the phase waits (at most
  `--faults-restart-wait-s`) until it answers /health. If it was back less than `--faults-after-s` before the
  load ended, `--faults-after-s` more of load follows (fresh conversations), so recovery is measured on the
  gateway and not on the engine's start: `engine_back_s` (kill to /health) and `recovery_s` (/health to the first
  answered turn started after it) are reported apart.
- d_at_capacity: the long workload at `--faults-capacity-concurrency` (32: about twice D's KV on the H200 with
  KV_GIB=14); a real D's KV cannot shrink without a restart, so the load grows instead.
After each phase the gateway's conversations are dropped and D's `vllm:kv_cache_usage_perc` is read until it is
back to its level before the phase (at most `--faults-kv-wait-s`): `kv_leaked` is what stayed above it (handles
whose release was lost stay pinned until D's decoder_kv_blocks_ttl), and `kv_end` what stays above D's level before
the first phase once all are done. No oracle here (`corrupt=na`); with `--coloc`, sampled later turns are replayed
on the co-located engine and judged as the load bench judges them (load.judge): `flagged=`.
Last line: `faults: turns= answered= openai_errors= other_errors= hung= recovery_s= corrupt=na kv_leaked= flagged=
kv_end=`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from load import drop_conversations, judge as replay, kv_usage
from loadclient import Client, Point, Turn
from loadfaults import judge, save, summary
from loadwork import SHAPES

from gateway.processes import answers

PHASES = ("d_killed", "p_killed", "d_at_capacity")
RESTART_DELAY_S = 2.0
IDLE_SLACK = 0.001        # D's usage counts as idle within this of its level before the phase
MAX_SAMPLES = 40          # sampled turns replayed on --coloc


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """load.py's flags for `--faults` without `--sim` (besides --gateway, --coloc, --scale, --think-scale, --model,
    --seed, --turn-timeout-s, --admin-key, --out)."""
    def a(flag: str, text: str, **kw: Any) -> None:
        ap.add_argument(flag, help=f"deployment faults: {text}", **kw)
    a("--prefill", "P's URL")
    a("--decode", "D's URL (its KV usage is read)")
    for e in ("d", "p"):
        a(f"--{e}-pidfile", f"the file holding {e.upper()}'s pid (its process group is killed)")
        a(f"--{e}-restart", f"the shell command that starts {e.upper()} again")
    a("--faults-phases", "which phases, in this order", default=",".join(PHASES))
    a("--faults-duration-s", "load per phase", type=float, default=60.0)
    a("--faults-concurrency", "chat conversations at once (the kill phases)", type=int, default=8)
    a("--faults-capacity-concurrency", "long conversations at once (d_at_capacity)", type=int, default=32)
    a("--faults-after-s", "load at least this long once a killed engine is back", type=float, default=20.0)
    a("--faults-restart-wait-s", "how long an engine may take to start again", type=float, default=240.0)
    a("--faults-kv-wait-s", "how long D's KV may take to be back to idle", type=float, default=30.0)


@dataclass
class Engine:
    """An engine a phase kills and starts again."""
    name: str
    url: str
    pidfile: Path
    restart: str
    proc: subprocess.Popen | None = None       # the restart command's shell (the engine runs in its own session)

    def kill(self) -> None:
        pid = int(self.pidfile.read_text().split()[0])
        # serve.sh starts each engine under setsid: its pid leads a group that holds vLLM's engine-core
        # processes too, which would keep the GPU memory and the NIXL ports if only the API server died
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)

    def start(self) -> None:
        with open(self.pidfile.with_suffix(".log"), "ab") as log:
            self.proc = subprocess.Popen(self.restart, shell=True, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _fault(engine: Engine, at_s: float, wait_s: float, log: dict[str, Any]) -> threading.Thread:
    """After `at_s`: kill `engine`, start it again, and note when (time.perf_counter()) it answers /health."""
    def go() -> None:
        time.sleep(at_s)
        try:
            engine.kill()
        except (OSError, ValueError) as exc:          # no pid file, no such process: the phase runs unfaulted
            log["fault_error"] = f"{type(exc).__name__}: {exc}"
            return
        log["killed_at"] = time.perf_counter()
        time.sleep(RESTART_DELAY_S)
        engine.start()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if answers(engine.url + "/health"):
                log["back_at"] = time.perf_counter()
                return
            time.sleep(0.5)
    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def _load(args: argparse.Namespace, tag: str, workload: str, concurrency: int, duration_s: float) -> list[Turn]:
    shape = SHAPES[workload] if args.scale == 1 else SHAPES[workload].scaled(args.scale)
    point = Point(workload, shape, concurrency=concurrency, duration_s=duration_s, think_scale=args.think_scale,
                  seed=args.seed)
    client = Client(args.gateway, args.model, tag, sample=bool(args.coloc), turn_timeout_s=args.turn_timeout_s)
    return asyncio.run(client.run(point))


def _usage(url: str) -> float | None:
    """D's KV usage; None while D does not answer (kv_usage reads an unreachable engine as 0)."""
    return kv_usage([url]) if answers(url + "/health") else None


def _settle(url: str, idle: float, limit_s: float) -> tuple[float | None, float | None]:
    """Poll D's usage until it is back to `idle` (then: usage, seconds taken) or `limit_s` passed (usage, None)."""
    t0 = time.perf_counter()
    while True:
        usage, waited = _usage(url), time.perf_counter() - t0
        if usage is not None and usage <= idle + IDLE_SLACK:
            return usage, round(waited, 1)
        if waited >= limit_s:
            return usage, None
        time.sleep(1)


def phase(args: argparse.Namespace, name: str, kill: Engine | None, run_tag: str) -> tuple[dict[str, Any], list]:
    before = _usage(args.decode) or 0.0
    workload, concurrency = ("long", args.faults_capacity_concurrency) if kill is None else \
        ("chat", args.faults_concurrency)
    log: dict[str, Any] = {}
    began = time.perf_counter()
    killer = _fault(kill, args.faults_duration_s / 4, args.faults_restart_wait_s, log) if kill else None
    turns = _load(args, f"{run_tag}-{name}", workload, concurrency, args.faults_duration_s)
    if killer:
        killer.join()
        if "back_at" in log and time.perf_counter() - log["back_at"] < args.faults_after_s:
            offset = time.perf_counter() - began
            more = _load(args, f"{run_tag}-{name}-after", workload, concurrency, args.faults_after_s)
            for t in more:
                t.start_s += offset
            turns += more
    drop_conversations(args.gateway, {t.session for t in turns if t.session}, args.admin_key)
    after, idle_s = _settle(args.decode, before, args.faults_kv_wait_s)
    extra = {"workload": f"{workload}:c{concurrency}", "corrupt": "na", "kv_usage_before": round(before, 4),
             "kv_usage_after": None if after is None else round(after, 4), "kv_idle_after_s": idle_s,
             "kv_leaked": None if after is None else round(max(0.0, after - before), 4)}
    if kill:
        extra["engine"] = kill.name
        extra["engine_back_s"] = round(log["back_at"] - log["killed_at"], 1) if "back_at" in log else None
        extra["fault_error"] = log.get("fault_error")
    row = judge(name, turns, log["back_at"] - began if "back_at" in log else None, extra)
    return row, [t for t in turns if t.ok and t.sample and "top" in t.sample]


def _engines(args: argparse.Namespace, phases: list[str]) -> dict[str, Engine]:
    out = {}
    for key, url in (("d", args.decode), ("p", args.prefill)):
        pidfile, restart = getattr(args, f"{key}_pidfile"), getattr(args, f"{key}_restart")
        if f"{key}_killed" in phases and not (url and pidfile and restart):
            raise SystemExit(f"--faults: phase {key}_killed needs --{'decode' if key == 'd' else 'prefill'}, "
                             f"--{key}-pidfile and --{key}-restart")
        if url and pidfile and restart:
            out[key] = Engine(key.upper(), url.rstrip("/"), Path(pidfile), restart)
    return out


def run_deployment(args: argparse.Namespace) -> str:
    phases = [p for p in args.faults_phases.split(",") if p]
    if not args.gateway or not args.decode or set(phases) - set(PHASES):
        raise SystemExit(f"--faults needs --gateway, --decode and phases among {','.join(PHASES)}")
    engines = _engines(args, phases)
    run_tag = f"faults{os.getpid()}-{int(time.time()) % 100000}"
    result: dict[str, Any] = {"deployment": {k: getattr(args, k) for k in (
        "gateway", "prefill", "decode", "coloc", "faults_duration_s", "faults_concurrency",
        "faults_capacity_concurrency", "faults_after_s", "scale", "think_scale", "turn_timeout_s")}, "phases": []}
    samples: list[Turn] = []
    for name in phases:
        print(f"{name} ({args.faults_duration_s:g} s of load)", flush=True)
        row, s = phase(args, name, engines.get(name[0]) if name.endswith("_killed") else None, run_tag)
        result["phases"].append(row)
        samples += s
        save(args.out, result)
    flagged = "na"
    if args.coloc and samples:
        result["judge"] = replay(samples[::-(-len(samples) // MAX_SAMPLES)], args.coloc, args.model)
        print(f"judge: {result['judge']}", flush=True)
        flagged = str(result["judge"]["flagged"])
    # handles a phase could not release are D's until its TTL: by now (the H200's 120 s) they may have run out
    first = result["phases"][0]["kv_usage_before"]
    end, _ = _settle(args.decode, first, args.faults_kv_wait_s)
    result["kv_usage_end"] = None if end is None else round(end, 4)
    leaked = [r["kv_leaked"] for r in result["phases"]]
    worst = "na" if None in leaked else f"{max(leaked):.4f}"          # na: D did not answer
    result["summary"] = (summary(result["phases"], "na", worst) + f" flagged={flagged} "
                         f"kv_end={'na' if end is None else f'{max(0.0, end - first):.4f}'}")
    save(args.out, result)
    return result["summary"]
