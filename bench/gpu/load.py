"""The load bench (issue 35): many streamed multi-turn conversations at once, per arm on the same engines.

Arms (each gets conversations no other arm sent, so no cache is shared across arms):
  gateway    pd-gateway with its defaults in front of P and D
  stateless  vllm-router's PD mode in front of the same P and D (stateless PD: the peer a user would pick)
  coloc      one co-located vLLM engine with prefix caching and the KV memory of P and D together
  coloc2     two co-located engines (each with one engine's KV) behind vllm-router's cache_aware routing
Workloads `chat`, `long`, `agent` (bench/gpu/loadwork.py) at points `WORKLOAD:cN` (closed loop, N at once) or
`WORKLOAD:oR` (open loop, R new conversations per second). Per arm and point: first- and later-turn TTFT, ITL,
tokens/s, turns/s, goodput, reuse and the plans' reasons, engines' preemptions / NIXL failures / expired leases,
errors (bench/gpu/loadstats.py). 1 in 20 of the gateway's later turns is replayed on the co-located engine with
logprobs and judged by gateway/verify/distance.py against C's own noise floor.

    python bench/gpu/load.py --gateway URL --stateless URL --coloc URL --coloc2 URL \
        --engines gateway=P,D --engines stateless=P,D --engines coloc=C --engines coloc2=C1,C2 \
        --points chat:c8,chat:c64,long:c32,agent:c16 --duration-s 30 --out DIR   # any deployment
    python bench/gpu/load.py --sim [--quick | --smoke]    # the same on timed simulators started here
    python bench/gpu/load.py --report DIR                  # the markdown and PNG again from DIR/load.json
    python bench/gpu/load.py --sim --faults [--smoke]      # D killed, P killed, D at KV capacity (loadfaults.py)
    python bench/gpu/load.py --faults --gateway URL --prefill URL --decode URL --d-pidfile F --d-restart CMD \
        --p-pidfile F --p-restart CMD [--coloc URL]        # the same on a deployment (loadfaults_deploy.py)
Last line: `gpuload: later_p50_vs_coloc= later_p99_vs_coloc= itl_p99_vs_coloc= goodput_vs_coloc=
goodput_vs_stateless= reuse= errors= flagged=` (the worst point for each ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for p in (str(HERE), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import loadstats as stats  # noqa: E402
import wire  # noqa: E402
from loadclient import Client, Point  # noqa: E402
from loadwork import SHAPES  # noqa: E402

# Arm after arm, each through every point: D pins the turns of vllm-router's stateless PD for its
# decoder_kv_blocks_ttl (a bidirectional D pins every request that carries kv_transfer_params, docs/protocol.md),
# so that arm runs last and its pins burden only itself; the gateway's conversations are dropped after each point.
ARMS = (stats.GATEWAY, stats.COLOC, stats.COLOC2, stats.STATELESS)
ADMIN_KEY = "pdgw-bench-admin"     # the bench's gateways' --admin-key (serve.sh, loadsim.py): conversations dropped
DEFAULT_POINTS = "chat:c8,chat:c64,long:c32,agent:c16"
ENGINE_COUNTERS = {"preemptions": "vllm:num_preemptions_total", "nixl_failed": "vllm:nixl_num_failed_transfers_total",
                   "kv_expired": "vllm:nixl_num_kv_expired_reqs_total"}


def parse_points(spec: str, duration_s: float, think_scale: float, scale: float, seed: int) -> list[Point]:
    points = []
    for item in spec.split(","):
        workload, _, loop = item.strip().partition(":")
        shape = SHAPES[workload] if scale == 1 else SHAPES[workload].scaled(scale)
        closed = loop.startswith("c")
        value = float(loop[1:])
        points.append(Point(workload, shape, concurrency=int(value) if closed else 0,
                            rate=0.0 if closed else value, duration_s=duration_s, think_scale=think_scale,
                            seed=seed))
    return points


def engine_counts(urls: list[str]) -> dict[str, float]:
    samples = [wire.metrics(u) for u in urls]
    return {k: sum(wire.msum(s, name, {}) for s in samples) for k, name in ENGINE_COUNTERS.items()}


def kv_usage(urls: list[str]) -> float:
    return max((wire.msum(wire.metrics(u), "vllm:kv_cache_usage_perc", {}) for u in urls), default=0.0)


def run_arm(arm: str, url: str, engines: list[str], point: Point, args: argparse.Namespace,
            run_tag: str) -> tuple[dict, list]:
    before, gw_before = engine_counts(engines), wire.metrics(url, args.admin_key) if arm == stats.GATEWAY else {}
    tag = f"{run_tag}-{arm}-{point.name}"
    client = Client(url, args.model, tag, sample=arm == stats.GATEWAY, turn_timeout_s=args.turn_timeout_s)
    t0 = time.perf_counter()
    turns = asyncio.run(client.run(point))
    wall = time.perf_counter() - t0
    row = stats.row(turns, wall)
    after = engine_counts(engines)
    row["engines"] = {k: after[k] - before[k] for k in after}
    if arm == stats.GATEWAY:
        row["gateway"] = gateway_counts(gw_before, wire.metrics(url, args.admin_key))
        dropped = drop_conversations(url, {t.session for t in turns if t.session}, args.admin_key)
        time.sleep(2)                 # releases go through P: let them land before D's usage is read
        row["engines"]["kv_usage_after_d"] = round(kv_usage(engines[-1:]), 4)     # engines: [P, D]
        row["dropped"] = dropped
        row["gateway_engines"] = admin_engines(url, args.admin_key)     # incl. what each engine's KV events say
    print(f"  turns={row['turns']} errors={row['errors']} later p50/p99={row['later_p50']:.0f}/"
          f"{row['later_p99']:.0f} ms itl p99={row['itl_p99']:.1f} ms goodput={row['goodput']:.2f}/s "
          f"reuse={row['reuse']:.0%} {dict(list(row['plans'].items())[:3])}", flush=True)
    return row, [t for t in turns if t.sample and "top" in t.sample]


def gateway_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the gateway did during the arm, from its /metrics: mean ms per phase of its turns and of its own
    time per span, handles released and handles D did not return by why, conversations found by how, tokens
    pinned at the end."""
    def by_label(name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for key in set(before) | set(after):
            base, _, rest = key.partition("{")
            if base == name and f'{label}="' in rest:
                value = rest.split(f'{label}="', 1)[1].split('"', 1)[0]
                out[value] = out.get(value, 0.0) + after.get(key, 0.0) - before.get(key, 0.0)
        return {k: round(v, 4) for k, v in out.items() if v}
    sums, counts = by_label("pdgw_gateway_seconds_sum", "span"), by_label("pdgw_gateway_seconds_count", "span")
    return {"phases_ms": wire.gateway_phases(before, after),
            "own_ms": {k: round(sums.get(k, 0.0) / n * 1e3, 2) for k, n in counts.items()},
            "released": by_label("pdgw_handles_released_total", "reason"),
            "missing": by_label("pdgw_handles_missing_total", "reason"),
            "lookups": by_label("pdgw_conversation_lookups_total", "how"),
            "pinned_tokens": wire.msum(after, "pdgw_pinned_tokens", {})}


def _admin(url: str, path: str, admin_key: str, method: str = "GET") -> Any:
    req = urllib.request.Request(f"{url.rstrip('/')}{path}", method=method,
                                 headers={"Authorization": f"Bearer {admin_key}"})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())


