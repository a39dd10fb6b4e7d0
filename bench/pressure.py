"""Under pressure (issues 15, 25): D's KV pinned by idle conversations, and P's cache against the working set.

    python bench/pressure.py            # full sizes; writes bench/PRESSURE.md and bench/pressure.png
    python bench/pressure.py --quick    # small sizes, about 10 minutes on 2 cores (same files; --out - writes none)
    python bench/pressure.py --quick --out /tmp/p.md   # tables in /tmp/p.md, the curves in /tmp/pressure.png

1. Many idle conversations over 1 P + 1 D, D's KV swept from 5 % to 200 % of their history. Time is compressed by
   one factor everywhere it is a setting: D's `decoder_kv_blocks_ttl`, the reader's expiry margin, the gateway's
   TTL, margin and health interval (it reads D's /metrics), and the users' think times (30-300 s at full scale);
   the GPU-like compute costs are not. At every point the arms run at the same time, each on its own P and D
   (D resized, fresh gateways): pd-gateway with adaptive pins (`--decode-pin-policy adaptive`, the default, up
   to `--decode-pin-budget` 0.5), with the fixed budget (`lru`), without a budget (TTL only), and stateless PD
   (vllm-router; engines without bidirectional transfer, so D pins nothing). Figures: TTFT of later turns (also
   as a ratio to stateless PD's at the same point), reuse on later turns, D's waits for free blocks (the
   simulator queues a request whose blocks do not fit, as vLLM's scheduler does) and preemptions, errors,
   corrupt reads (the simulator's oracle).
2. Working set vs P's cache: P's KV capacity swept from 10 % to 200 % of the conversations' working set (D large);
   TTFT of later turns and P's computed tokens for pd-gateway, stateless PD (vllm-router, P's prefix cache) and
   the naive proxy. reuse_gain_at_2x = stateless PD's mean TTFT of later turns / pd-gateway's, where the working
   set is twice P's cache.

Every figure is measured in this run; the last line (at D's KV share `d_share`, 10 %: budget = the adaptive arm,
the default)
    pressure: budget_p99_ms=A nobudget_p99_ms=B stateless_p99_ms=C corrupt=N errors=N reuse_gain_at_2x=G
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import loadgen, servers as bench_servers  # noqa: E402
from bench.loadgen import OpenAITarget, RunResult, percentile  # noqa: E402
from bench.servers import Servers, get_json, metrics, post, sample_sum  # noqa: E402
from bench.workload import Workload  # noqa: E402

HERE = Path(__file__).resolve().parent
BLOCK = 16
TEMPLATE_TOKENS = 8           # the demo chat template's tokens around each message (measured: 6-8)
REAL_TTL_S, REAL_GATEWAY_MARGIN_S, REAL_EXPIRY_MARGIN_S = 480.0, 30.0, 5.0
REAL_THINK_S = (30.0, 300.0)
ADAPTIVE = "pd-gateway, adaptive pins (budget 0.5)"
BUDGET = "pd-gateway, fixed budget 0.5"
NOBUDGET = "pd-gateway, TTL only"
STATELESS = "stateless PD (vllm-router)"
NAIVE = "naive proxy"
GATEWAY = "pd-gateway"


@dataclass(frozen=True)
class Sizes:
    idle_conversations: int
    idle_turns: int
    idle_history: int           # system prompt tokens opening each idle conversation
    idle_new: int               # user tokens per turn
    idle_output: tuple[int, int]
    factor: float               # time compression
    idle_duration_s: float      # no new turn starts after this (turns in flight finish)
    d_share: float              # D's KV as a share of the idle conversations' history: the summary line's point
    d_shares: tuple[float, ...]  # the points of section 1's sweep
    sweep_conversations: int
    sweep_turns: int
    sweep_history: int
    sweep_new: int
    sweep_output: tuple[int, int]
    ratios: tuple[float, ...]   # P's KV / the sweep's working set
    sweep_think_s: float        # mean think time (uniform in 0..2x): below saturation, TTFT is per-turn cost
    decode_ms_per_token: float


FULL = Sizes(idle_conversations=2000, idle_turns=4, idle_history=256, idle_new=48, idle_output=(16, 48), factor=20,
             idle_duration_s=240, d_share=0.10,
             d_shares=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0), sweep_conversations=32, sweep_turns=6, sweep_history=1000,
             sweep_new=100, sweep_output=(100, 200), ratios=(0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0), sweep_think_s=2.0,
             decode_ms_per_token=10)
QUICK = Sizes(idle_conversations=64, idle_turns=3, idle_history=256, idle_new=48, idle_output=(16, 48), factor=100,
              idle_duration_s=20, d_share=0.10,
              d_shares=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0), sweep_conversations=16, sweep_turns=4, sweep_history=1000,
              sweep_new=100, sweep_output=(100, 160), ratios=(0.1, 0.5, 2.0), sweep_think_s=0.5,
              decode_ms_per_token=0.5)


def cost(sizes: Sizes, output: tuple[int, int]) -> list[str]:
    """The GPU-like cost model of bench/compare.py (section 3)."""
    return ["--prefill-ms-per-token", "0.1", "--decode-ms-per-token", str(sizes.decode_ms_per_token),
            "--transfer-ms-per-block", "0.05", "--output-tokens", f"{output[0]}:{output[1]}", "--stream-kv-params"]


def history_tokens(history: int, turns: int, new: int, output: tuple[int, int]) -> float:
    """A conversation's KV at its end: opening, every question and answer, the template around each."""
    return history + turns * (new + statistics.fmean(output) + 2 * TEMPLATE_TOKENS) + TEMPLATE_TOKENS


