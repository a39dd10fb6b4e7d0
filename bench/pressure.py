"""Under pressure (issue 15): D's KV pinned by idle conversations, and P's cache against the working set.

    python bench/pressure.py            # full sizes; writes bench/PRESSURE.md and bench/pressure.png
    python bench/pressure.py --quick    # small sizes, under 3 minutes (same files; --out - writes none)
    python bench/pressure.py --quick --out /tmp/p.md   # tables in /tmp/p.md, the curve in /tmp/pressure.png

1. Many idle conversations over 1 P + 1 D whose KV holds about 10 % of their history. Time is compressed by one
   factor everywhere it is a setting: D's `decoder_kv_blocks_ttl`, the reader's expiry margin, the gateway's TTL
   and margin, and the users' think times (30-300 s at full scale); the GPU-like compute costs are not. The arms
   run at the same time, each on its own P and D: pd-gateway with the pin budget (`--decode-pin-budget`),
   pd-gateway without it (TTL only), and stateless PD (vllm-router; engines without bidirectional transfer, so
   D pins nothing). Figures: TTFT of later turns, D's waits for free blocks (the simulator queues a request whose
   blocks do not fit, as vLLM's scheduler does), reuse, errors, corrupt reads (the simulator's oracle).
2. Working set vs P's cache: P's KV capacity swept from 10 % to 200 % of the conversations' working set (D large);
   TTFT of later turns and P's computed tokens for pd-gateway, stateless PD (vllm-router, P's prefix cache) and
   the naive proxy. reuse_gain_at_2x = stateless PD's mean TTFT of later turns / pd-gateway's, where the working
   set is twice P's cache.

Every figure is measured in this run; the last line is
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
from bench.servers import Servers, get_json, metrics, post  # noqa: E402
from bench.workload import Workload  # noqa: E402

HERE = Path(__file__).resolve().parent
BLOCK = 16
TEMPLATE_TOKENS = 8           # the demo chat template's tokens around each message (measured: 6-8)
REAL_TTL_S, REAL_GATEWAY_MARGIN_S, REAL_EXPIRY_MARGIN_S = 480.0, 30.0, 5.0
REAL_THINK_S = (30.0, 300.0)
BUDGET = "pd-gateway, pin budget 0.5"
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
    d_share: float              # D's KV as a share of the idle conversations' history
    sweep_conversations: int
    sweep_turns: int
    sweep_history: int
    sweep_new: int
    sweep_output: tuple[int, int]
    ratios: tuple[float, ...]   # P's KV / the sweep's working set
    sweep_think_s: float        # mean think time (uniform in 0..2x): below saturation, TTFT is per-turn cost
    decode_ms_per_token: float


FULL = Sizes(idle_conversations=2000, idle_turns=4, idle_history=256, idle_new=48, idle_output=(16, 48), factor=20,
             idle_duration_s=240, d_share=0.10, sweep_conversations=32, sweep_turns=6, sweep_history=1000,
             sweep_new=100, sweep_output=(100, 200), ratios=(0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0), sweep_think_s=2.0,
             decode_ms_per_token=10)
QUICK = Sizes(idle_conversations=64, idle_turns=3, idle_history=256, idle_new=48, idle_output=(16, 48), factor=100,
              idle_duration_s=20, d_share=0.10, sweep_conversations=16, sweep_turns=4, sweep_history=1000,
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


# -- 1. many idle conversations -------------------------------------------------------------------------------
@dataclass
class IdleSetup:
    ttl_s: float
    d_blocks: int
    history_blocks: int
    targets: dict          # arm -> (target, gateway server or None, P, D)
    budget_wired: bool


def start_idle(s: Servers, sizes: Sizes) -> tuple[list, list]:
    """Engines for the TTL-only and stateless arms (the budget arm's start once the flag is known to work)."""
    ttl = REAL_TTL_S / sizes.factor
    per_conv = history_tokens(sizes.idle_history, sizes.idle_turns, sizes.idle_new, sizes.idle_output)
    d_blocks = max(blocks(sizes.d_share * sizes.idle_conversations * per_conv), 3 * blocks(per_conv))
    common = [*cost(sizes, sizes.idle_output), "--decoder-kv-blocks-ttl", f"{ttl:g}",
              "--expiry-margin-s", f"{REAL_EXPIRY_MARGIN_S / sizes.factor:g}"]
    p, d = [*common, "--num-blocks", "60000"], [*common, "--num-blocks", str(d_blocks)]
    specs = [("prefill", "ip_nobudget", p), ("decode", "id_nobudget", d),
             ("prefill", "ip_stateless", [*p, "--no-bidirectional"]),
             ("decode", "id_stateless", [*d, "--no-bidirectional"])]
    return specs, [ttl, d_blocks, blocks(per_conv) * sizes.idle_conversations]


def gateway_flags(sizes: Sizes, budget: float) -> list[str]:
    return ["--decoder-kv-blocks-ttl-s", f"{REAL_TTL_S / sizes.factor:g}",
            "--handle-ttl-margin-s", f"{REAL_GATEWAY_MARGIN_S / sizes.factor:g}", "--decode-pin-budget", f"{budget:g}"]


def budget_wired(gateway) -> bool:
    """The gateway enforces the pin budget once it exports what the budget counts (docs: pdgw_pinned_tokens)."""
    text = urllib.request.urlopen(gateway.url + "/metrics", timeout=10).read().decode()
    return "pdgw_pinned_tokens" in text


def idle_workload(sizes: Sizes) -> Workload:
    think = (REAL_THINK_S[0] / sizes.factor, REAL_THINK_S[1] / sizes.factor)
    return Workload(conversations=sizes.idle_conversations, turns=sizes.idle_turns, new_tokens=sizes.idle_new,
                    history_tokens=sizes.idle_history, think_range_s=think, seed=15)


def run_idle(setup: IdleSetup, sizes: Sizes) -> dict:
    w = idle_workload(sizes)
    engines = [e for _, _, p, d in setup.targets.values() for e in (p, d)]
    warm = replace(w, conversations=4, turns=2, think_range_s=None, seed=99)
    loadgen.arun(_together({arm: t for arm, (t, *_) in setup.targets.items()}, warm, None))
    reset(*engines)
    before = {arm: metrics(gw.url) for arm, (_, gw, _, _) in setup.targets.items() if gw}
    runs = loadgen.arun(_together({arm: t for arm, (t, *_) in setup.targets.items()}, w, sizes.idle_duration_s))
    out = {}
    for arm, (_, gw, p, d) in setup.targets.items():
        ps, ds = get_json(p.url + "/sim/stats"), get_json(d.url + "/sim/stats")
        run = runs[arm]
        later = run.ttft(later_turns=True)
        prompt = ps["prompt_tokens_computed"] + ps["prompt_tokens_loaded"] + ps["prompt_tokens_cached"]
        out[arm] = {"turns": len(run.turns), "errors": run.errors,
                    "error_sample": next((t.error for t in run.turns if not t.ok), ""),
                    "p50_ms": percentile(later, 50) * 1e3, "p99_ms": percentile(later, 99) * 1e3,
                    "later": len(later), "wall_s": run.wall_s,
                    "d_waits": ds["requests_waited_for_blocks"], "d_wait_s": ds["block_wait_seconds_total"],
                    "d_wait_max_s": ds["block_wait_seconds_max"], "d_holds_skipped": ds["holds_skipped_no_blocks"],
                    "d_preempted": ds["requests_preempted"],
                    "reuse": (ps["prompt_tokens_loaded"] + ps["prompt_tokens_cached"]) / prompt if prompt else 0.0,
                    "p_computed": ps["prompt_tokens_computed"],
                    "corrupt": ps["kv_reads_corrupt"] + ds["kv_reads_corrupt"],
                    "kv_failures": ps["kv_load_failures"] + ds["kv_load_failures"],
                    "plans": _plans(_delta(before[arm], metrics(gw.url))) if gw else "",
                    "history_blocks": _history_blocks(run, sizes.idle_output)}
    return out


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
        key = f'{{phase="{phase}"}}'
        count = after.get(f"pdgw_turn_seconds_count{key}", 0.0) - before.get(f"pdgw_turn_seconds_count{key}", 0.0)
        total = after.get(f"pdgw_turn_seconds_sum{key}", 0.0) - before.get(f"pdgw_turn_seconds_sum{key}", 0.0)
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
    idle_specs, (ttl, d_blocks, history) = start_idle(s, sizes)
    sweep_sims, p_blocks = sweep_specs(sizes)
    engines = dict(zip([eid for _, eid, _ in idle_specs + sweep_sims], s.sims(idle_specs + sweep_sims)))
    sp, sd = engines["sp"], engines["sd"]
    ip, idd = engines["ip_nobudget"], engines["id_nobudget"]
    nobudget, gateway = s.gateways([([ip], [idd], gateway_flags(sizes, 0.0)), ([sp], [sd], [])])
    targets = {NOBUDGET: (OpenAITarget(nobudget.url), nobudget, ip, idd)}
    wired = budget_wired(nobudget)
    if wired:
        bp, bd = s.sims([("prefill", "ip_budget", idle_specs[0][2]), ("decode", "id_budget", idle_specs[1][2])])
        [bgw] = s.gateways([([bp], [bd], gateway_flags(sizes, 0.5))])
        targets = {BUDGET: (OpenAITarget(bgw.url), bgw, bp, bd), **targets}
    else:
        notes.append("the gateway does not enforce `--decode-pin-budget` yet (no `pdgw_pinned_tokens` in its "
                     "/metrics): the budget arm was not run and `budget_p99_ms` reports the TTL-only arm")
    sp_, sd_ = engines["ip_stateless"], engines["id_stateless"]
    targets[STATELESS] = (OpenAITarget(s.router([sp_], [sd_]).url), None, sp_, sd_)
    sweep = {"p": sp, "d": sd, "p_blocks": p_blocks, "gateway": gateway,
             "targets": {GATEWAY: OpenAITarget(gateway.url), STATELESS: OpenAITarget(s.router([sp], [sd]).url),
                         NAIVE: OpenAITarget(s.naive([sp], [sd]).url)}}
    return IdleSetup(ttl, d_blocks, history, targets, wired), sweep


# -- the report --------------------------------------------------------------------------------------------------
def report(args, sizes: Sizes, idle: IdleSetup, idle_out: dict, sweep: dict, notes: list[str],
           wall_s: float, png: str | None) -> tuple[str, str]:
    w = idle_workload(sizes)
    lines = [f"# Under pressure: `{' '.join(['python', 'bench/pressure.py', *args.argv])}`", "",
             f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; wall time {wall_s:.0f} s",
             f"- load average at the start: {args.load}", ""]
    measured = next(iter(idle_out.values()))["history_blocks"] or idle.history_blocks
    lines += ["## 1. Many idle conversations, 1 P + 1 D", "",
              f"{w.conversations} conversations at once, {w.turns} turns, a {sizes.idle_history}-token system prompt, "
              f"~{w.new_tokens} new tokens per question, answers {sizes.idle_output[0]}-{sizes.idle_output[1]} tokens. "
              f"Time compressed {sizes.factor:g}x: D's `decoder_kv_blocks_ttl` {idle.ttl_s:g} s (480 s), reader's "
              f"expiry margin {REAL_EXPIRY_MARGIN_S / sizes.factor:g} s (5 s), gateway margin "
              f"{REAL_GATEWAY_MARGIN_S / sizes.factor:g} s (30 s), think time uniform in "
              f"{w.think_range_s[0]:g}-{w.think_range_s[1]:g} s (30-300 s); GPU-like compute not compressed "
              f"(prefill 0.1 ms/token, decode {sizes.decode_ms_per_token:g} ms/token, transfer 0.05 ms/block). "
              f"D has {idle.d_blocks} KV blocks: {idle.d_blocks / max(1, measured):.0%} of the conversations' "
              f"history ({measured} blocks, measured). No new turn starts after {sizes.idle_duration_s:g} s. "
              "The arms ran at the same time on their own engines.", "",
              "| arm | turns | errors | TTFT p50 later turns ms | p99 ms | D waits for blocks | D time waited s "
              "(total / max) | D preemptions (no block for an answer) | P reuse (loaded + cached) | P computed | "
              "KV reads failed (engines) | corrupt | plans |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, r in idle_out.items():
        lines.append(f"| {arm} | {r['turns']} | {r['errors']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                     f"{r['d_waits']} | {r['d_wait_s']:.1f} / {r['d_wait_max_s']:.1f} | {r['d_preempted']} | "
                     f"{r['reuse']:.0%} | "
                     f"{r['p_computed']} | {r['kv_failures']} | {r['corrupt']} | {r['plans'] or '—'} |")
    errors = [f"{arm}: {r['error_sample']}" for arm, r in idle_out.items() if r["error_sample"]]
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
        lines += ["", f"![TTFT and P's computed tokens vs P's cache]({png})"]
    lines += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    budget = idle_out.get(BUDGET, idle_out[NOBUDGET])
    corrupt = sum(r["corrupt"] for r in idle_out.values()) + sum(
        point[arm]["corrupt"] for point in sweep.values() for arm in (GATEWAY, STATELESS, NAIVE))
    errors_total = sum(r["errors"] for r in idle_out.values()) + sum(
        point[arm]["errors"] for point in sweep.values() for arm in (GATEWAY, STATELESS, NAIVE))
    final = (f"pressure: budget_p99_ms={budget['p99_ms']:.1f} nobudget_p99_ms={idle_out[NOBUDGET]['p99_ms']:.1f} "
             f"stateless_p99_ms={idle_out[STATELESS]['p99_ms']:.1f} corrupt={corrupt} errors={errors_total} "
             f"reuse_gain_at_2x={gain:.2f}")
    lines += ["", "```", final, "```", ""]
    return "\n".join(lines), final


def _ratio(point: dict, planned: float) -> str:
    measured = point[GATEWAY]["history_blocks"]
    return f"{point['p_blocks'] / measured:.2f} (planned {planned:g})" if measured else f"{planned:g}"


def _gain(sweep: dict) -> float:
    """Stateless PD's mean TTFT of later turns over pd-gateway's where the working set is twice P's cache."""
    point = sweep.get(0.5) or sweep[min(sweep, key=lambda r: abs(r - 0.5))]
    ours = point[GATEWAY]["mean_ms"]
    return point[STATELESS]["mean_ms"] / ours if ours else float("nan")


def plot(sweep: dict, path: Path) -> bool:
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
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
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: under 3 minutes")
    ap.add_argument("--out", default=str(HERE / "PRESSURE.md"), help="where to write the tables ('-': nowhere)")
    args = ap.parse_args(argv)
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
    png = None                       # the curve goes next to the tables, linked by a relative path
    if args.out != "-" and plot(sweep, Path(args.out).with_name("pressure.png")):
        png = "pressure.png"
    text, final = report(args, sizes, idle, idle_out, sweep, notes, time.perf_counter() - began, png)
    if args.out != "-":
        Path(args.out).write_text(text)
    print(text)
    print(final)
    return final


if __name__ == "__main__":
    main()