def drop_conversations(url: str, sessions: set[str], admin_key: str = ADMIN_KEY) -> int:
    """DELETE /admin/conversations/ID for each: D's handles released, so the next point starts with D's KV free.
    X-PD-Session's id holds a '#' (scoped by the conversation's head): percent-encoded."""
    n = 0
    for s in sessions:
        try:
            _admin(url, f"/admin/conversations/{urllib.parse.quote(s, safe='')}", admin_key, "DELETE")
            n += 1
        except (OSError, ValueError):
            pass
    return n


def admin_engines(url: str, admin_key: str) -> Any:
    """The gateway's view of its engines (GET /admin/engines): health, data plane, KV-events knowledge."""
    try:
        return _admin(url, "/admin/engines", admin_key)
    except (OSError, ValueError) as exc:
        return {"error": str(exc)[:200]}


def judge(samples: list, coloc: str, model: str) -> dict[str, Any]:
    """Each sampled turn's prompt on C alone (a fresh cache_salt: computed from scratch) against the gateway's first
    token distribution. The noise floor is C against itself on its other path: the same prompt asked twice without
    a salt, the second time from C's own prefix cache (as the gateway's later turns are served from cached or
    transferred KV). bf16 rounds the two paths apart (bench/GPU-RESULTS.md: up to 1.47); wrong KV moves it by 6+."""
    from gateway.verify import distance as lp
    records = []
    for t in samples:
        body = {"model": model, "prompt": t.sample["prompt_ids"], "max_tokens": 1, "temperature": 0,
                "logprobs": 20, "return_tokens_as_token_ids": True}
        _, _, ref = wire.post(coloc, "/v1/completions", {**body, "cache_salt": uuid.uuid4().hex})
        salt = {"cache_salt": uuid.uuid4().hex}
        wire.post(coloc, "/v1/completions", {**body, **salt})                  # computed, and cached
        _, _, again = wire.post(coloc, "/v1/completions", {**body, **salt})   # from C's prefix cache
        try:
            ref_top = lp.from_completion(ref)
            got = {lp.token_key(k): float(v) for k, v in t.sample["top"].items()}
            records.append({"d": lp.distance(ref_top, got), "floor": lp.distance(ref_top, lp.from_completion(again))})
        except (KeyError, TypeError, ValueError, IndexError):
            continue
    noise = max((r["floor"].max_abs for r in records), default=0.0)
    flagged = sum(lp.flagged(r["d"], noise) for r in records)
    return {"samples": len(records), "flagged": flagged, "noise_floor": noise,
            "max_abs": max((r["d"].max_abs for r in records), default=0.0)}