def blocks(tokens: float) -> int:
    return int(-(-tokens // BLOCK))


# -- 1. many idle conversations, D's KV swept ------------------------------------------------------------------
PIN_ARMS = {ADAPTIVE: (0.5, "adaptive"), BUDGET: (0.5, "lru"), NOBUDGET: (0.0, "lru")}   # budget, policy
SIM_IDS = {ADAPTIVE: "adaptive", BUDGET: "budget", NOBUDGET: "nobudget", STATELESS: "stateless"}


@dataclass
class IdleSetup:
    ttl_s: float
    history_blocks: int                  # estimated; the report uses the measured one
    d_blocks: dict[float, int]           # D's KV share -> D's blocks
    engines: dict[str, tuple]            # arm -> (P, D)
    router: object = None                # stateless PD's vllm-router over its engines


def share_blocks(sizes: Sizes) -> tuple[int, dict[float, int]]:
    per_conv = history_tokens(sizes.idle_history, sizes.idle_turns, sizes.idle_new, sizes.idle_output)
    history = blocks(per_conv) * sizes.idle_conversations
    shares = sorted({*sizes.d_shares, sizes.d_share})
    return history, {r: max(round(r * history), 3 * blocks(per_conv)) for r in shares}


def idle_specs(sizes: Sizes) -> list:
    """P and D for every arm; D starts at its largest size and is resized per point (`POST /sim/reset`)."""
    _, d_blocks = share_blocks(sizes)
    common = [*cost(sizes, sizes.idle_output), "--decoder-kv-blocks-ttl", f"{REAL_TTL_S / sizes.factor:g}",
              "--expiry-margin-s", f"{REAL_EXPIRY_MARGIN_S / sizes.factor:g}"]
    specs = []
    for arm, eid in SIM_IDS.items():
        off = ["--no-bidirectional"] if arm == STATELESS else []
        specs += [("prefill", f"ip_{eid}", [*common, "--num-blocks", "60000", *off]),
                  ("decode", f"id_{eid}", [*common, "--num-blocks", str(max(d_blocks.values())), *off])]
    return specs


def gateway_flags(sizes: Sizes, budget: float, policy: str = "adaptive") -> list[str]:
    return ["--decoder-kv-blocks-ttl-s", f"{REAL_TTL_S / sizes.factor:g}",
            "--handle-ttl-margin-s", f"{REAL_GATEWAY_MARGIN_S / sizes.factor:g}", "--decode-pin-budget", f"{budget:g}",
            "--decode-pin-policy", policy, "--health-interval-s", f"{min(2.0, max(0.5, 50.0 / sizes.factor)):g}"]


def idle_workload(sizes: Sizes) -> Workload:
    think = (REAL_THINK_S[0] / sizes.factor, REAL_THINK_S[1] / sizes.factor)
    return Workload(conversations=sizes.idle_conversations, turns=sizes.idle_turns, new_tokens=sizes.idle_new,
                    history_tokens=sizes.idle_history, think_range_s=think, seed=15)


def run_idle(setup: IdleSetup, sizes: Sizes) -> dict[float, dict]:
    return {share: run_share(setup, sizes, share, n) for share, n in setup.d_blocks.items()}


def run_share(setup: IdleSetup, sizes: Sizes, share: float, d_blocks: int) -> dict:
    """One point: every arm's D resized to `d_blocks`, fresh gateways (they read D's capacity at start-up and
    learn nothing from another point), the same conversations on every arm at once."""
    w = idle_workload(sizes)
    for p, d in setup.engines.values():
        resize(d, d_blocks)
        reset(p)
    with Servers() as point:
        gws = dict(zip(PIN_ARMS, point.gateways([([setup.engines[arm][0]], [setup.engines[arm][1]],
                                                   gateway_flags(sizes, *PIN_ARMS[arm])) for arm in PIN_ARMS])))
        targets = {**{arm: OpenAITarget(gw.url) for arm, gw in gws.items()},
                   STATELESS: OpenAITarget(setup.router.url)}
        warm = replace(w, conversations=4, turns=2, think_range_s=None, seed=99)
        loadgen.arun(_together(targets, warm, None))
        for p, d in setup.engines.values():
            resize(d, d_blocks)
            reset(p)
        before = {arm: metrics(gw.url) for arm, gw in gws.items()}
        runs = loadgen.arun(_together(targets, w, sizes.idle_duration_s))
        after = {arm: metrics(gw.url) for arm, gw in gws.items()}
    out = {"d_blocks": d_blocks}
    for arm, (p, d) in setup.engines.items():
        out[arm] = _idle_figures(runs[arm], get_json(p.url + "/sim/stats"), get_json(d.url + "/sim/stats"), sizes)
        if arm in gws:
            out[arm].update(plans=_plans(_delta(before[arm], after[arm])), **_pin_figures(after[arm]))
    return out


def _idle_figures(run: RunResult, ps: dict, ds: dict, sizes: Sizes) -> dict:
    later = run.ttft(later_turns=True)
    later_ok = [t for t in run.ok if t.turn >= 1]
    prompt = ps["prompt_tokens_computed"] + ps["prompt_tokens_loaded"] + ps["prompt_tokens_cached"]
    return {"turns": len(run.turns), "errors": run.errors,
            "error_sample": next((t.error for t in run.turns if not t.ok), ""),
            "p50_ms": percentile(later, 50) * 1e3, "p99_ms": percentile(later, 99) * 1e3,
            "later": len(later), "wall_s": run.wall_s,
            "reuse_later": (sum(t.plan in ("reuse", "partial") for t in later_ok) / len(later_ok)
                            if later_ok and any(t.plan for t in later_ok) else None),
            "d_waits": ds["requests_waited_for_blocks"], "d_wait_s": ds["block_wait_seconds_total"],
            "d_wait_max_s": ds["block_wait_seconds_max"], "d_holds_skipped": ds["holds_skipped_no_blocks"],
            "d_preempted": ds["requests_preempted"],
            "reuse": (ps["prompt_tokens_loaded"] + ps["prompt_tokens_cached"]) / prompt if prompt else 0.0,
            "p_computed": ps["prompt_tokens_computed"],
            "corrupt": ps["kv_reads_corrupt"] + ds["kv_reads_corrupt"],
            "kv_failures": ps["kv_load_failures"] + ds["kv_load_failures"],
            "plans": "", "used_ratio": None, "budget_blocks": None,
            "history_blocks": _history_blocks(run, sizes.idle_output)}


def _pin_figures(gw_metrics: dict) -> dict:
    """What the gateway measured of its pins on its one D (pdgw_pins_used_ratio, pdgw_pin_budget_blocks)."""
    used = [v for k, v in gw_metrics.items() if k.startswith("pdgw_pins_used_ratio{")]
    budget = [v for k, v in gw_metrics.items() if k.startswith("pdgw_pin_budget_blocks{")]
    return {"used_ratio": used[0] if used else None, "budget_blocks": budget[0] if budget else None}


async def _together(targets: dict, w: Workload, duration_s: float | None) -> dict[str, RunResult]:
    """The arms at the same time, same conversations (same seed), each on its own engines."""
    tag = uuid.uuid4().hex[:6]
    runs = await asyncio.gather(*(loadgen.run(t, w, concurrency=w.conversations, duration_s=duration_s,
                                              run_id=f"{tag}-{i}") for i, t in enumerate(targets.values())))
    return dict(zip(targets, runs))


def _history_blocks(run: RunResult, output: tuple[int, int]) -> int:
    """The conversations' history as measured: each one's last prompt plus a mean answer."""
    last: dict[int, int] = {}
    for t in run.ok:
        last[t.conversation] = max(last.get(t.conversation, 0), t.prompt_tokens)
    return sum(blocks(n + statistics.fmean(output)) for n in last.values())


# -- 2. working set vs P's cache -------------------------------------------------------------------------------
def sweep_workload(sizes: Sizes) -> Workload:
    return Workload(conversations=sizes.sweep_conversations, turns=sizes.sweep_turns, new_tokens=sizes.sweep_new,
                    history_tokens=sizes.sweep_history, think_s=sizes.sweep_think_s, seed=7)


def sweep_specs(sizes: Sizes) -> tuple[list, dict[float, int]]:
    """One P and one D for every point: P's pool is resized between runs (`POST /sim/reset {"num_blocks"}`),
    sized against the estimated working set (never below two whole conversations)."""
    per_conv = history_tokens(sizes.sweep_history, sizes.sweep_turns, sizes.sweep_new, sizes.sweep_output)
    working_set = blocks(per_conv) * sizes.sweep_conversations
    sim = cost(sizes, sizes.sweep_output)
    p_blocks = {r: max(round(r * working_set), 2 * blocks(per_conv)) for r in sizes.ratios}
    specs = [("prefill", "sp", [*sim, "--num-blocks", str(max(p_blocks.values()))]),
             ("decode", "sd", [*sim, "--num-blocks", "60000"])]
    return specs, p_blocks


def run_sweep(sweep: dict, sizes: Sizes) -> dict:
    w = sweep_workload(sizes)
    p, d = sweep["p"], sweep["d"]
    out: dict[float, dict] = {}
    for ratio, p_blocks in sweep["p_blocks"].items():
        out[ratio] = {"p_blocks": p_blocks}
        for arm, target in sweep["targets"].items():
            resize(p, p_blocks)
            reset(d)
            before = metrics(sweep["gateway"].url) if arm == GATEWAY else {}
            run = loadgen.arun(loadgen.run(target, replace(w, sessions=arm != STATELESS),
                                           concurrency=w.conversations))
            ps, ds = get_json(p.url + "/sim/stats"), get_json(d.url + "/sim/stats")
            later = run.ttft(later_turns=True)
            out[ratio][arm] = {"mean_ms": statistics.fmean(later) * 1e3 if later else 0.0,
                               "p50_ms": percentile(later, 50) * 1e3, "p99_ms": percentile(later, 99) * 1e3,
                               "turns": len(run.turns), "errors": run.errors,
                               "error_sample": next((t.error for t in run.turns if not t.ok), ""),
                               "p_computed_per_turn": ps["prompt_tokens_computed"] / max(1, len(run.ok)),
                               "p_waits": ps["requests_waited_for_blocks"],
                               "kv_failures": ps["kv_load_failures"] + ds["kv_load_failures"],
                               "corrupt": ps["kv_reads_corrupt"] + ds["kv_reads_corrupt"],
                               "history_blocks": _history_blocks(run, sizes.sweep_output),
                               "phases": _phase_means(before, metrics(sweep["gateway"].url)) if before else ""}
    return out


# -- helpers ----------------------------------------------------------------------------------------------------
def reset(*engines) -> None:
    for engine in engines:
        post(engine.url + "/sim/reset")


def resize(engine, num_blocks: int) -> None:
    """Reset a sim and give it a KV pool of `num_blocks`."""
    body = json.dumps({"num_blocks": num_blocks}).encode()
    req = urllib.request.Request(engine.url + "/sim/reset", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).read()


def _phase_means(before: dict, after: dict) -> str:
    """pd-gateway's own phase means in ms (its pdgw_turn_seconds): where its turns' time went."""
    out = []
    for phase in ("intake", "plan", "prefill", "decode_ttft"):
        count = sample_sum(after, "pdgw_turn_seconds_count", phase=phase) - \
            sample_sum(before, "pdgw_turn_seconds_count", phase=phase)
        total = sample_sum(after, "pdgw_turn_seconds_sum", phase=phase) - \
            sample_sum(before, "pdgw_turn_seconds_sum", phase=phase)
        if count:
            out.append(f"{phase} {total / count * 1e3:.1f}")
    return ", ".join(out)


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("pdgw_turns_total")}


def _plans(gw_metrics: dict) -> str:
    counts = {k.split("{")[1].rstrip("}"): int(v) for k, v in gw_metrics.items() if v}
    return ", ".join(f"{k.replace('plan=', '').replace('reason=', '').replace(chr(34), '')}: {v}"
                     for k, v in sorted(counts.items()))


def start(s: Servers, sizes: Sizes, notes: list[str]) -> tuple[IdleSetup, dict]:
    specs = idle_specs(sizes)
    sweep_sims, p_blocks = sweep_specs(sizes)
    engines = dict(zip([eid for _, eid, _ in specs + sweep_sims], s.sims(specs + sweep_sims)))
    sp, sd = engines["sp"], engines["sd"]
    [gateway] = s.gateways([([sp], [sd], [])])
    history, d_blocks = share_blocks(sizes)
    pairs = {arm: (engines[f"ip_{eid}"], engines[f"id_{eid}"]) for arm, eid in SIM_IDS.items()}
    setup = IdleSetup(REAL_TTL_S / sizes.factor, history, d_blocks, pairs,
                      s.router([pairs[STATELESS][0]], [pairs[STATELESS][1]]))
    sweep = {"p": sp, "d": sd, "p_blocks": p_blocks, "gateway": gateway,
             "targets": {GATEWAY: OpenAITarget(gateway.url), STATELESS: OpenAITarget(s.router([sp], [sd]).url),
                         NAIVE: OpenAITarget(s.naive([sp], [sd]).url)}}
    return setup, sweep


# -- the report --------------------------------------------------------------------------------------------------
IDLE_ARMS = (ADAPTIVE, BUDGET, NOBUDGET, STATELESS)


def report(args, sizes: Sizes, idle: IdleSetup, idle_out: dict, sweep: dict, notes: list[str],
           wall_s: float, png: str | None) -> tuple[str, str]:
    w = idle_workload(sizes)
    lines = [f"# Under pressure: `{' '.join(['python', 'bench/pressure.py', *args.argv])}`", "",
             f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; wall time {wall_s:.0f} s",
             f"- load average at the start: {args.load}", ""]
    measured = _measured_history(idle_out) or idle.history_blocks
    lines += ["## 1. Many idle conversations, 1 P + 1 D, D's KV from 5 % to 200 % of their history", "",
              f"{w.conversations} conversations at once, {w.turns} turns, a {sizes.idle_history}-token system prompt, "
              f"~{w.new_tokens} new tokens per question, answers {sizes.idle_output[0]}-{sizes.idle_output[1]} tokens. "
              f"Time compressed {sizes.factor:g}x: D's `decoder_kv_blocks_ttl` {idle.ttl_s:g} s (480 s), reader's "
              f"expiry margin {REAL_EXPIRY_MARGIN_S / sizes.factor:g} s (5 s), gateway margin "
              f"{REAL_GATEWAY_MARGIN_S / sizes.factor:g} s (30 s), think time uniform in "
              f"{w.think_range_s[0]:g}-{w.think_range_s[1]:g} s (30-300 s); GPU-like compute not compressed "
              f"(prefill 0.1 ms/token, decode {sizes.decode_ms_per_token:g} ms/token, transfer 0.05 ms/block). "
              f"The conversations' history: {measured} blocks (measured). No new turn starts after "
              f"{sizes.idle_duration_s:g} s. At each point the arms ran at the same time on their own engines "
              "(D resized, fresh gateways). `x stateless`: the arm's figure over stateless PD's at the same point. "
              "Reuse: later turns planned `reuse` or `partial`. Used: `pdgw_pins_used_ratio` at the end; budget: "
              "`pdgw_pin_budget_blocks` (the effective budget) at the end.", "",
              "| D KV / history | arm | turns | errors | TTFT p50 later turns ms | p99 ms | p50 x stateless | "
              "p99 x stateless | reuse, later turns | D waits for blocks | D preemptions | P reuse (loaded + cached) "
              "| used / budget blocks | corrupt | plans |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for share, point in idle_out.items():
        base = point[STATELESS]
        for arm in IDLE_ARMS:
            r = point[arm]
            pins = "—" if r["used_ratio"] is None else (
                f"{r['used_ratio']:.2f} / {r['budget_blocks']:.0f}" if r["budget_blocks"] is not None
                else f"{r['used_ratio']:.2f} / —")
            lines.append(f"| {_share(point, share, measured)} | {arm} | {r['turns']} | {r['errors']} | "
                         f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {_x(r['p50_ms'], base['p50_ms'])} | "
                         f"{_x(r['p99_ms'], base['p99_ms'])} | {_pct(r['reuse_later'])} | {r['d_waits']} | "
                         f"{r['d_preempted']} | {r['reuse']:.0%} | {pins} | {r['corrupt']} | {r['plans'] or '—'} |")
    lines += ["", *_targets(idle_out, measured)]
    errors = [f"{share:g}, {arm}: {point[arm]['error_sample']}" for share, point in idle_out.items()
              for arm in IDLE_ARMS if point[arm]["error_sample"]]
    lines += [""] + [f"- first error, {e}" for e in errors]
    wl = sweep_workload(sizes)
    lines += ["", "## 2. Working set vs P's cache, 1 P + 1 D (D large)", "",
              f"{wl.conversations} conversations at once, {wl.turns} turns, a {sizes.sweep_history}-token system "
              f"prompt, ~{wl.new_tokens} new tokens per question, answers {sizes.sweep_output[0]}-"
              f"{sizes.sweep_output[1]} tokens, think time uniform in 0-{2 * sizes.sweep_think_s:g} s; same cost model. Working set = the conversations' "
              "history at their end, measured (last prompt + a mean answer, in blocks). P's cache is P's whole KV "
              "(a prompt in flight holds its blocks too).", "",
              "| P KV / working set | set-up | mean TTFT later turns ms | p50 | p99 | P computed per turn | "
              "P waits for blocks | KV reads failed (engines) | errors | corrupt |", "|---|---|---|---|---|---|---|---|---|---|"]
    for ratio, point in sweep.items():
        for arm in (GATEWAY, STATELESS, NAIVE):
            r = point[arm]
            lines.append(f"| {_ratio(point, ratio)} | {arm} | {r['mean_ms']:.1f} | {r['p50_ms']:.1f} | "
                         f"{r['p99_ms']:.1f} | {r['p_computed_per_turn']:.0f} | {r['p_waits']} | {r['kv_failures']} | {r['errors']} | "
                         f"{r['corrupt']} |")
    lines += [""] + [f"- first error, {_ratio(point, ratio)}, {arm}: {point[arm]['error_sample']}"
                     for ratio, point in sweep.items() for arm in (GATEWAY, STATELESS, NAIVE)
                     if point[arm]["error_sample"]]
    lines += ["", "pd-gateway's own phase means, ms (`pdgw_turn_seconds`; prefill = the P leg, decode_ttft = D's leg "
              "to its first event): " + "; ".join(f"{_ratio(point, ratio)}: {point[GATEWAY]['phases']}"
                                                  for ratio, point in sweep.items())]
    gain = _gain(sweep)
    if png:
        lines += ["", f"![p99 TTFT vs D's KV; TTFT and P's computed tokens vs P's cache]({png})"]
    lines += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    head = idle_out[sizes.d_share] if sizes.d_share in idle_out else idle_out[min(
        idle_out, key=lambda r: abs(r - sizes.d_share))]
    idle_arms = [point[arm] for point in idle_out.values() for arm in IDLE_ARMS if arm in point]
    corrupt = sum(r["corrupt"] for r in idle_arms) + sum(
        point[arm]["corrupt"] for point in sweep.values() for arm in (GATEWAY, STATELESS, NAIVE))
    errors_total = sum(r["errors"] for r in idle_arms) + sum(
        point[arm]["errors"] for point in sweep.values() for arm in (GATEWAY, STATELESS, NAIVE))
    final = (f"pressure: budget_p99_ms={head[ADAPTIVE]['p99_ms']:.1f} nobudget_p99_ms={head[NOBUDGET]['p99_ms']:.1f} "
             f"stateless_p99_ms={head[STATELESS]['p99_ms']:.1f} corrupt={corrupt} errors={errors_total} "
             f"reuse_gain_at_2x={gain:.2f}")
    lines += ["", "```", final, "```", ""]
    return "\n".join(lines), final


def _measured_history(idle_out: dict) -> int:
    return max((point[arm]["history_blocks"] for point in idle_out.values() for arm in IDLE_ARMS), default=0)


def _share(point: dict, planned: float, history: int) -> str:
    return f"{point['d_blocks'] / history:.2f} (planned {planned:g})" if history else f"{planned:g}"


def _x(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base else "—"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _targets(idle_out: dict, history: int) -> list[str]:
    """Issue 25's targets for the adaptive arm, checked on this run's figures."""
    p50 = max(point[ADAPTIVE]["p50_ms"] / point[STATELESS]["p50_ms"] for point in idle_out.values()
              if point[STATELESS]["p50_ms"])
    p99 = max(point[ADAPTIVE]["p99_ms"] / point[STATELESS]["p99_ms"] for point in idle_out.values()
              if point[STATELESS]["p99_ms"])
    held = [(share, point[ADAPTIVE]["reuse_later"]) for share, point in idle_out.items()
            if history and point["d_blocks"] * PIN_ARMS[ADAPTIVE][0] >= history]
    reuse = ", ".join(f"{share:g}: {_pct(r)}" for share, r in held) or "no point"
    return [f"Adaptive arm, worst over the points: p50 {p50:.2f}x stateless PD's (target at most 1.00), "
            f"p99 {p99:.2f}x (target at most 1.10). Reuse on later turns where D's budget holds the whole history "
            f"(D's KV x budget >= history): {reuse} (target at least 90 %)."]


def _ratio(point: dict, planned: float) -> str:
    measured = point[GATEWAY]["history_blocks"]
    return f"{point['p_blocks'] / measured:.2f} (planned {planned:g})" if measured else f"{planned:g}"


def _gain(sweep: dict) -> float:
    """Stateless PD's mean TTFT of later turns over pd-gateway's where the working set is twice P's cache."""
    point = sweep.get(0.5) or sweep[min(sweep, key=lambda r: abs(r - 0.5))]
    ours = point[GATEWAY]["mean_ms"]
    return point[STATELESS]["mean_ms"] / ours if ours else float("nan")


def plot(sweep: dict, path: Path, idle_out: dict | None = None) -> bool:
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(16, 4.4))
    if idle_out:
        history = _measured_history(idle_out) or 1
        xs0 = [point["d_blocks"] / history for point in idle_out.values()]
        for arm, style in ((ADAPTIVE, "o-"), (BUDGET, "v-."), (NOBUDGET, "x:"), (STATELESS, "s--")):
            ax0.plot(xs0, [point[arm]["p99_ms"] for point in idle_out.values()], style, label=arm)
        ax0.set_xscale("log")
        ax0.set_yscale("log")
        ax0.set_xticks(xs0, [f"{x:.2g}" for x in xs0])
        ax0.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax0.set_xlabel("D's KV capacity / conversations' history")
        ax0.set_title("p99 TTFT of later turns (ms), idle conversations")
        ax0.grid(True, which="both", alpha=0.3)
        ax0.legend(fontsize=8)
    for arm, style in ((GATEWAY, "o-"), (STATELESS, "s--"), (NAIVE, "^:")):
        xs = [point["p_blocks"] / (point[GATEWAY]["history_blocks"] or 1) for point in sweep.values()]
        ax1.plot(xs, [point[arm]["mean_ms"] for point in sweep.values()], style, label=arm)
        ax2.plot(xs, [point[arm]["p_computed_per_turn"] for point in sweep.values()], style, label=arm)
    for ax, title in ((ax1, "mean TTFT of later turns (ms)"), (ax2, "P's computed prompt tokens per turn")):
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:.2g}" for x in xs])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("P's KV capacity / conversations' working set")
        ax.set_title(title)
        ax.axvline(0.5, color="grey", lw=0.8, ls=":")   # the working set twice P's cache: reuse_gain_at_2x
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def replot(figures: Path, png: Path) -> str:
    """The curves of a run's saved figures (JSON turns the points' float keys into strings: back to floats)."""
    saved = json.loads(figures.read_text())
    idle, sweep = ({float(k): v for k, v in saved[part].items()} for part in ("idle", "sweep"))
    drawn = plot(sweep, png, idle)
    return f"pressure: curves {'in ' + str(png) if drawn else 'not drawn (no matplotlib)'}"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: about 10 minutes on 2 shared cores")
    ap.add_argument("--out", default=str(HERE / "PRESSURE.md"), help="where to write the tables ('-': nowhere)")
    ap.add_argument("--plot-from", metavar="JSON", help="only draw the curves of a run's figures (the JSON it wrote "
                    "next to its tables: a host without matplotlib runs, this machine draws) into --out's folder")
    args = ap.parse_args(argv)
    if args.plot_from:
        return replot(Path(args.plot_from), Path(args.out).with_name("pressure.png"))
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"
    sizes = QUICK if args.quick else FULL
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    bench_servers.START_TIMEOUT_S = 240    # a dozen processes start at once on a shared 2-core machine
    began = time.perf_counter()
    notes: list[str] = []
    phases: dict[str, float] = {}
    with Servers() as servers:
        t = time.perf_counter()
        idle, sweep_setup = start(servers, sizes, notes)
        phases["start-up"] = time.perf_counter() - t
        t = time.perf_counter()
        idle_out = run_idle(idle, sizes)
        phases["idle conversations"] = time.perf_counter() - t
        t = time.perf_counter()
        sweep = run_sweep(sweep_setup, sizes)
        phases["P cache sweep"] = time.perf_counter() - t
    notes.append("phase wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()))
    if args.out != "-":              # the figures as measured, for --plot-from
        Path(args.out).with_suffix(".json").write_text(json.dumps({"idle": idle_out, "sweep": sweep}, indent=1))
    png = None                       # the curve goes next to the tables, linked by a relative path
    if args.out != "-" and plot(sweep, Path(args.out).with_name("pressure.png"), idle_out):
        png = "pressure.png"
    text, final = report(args, sizes, idle, idle_out, sweep, notes, time.perf_counter() - began, png)
    if args.out != "-":
        Path(args.out).write_text(text)
    print(text)
    print(final)
    return final


if __name__ == "__main__":
    main()