def run(args: argparse.Namespace, urls: dict[str, str], engines: dict[str, list[str]], note: str) -> dict[str, Any]:
    points = parse_points(args.points or DEFAULT_POINTS, args.duration_s, args.think_scale, args.scale, args.seed)
    run_tag = uuid.uuid4().hex[:6]
    result: dict[str, Any] = {"title": args.title, "note": note, "points": [], "samples": []}
    samples: list = []
    rows: dict[str, dict[str, dict]] = {p.name: {} for p in points}
    for arm in (a for a in ARMS if a in urls and (not args.only or a in args.only.split(","))):
        for point in points:
            print(f"{arm} at {point.name} ({args.duration_s:g} s, think x{args.think_scale:g})", flush=True)
            drain(engines.get(arm, [])[-1:], args.drain_s)
            rows[point.name][arm], s = run_arm(arm, urls[arm], engines.get(arm, []), point, args, run_tag)
            samples += s
            result["points"] = [{"point": p.name, "workload": p.workload, "concurrency": p.concurrency,
                                 "rate": p.rate, "arms": rows[p.name], "ratios": stats.ratios(rows[p.name]),
                                 "note": point_note(p)} for p in points]
            result["summary"] = stats.summary_line(result["points"], result.get("judge", {}).get("flagged", 0))
            save(result, args.out)
        coloc = engines.get(stats.COLOC) or [urls.get(stats.COLOC)]
        if samples and coloc[0] and "judge" not in result:   # C idle now: replayed before its own arm
            result["judge"] = judge(samples, coloc[0], args.model)
            print(f"judge: {result['judge']}", flush=True)
    result["summary"] = stats.summary_line(result["points"], result.get("judge", {}).get("flagged", 0))
    save(result, args.out)
    return result


def drain(decode: list[str], limit_s: float, below: float = 0.05) -> None:
    """Wait (at most `limit_s`) until D's KV is free of what earlier points left pinned: stateless PD's pins (no
    one releases them), leases, handles whose release was lost; they last D's decoder_kv_blocks_ttl, and without
    the wait a point starts on a D its predecessor filled (the H200 runs after issue 36: 84-89 % used)."""
    t0 = time.perf_counter()
    while decode and limit_s > 0 and time.perf_counter() - t0 < limit_s and kv_usage(decode) > below:
        time.sleep(2)
    if time.perf_counter() - t0 > 1:
        print(f"  waited {time.perf_counter() - t0:.0f} s for D's KV to drain ({kv_usage(decode):.0%} used)",
              flush=True)


def point_note(point: Point) -> str:
    loop = f"{point.concurrency} at once" if point.concurrency else f"{point.rate:g} new conversations/s"
    return f"{point.workload}, {loop}, {point.duration_s:g} s per arm, think time x{point.think_scale:g}"


def save(result: dict[str, Any], out: str | None) -> None:
    if out and out != "-":
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "load.json").write_text(json.dumps(result, indent=1, default=str))


def report(result: dict[str, Any], out: str) -> None:
    lines = stats.markdown(result)
    if j := result.get("judge"):
        lines.append(f"Replayed on the co-located engine: {j['samples']} sampled later turns, {j['flagged']} "
                     f"flagged (max |Δ logprob| {j['max_abs']:.4f}, noise floor {j['noise_floor']:.4f}).")
    lines += ["", "`" + result["summary"] + "`"]
    (Path(out) / "load.md").write_text("\n".join(lines) + "\n")
    try:
        stats.plot(result, str(Path(out) / "load.png"))
    except ImportError:                  # no matplotlib where the bench ran: `--report DIR` draws it later
        print("load.png not drawn: matplotlib is not installed", flush=True)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for arm in ARMS:
        ap.add_argument(f"--{arm}", help=f"base URL of the {stats.LABELS[arm]} arm")
    ap.add_argument("--admin-key", default=ADMIN_KEY, help="the gateway's admin key (its conversations dropped)")
    ap.add_argument("--only", help="ARM[,ARM]: run only these of the arms given")
    ap.add_argument("--engines", action="append", default=[], help="ARM=URL,URL: the engines whose /metrics count")
    ap.add_argument("--points", help=f"WORKLOAD:cN|oR[,...] (default: {DEFAULT_POINTS}; with "
                    "--sim, the size's)")
    ap.add_argument("--duration-s", type=float, default=60.0, help="per arm and point: no new turn after this")
    ap.add_argument("--think-scale", type=float, default=1.0, help="think times x this (0: none)")
    ap.add_argument("--scale", type=float, default=1.0, help="every workload length x this (the simulators' sizes)")
    ap.add_argument("--model", default="pdgw-bench")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drain-s", type=float, default=0.0,
                    help="before each arm and point, wait up to this long for D's KV to be free of earlier pins")
    ap.add_argument("--turn-timeout-s", type=float, default=300.0, help="a turn longer than this counts as hung")
    ap.add_argument("--out", default=str(ROOT / "bench" / "gpu-out" / "load"))
    ap.add_argument("--title", default="load bench")
    ap.add_argument("--sim", action="store_true", help="start timed simulators, gateways and vllm-router here")
    ap.add_argument("--gateway-flag", action="append", default=[], metavar="=--FLAG",
                    help="with --sim: one more flag for the gateway (write --gateway-flag=--local-first-turns)")
    ap.add_argument("--kv-mode", choices=["pull", "push"], default="pull",
                    help="with --sim: the gateway arm's P and D in push mode (P writes each prompt's KV into D's "
                    "blocks as it finishes; no bidirectional transfer, so D's KV is reused by the local path only)")
    ap.add_argument("--quick", action="store_true", help="with --sim: a few minutes")
    ap.add_argument("--smoke", action="store_true", help="with --sim: the CI size (about 2 minutes)")
    ap.add_argument("--faults", action="store_true", help="the faults step: on simulators with --sim "
                    "(bench/gpu/loadfaults.py), else on the deployment given (bench/gpu/loadfaults_deploy.py)")
    from loadfaults_deploy import add_arguments
    add_arguments(ap)
    ap.add_argument("--report", metavar="DIR", help="only rewrite DIR/load.md and DIR/load.png from DIR/load.json")
    args = ap.parse_args(argv)
    if args.report:
        result = json.loads((Path(args.report) / "load.json").read_text())
        result.setdefault("summary", stats.summary_line(result["points"], result.get("judge", {}).get("flagged", 0)))
        report(result, args.report)
        return result["summary"]
    if args.faults:
        from loadfaults import run_faults
        line = run_faults(args)
        print(line, flush=True)
        return line
    if args.sim:
        from loadsim import run_on_sims
        result = run_on_sims(args, run)
    else:
        urls = {a: getattr(args, a) for a in ARMS if getattr(args, a)}
        engines = {k: v.split(",") for k, _, v in (e.partition("=") for e in args.engines)}
        result = run(args, urls, engines, "a deployment's URLs")
    if args.out != "-":
        save(result, args.out)
        report(result, args.out)
    print(result["summary"], flush=True)
    return result["summary"]


if __name__ == "__main__":
    main()
