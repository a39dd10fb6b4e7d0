"""The side-by-side benchmark, in one run: floor, pd-gateway, a naive proxy and vllm-router on the same simulated
engines, then CPU per streamed output token, the cost of long histories, reuse under a GPU-like cost model
(plain and reasoning), placement.

    python bench/compare.py            # full sizes (a few minutes), writes bench/RESULTS.md
    python bench/compare.py --quick    # small sizes, under a minute
    python bench/compare.py --smoke    # tiny sizes, for the test suite; --out - prints the table only

Every figure is measured in this run; the last line is
    compare: added_p50_ms=X added_p99_ms=Y naive_added_ratio=A naive_throughput_ratio=B cpu_32k_vs_1k=C
             internal_p50_ms=D router_cpu_ratio=E stream_cpu_ratio=F lookup_added_ms=G
(router_cpu_ratio: pd-gateway's CPU per saturated turn over vllm-router's; stream_cpu_ratio: the same per streamed
output token; lookup_added_ms: added p50 without session ids less added p50 with them.)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import re
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import loadgen  # noqa: E402
from bench.loadgen import CpuMeter, FloorTarget, OpenAITarget, RunResult, percentile  # noqa: E402
from bench.servers import ProxyCpus, Servers, get_json, metrics, post, sample_sum  # noqa: E402
from bench.streaming import STREAM_SIM, stream_cost  # noqa: E402
from bench.streaming import table as stream_table  # noqa: E402
from bench.workload import Workload  # noqa: E402

BLOCK = 16
# Zero-timing engines: the engines render the prompt themselves in every set-up (--no-prompt-token-ids),
# so that the only difference between set-ups is what sits between the client and the engines.
ZERO_SIM = ["--no-prompt-token-ids", "--stream-kv-params", "--num-blocks", "60000", "--decoder-kv-blocks-ttl", "90",
            "--max-model-len", "131072", "--output-tokens", "16:48"]
# The same engines as they are from vLLM 0.32 on: they use the gateway's pinned prompt ids, so (once its start-up
# probe has proven that) the gateway's P legs ask for no echo of the prompt. Section 2 runs on both kinds.
PINNED_SIM = [f for f in ZERO_SIM if f != "--no-prompt-token-ids"]
GATEWAY_TTL = ["--decoder-kv-blocks-ttl-s", "90", "--handle-ttl-margin-s", "10"]
PLACE_P, PLACE_D = 4, 2         # placement phase: engines per pool
# Added latency is measured against a floor that makes the engines do the same work: the stateful proxies hand
# D's last handle to P (P reads the history from D), so theirs is the load generator doing just that itself.
REUSE_FLOOR = "floor with reuse"
FLOORS = ("floor", REUSE_FLOOR)
PRESSURE_LINK = ("Under pressure (D's KV pinned by idle conversations; P's cache vs the working set): "
                 "`python bench/pressure.py`, [PRESSURE.md](PRESSURE.md), curve [pressure.png](pressure.png).")
SESSIONLESS = "pd-gateway sessionless"     # no session ids: the conversation found by its tokens (prefix lookup)
BASELINE = {"pd-gateway": REUSE_FLOOR, SESSIONLESS: REUSE_FLOOR, "naive proxy": REUSE_FLOOR, "vllm-router": "floor"}


@dataclass(frozen=True)
class Sizes:
    conversations: int          # zero-timing comparison, at `concurrency` conversations at once
    concurrency: int
    turns: int
    new_tokens: int
    think_s: float
    saturation_s: float         # closed loop without think time: turns/s and CPU per turn at saturation
    rounds: int                 # the set-ups take turns this many times (load drift hits all alike)
    history: tuple[int, int]    # CPU per turn: conversations, turns
    gpu: tuple[int, int]        # GPU-cost scenario: conversations (all at once), turns
    gpu_sim: tuple[str, ...]
    placement: bool
    stream: tuple[int, int] = (8, 2)    # streaming phase: conversations (all at once), turns; 1,000-token answers


FULL = Sizes(conversations=128, concurrency=64, turns=4, new_tokens=48, think_s=4.0, saturation_s=6.0, rounds=2,
             history=(8, 12), gpu=(12, 10), placement=True, stream=(16, 3),
             gpu_sim=("--prefill-ms-per-token", "0.1", "--decode-ms-per-token", "10", "--transfer-ms-per-block",
                      "0.05", "--output-tokens", "100:200"))
QUICK = Sizes(conversations=64, concurrency=64, turns=2, new_tokens=48, think_s=1.0, saturation_s=1.0, rounds=1,
              history=(4, 6), gpu=(6, 6), placement=False,
              gpu_sim=("--prefill-ms-per-token", "0.1", "--decode-ms-per-token", "0.5", "--transfer-ms-per-block",
                       "0.05", "--output-tokens", "100:160"))
SMOKE = Sizes(conversations=4, concurrency=4, turns=2, new_tokens=16, think_s=0.0, saturation_s=0.5, rounds=1,
              history=(1, 2), gpu=(2, 3), placement=False, stream=(2, 1),
              gpu_sim=("--prefill-ms-per-token", "0.1", "--decode-ms-per-token", "0.2", "--transfer-ms-per-block",
                       "0.05", "--output-tokens", "64:80"))


@dataclass
class Row:
    setup: str
    run: RunResult
    cpu_ms_per_turn: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def ttft(self) -> list[float]:
        return self.run.ttft()


def drive(target, w: Workload, *, concurrency: int | None = None, duration_s: float | None = None,
          pid: int | None = None, on_warm=None) -> tuple[RunResult, float | None]:
    meter = CpuMeter(pid) if pid else None
    holder = {}

    def warmed() -> None:
        if on_warm:
            on_warm()
        if pid:
            holder["meter"] = CpuMeter(pid)
    result = loadgen.arun(loadgen.run(target, w, concurrency=concurrency, duration_s=duration_s,
                                      on_warm=warmed if (on_warm or pid) and concurrency is None else None))
    meter = holder.get("meter", meter)
    cpu = meter.seconds() * 1e3 / max(1, len(result.ok)) if meter else None
    return result, cpu


def reset(*engines) -> None:
    for engine in engines:
        post(engine.url + "/sim/reset")


def alternate(targets: dict, engines: list, w: Workload, *, rounds: int,
              concurrency: int) -> tuple[dict[str, RunResult], dict[str, float]]:
    """Each set-up (name -> (target, its server process or None)) over `w`, taking turns A B B A for `rounds`
    rounds on freshly reset engines, so the machine's drift falls on all alike: the pooled runs, and each
    server's CPU ms per turn."""
    runs = {name: RunResult([], 0.0) for name in targets}
    cpu = {name: 0.0 for name, (_, server) in targets.items() if server}
    for round_ in range(rounds):
        for name in list(targets) if round_ % 2 == 0 else reversed(targets):
            target, server = targets[name]
            reset(*engines)
            run, used = drive(target, replace(w, seed=round_), concurrency=concurrency,
                              pid=server.proc.pid if server else None)
            runs[name] = RunResult(runs[name].turns + run.turns, runs[name].wall_s + run.wall_s)
            if server:
                cpu[name] += (used or 0.0) / rounds
    return runs, cpu


def p_stats(engines) -> dict[str, int]:
    keys = ("prompt_tokens_computed", "prompt_tokens_loaded", "prompt_tokens_cached", "kv_reads_corrupt",
            "requests_corrupt", "kv_blocks_read")
    stats = [get_json(e.url + "/sim/stats") for e in engines]
    return {k: sum(s[k] for s in stats) for k in keys}


@dataclass
class Env:
    """Every engine and gateway of the run, started at once (start-up is mostly imports: overlapping saves time)."""
    zero_p: object
    zero_d: object
    zero_gw: object
    gpu_p: object
    gpu_d: object
    gpu_gw: object
    reason_p: object
    reason_d: object
    reason_gw: object
    pinned_p: object = None
    pinned_d: object = None
    pinned_gw: object = None
    sessionless_gw: object = None    # the zero-timing engines again, driven without session ids
    stateless_gw: object = None      # the GPU-cost engines, conversations looked up by session id only
    place_p: list = field(default_factory=list)
    place_d: list = field(default_factory=list)
    place_gws: list = field(default_factory=list)
    stream_p: object = None          # streaming phase: answers of 1,000 tokens
    stream_d: object = None
    stream_gw: object = None


def start_all(s: Servers, sizes: Sizes) -> Env:
    redis = s.redis()
    gpu = ["--stream-kv-params", "--num-blocks", "60000", *sizes.gpu_sim]
    reason = [*gpu, "--tokenizer", "builtin:demo-reasoning", "--reasoning"]
    specs = [("prefill", "zp0", ZERO_SIM), ("decode", "zd0", ZERO_SIM), ("prefill", "gp0", gpu),
             ("decode", "gd0", gpu), ("prefill", "rp0", reason), ("decode", "rd0", reason),
             ("prefill", "hp0", PINNED_SIM), ("decode", "hd0", PINNED_SIM)]
    if sizes.placement:
        specs += [*[("prefill", f"pp{i}", gpu) for i in range(PLACE_P)], *[("decode", f"pd{i}", gpu) for i in range(PLACE_D)]]
    specs += [("prefill", "sp0", STREAM_SIM), ("decode", "sd0", STREAM_SIM)]
    engines = s.sims(specs)
    sp, sd = engines[-2:]
    zp, zd, gp, gd, rp, rd, hp, hd = engines[:8]
    store = ["--redis-url", redis.url]
    gws = [([zp], [zd], [*store, *GATEWAY_TTL]), ([gp], [gd], store),
           ([rp], [rd], [*store, "--tokenizer", "builtin:demo-reasoning"]), ([hp], [hd], [*store, *GATEWAY_TTL]),
           ([zp], [zd], [*store, *GATEWAY_TTL]), ([gp], [gd], [*store, "--conversation-lookup", "session"])]
    if sizes.placement:
        ps, ds = engines[8:8 + PLACE_P], engines[8 + PLACE_P:]
        gws += [(ps, ds, store), (ps, ds, [*store, "--no-prefill-affinity"])]
    gws.append(([sp], [sd], [*store, *GATEWAY_TTL]))
    names = ["zero timing", "GPU cost", "reasoning", "history (pinned)", "sessionless", "stateless",
             *(["placement", "placement no affinity"] if sizes.placement else []), "streaming"]
    gateways = s.gateways(gws, names)
    env = Env(zp, zd, gateways[0], gp, gd, gateways[1], rp, rd, gateways[2], hp, hd, gateways[3],
              sessionless_gw=gateways[4], stateless_gw=gateways[5], stream_p=sp, stream_d=sd, stream_gw=gateways[-1])
    if sizes.placement:
        env.place_p, env.place_d = engines[8:8 + PLACE_P], engines[8 + PLACE_P:8 + PLACE_P + PLACE_D]
        env.place_gws = gateways[6:8]
    return env


# -- 1. zero timing: floor, pd-gateway, naive proxy, vllm-router --------------------------------------------
def zero_timing(s: Servers, env: Env, sizes: Sizes, notes: list[str]) -> dict:
    p, d, gw = env.zero_p, env.zero_d, env.zero_gw
    # set-up -> (target, its process, how its workload differs)
    setups: dict[str, tuple] = {"floor": (FloorTarget([p.url], [d.url]), None, {}),
                                REUSE_FLOOR: (FloorTarget([p.url], [d.url], reuse=True), None, {})}
    setups["pd-gateway"] = (OpenAITarget(gw.url), gw, {})
    setups[SESSIONLESS] = (OpenAITarget(env.sessionless_gw.url), env.sessionless_gw, {"sessions": False})
    setups["naive proxy"] = (OpenAITarget((naive := s.naive([p], [d])).url), naive, {})
    try:
        router = s.router([p], [d])
        setups["vllm-router"] = (OpenAITarget(router.url), router, {})
    except Exception as exc:  # not installable or not runnable here: say so and carry on
        notes.append(f"vllm-router could not be run here: {str(exc).splitlines()[0][:200]}")
    w = Workload(conversations=sizes.conversations, turns=sizes.turns, new_tokens=sizes.new_tokens,
                 think_s=sizes.think_s, seed=1)
    rows, saturation = {name: Row(name, RunResult([], 0.0), 0.0) for name in setups}, {}
    for target, _, own in setups.values():  # warm up: first connections, lazy imports, first allocations
        drive(target, replace(w, conversations=8, turns=2, think_s=0.0, seed=99, **own), concurrency=8)
    before = metrics(gw.url)
    # Set-ups take turns, round after round, so that a change in the machine's load hits them alike.
    per_round = replace(w, conversations=max(sizes.concurrency, w.conversations // sizes.rounds))
    for round_ in range(sizes.rounds):
        for name, (target, server, own) in setups.items():
            reset(p, d)
            engines_cpu = [CpuMeter(e.proc.pid) for e in (p, d)]
            run, cpu = drive(target, replace(per_round, seed=round_, **own), concurrency=sizes.concurrency,
                             pid=server.proc.pid if server else None)
            row = rows[name]
            row.run = RunResult(row.run.turns + run.turns, row.run.wall_s + run.wall_s)
            row.cpu_ms_per_turn = None if cpu is None else (row.cpu_ms_per_turn or 0.0) + cpu / sizes.rounds
            row.extra["engines_cpu_ms"] = row.extra.get("engines_cpu_ms", 0.0) + \
                sum(m.seconds() for m in engines_cpu) * 1e3 / max(1, len(run.ok)) / sizes.rounds
    rows = list(rows.values())
    after = metrics(gw.url)
    for name, (target, server, own) in setups.items():     # saturation: no think time, fixed duration
        reset(p, d)
        sat = replace(w, think_s=0.0, conversations=100_000, turns=sizes.turns, seed=2, **own)
        run, cpu = drive(target, sat, concurrency=sizes.concurrency, duration_s=sizes.saturation_s,
                         pid=server.proc.pid if server else None)
        saturation[name] = {"turns_per_s": run.turns_per_s, "cpu_ms_per_turn": cpu, "errors": run.errors,
                            "ttft_p50_ms": percentile(run.ttft(), 50) * 1e3}
    return {"rows": rows, "saturation": saturation, "gateway_metrics": _delta(before, after), "workload": w}


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after
            if k.startswith(("pdgw_turns_total", "pdgw_prompt_tokens_total", "pdgw_turn_seconds_",
                             "pdgw_store_seconds_", "pdgw_gateway_seconds_"))}


_BUCKET = re.compile(r'^pdgw_gateway_seconds_bucket\{(?=.*span="([^"]+)")(?=.*le="([^"]+)").*\}$')


def gateway_quantile(gw_metrics: dict, span: str, q: float) -> float | None:
    """A quantile (ms) of the gateway's own time per turn (`pdgw_gateway_seconds{span}`), interpolated linearly
    within its bucket as Prometheus' histogram_quantile does; None when the span has no observations."""
    buckets = sorted((float(m.group(2)), count) for key, count in gw_metrics.items()
                     if (m := _BUCKET.match(key)) and m.group(1) == span)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, below, lower = q * buckets[-1][1], 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if upper == float("inf"):
                return lower * 1e3
            inside = cumulative - below
            return (lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)) * 1e3
        below, lower = cumulative, upper
    return lower * 1e3


def _gateway_spans(gw_metrics: dict, internal: bool = True) -> str:
    """p50 ms of each span of the gateway's own time (`internal`: their total too)."""
    out = []
    for span in ("to_prefill", "prefill_to_decode", "to_client", *(("internal",) if internal else ())):
        if (p50 := gateway_quantile(gw_metrics, span, 0.5)) is not None:
            out.append(f"{span} {p50:.3f}")
    return ", ".join(out)


def _phase_means(gw_metrics: dict) -> str:
    """Mean ms per phase from the gateway's own histograms: where its part of a turn's time went."""
    out = []
    for histogram, label, names in (("pdgw_turn_seconds", "phase", ("intake", "plan", "prefill", "decode_ttft")),
                                    ("pdgw_store_seconds", "op", ("begin_turn", "finish_turn"))):
        for name in names:
            count = sample_sum(gw_metrics, f"{histogram}_count", **{label: name})
            if count:
                out.append(f"{name} {sample_sum(gw_metrics, f'{histogram}_sum', **{label: name}) / count * 1e3:.2f}")
    return ", ".join(out)


# -- 2. CPU per turn vs history length ----------------------------------------------------------------------
HISTORY_ENGINES = {"pinned": "use pinned prompt ids (vLLM 0.32+): P echoes nothing",
                   "render": "render the messages (before 0.32): P echoes its prompt for the parity check"}


def history_cost(env: Env, sizes: Sizes) -> dict:
    """Per kind of engine (HISTORY_ENGINES) and history length: the gateway's CPU per turn."""
    return {"pinned": _history_cost(env.pinned_p, env.pinned_d, env.pinned_gw, sizes),
            "render": _history_cost(env.zero_p, env.zero_d, env.zero_gw, sizes)}


def _history_cost(p, d, gw, sizes: Sizes) -> dict:
    out = {}
    for history in (1000, 32000):
        reset(p, d)
        conversations, turns = sizes.history
        w = Workload(conversations=conversations, turns=turns, new_tokens=sizes.new_tokens, history_tokens=history,
                     seed=history)
        first = CpuMeter(gw.proc.pid)
        firsts = {}
        run, cpu = drive(OpenAITarget(gw.url), w, pid=gw.proc.pid,
                         on_warm=lambda: firsts.setdefault("cpu", first.seconds()))
        out[history] = {"cpu_ms_per_turn": cpu, "first_turn_cpu_ms": firsts.get("cpu", 0) * 1e3 / conversations,
                        "turns": len(run.ok), "errors": run.errors,
                        "prompt_tokens": statistics.fmean(t.prompt_tokens for t in run.ok) if run.ok else 0}
    return out


# -- 3. GPU-like cost model: reuse vs stateless vs full prefill; reasoning -----------------------------------
def gpu_scenario(env: Env, sizes: Sizes, *, reasoning: bool) -> dict:
    p, d, gw = (env.reason_p, env.reason_d, env.reason_gw) if reasoning else (env.gpu_p, env.gpu_d, env.gpu_gw)
    conversations, turns = sizes.gpu
    base = Workload(conversations=conversations, turns=turns, new_tokens=100, history_tokens=1000, seed=7,
                    token_ids=True)
    stateless = gw if reasoning else env.stateless_gw      # the latter looks conversations up by session id only
    arms = {"reuse (sessions)": (base, gw),
            "reuse without session ids (prefix lookup)": (replace(base, sessions=False), gw),
            "stateless PD (no session; engines' prefix caches only)": (replace(base, sessions=False), stateless),
            "full prefill (no session, no prefix-cache hit)": (replace(base, sessions=False, salt_each_turn=True),
                                                               stateless)}
    if reasoning:
        for name in ("reuse without session ids (prefix lookup)", "stateless PD (no session; engines' prefix caches only)"):
            arms.pop(name)
    out = {}
    for name, (w, server) in arms.items():
        reset(p, d)
        before = metrics(server.url)
        run, _ = drive(OpenAITarget(server.url), w, concurrency=conversations)
        out[name] = _reuse_figures(run, p_stats([p]), _delta(before, metrics(server.url)))
    return out


def _reuse_figures(run: RunResult, stats: dict, gw_metrics: dict) -> dict:
    """Mean TTFT of turns >= 2, and P's computed prompt tokens against the ideal: each turn computing only
    what is not a common prefix of its prompt and the previous turn's held tokens S = prompt + output."""
    by_conv: dict[int, list] = {}
    for t in sorted(run.ok, key=lambda t: (t.conversation, t.turn)):
        by_conv.setdefault(t.conversation, []).append(t)
    ideal_computed = ideal_reused = new_tokens = later_turns = first_prompts = 0
    for turns in by_conv.values():
        previous = None
        for t in turns:
            prompt = t.prompt_ids or []
            if previous is None:
                first_prompts += len(prompt)
                ideal_computed += len(prompt)
            else:
                held = (previous.prompt_ids or []) + previous.output_ids
                common = _common_prefix(prompt, held[:max(0, len(held) - 1)])
                common = min(common, len(prompt) - 1)
                ideal_reused += common
                ideal_computed += len(prompt) - common
                new_tokens += len(prompt) - common
                later_turns += 1
            previous = t
    computed_later = stats["prompt_tokens_computed"] - first_prompts
    reused_by_p = stats["prompt_tokens_loaded"] + stats["prompt_tokens_cached"]
    return {"ttft_mean_later_ms": statistics.fmean(run.ttft(later_turns=True)) * 1e3 if later_turns else 0.0,
            "ttft_p50_later_ms": percentile(run.ttft(later_turns=True), 50) * 1e3,
            "turns": len(run.ok), "errors": run.errors, "later_turns": later_turns,
            "error_sample": next((t.error for t in run.turns if not t.ok), ""),
            "p_computed": stats["prompt_tokens_computed"], "ideal_computed": ideal_computed,
            "excess_per_later_turn": (computed_later - new_tokens) / max(1, later_turns),
            "reuse_of_ideal": reused_by_p / ideal_reused if ideal_reused else 0.0,
            "corrupt": stats["kv_reads_corrupt"], "plans": _plans(gw_metrics)}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n                      # binary search on slice equality (C-speed compares)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _plans(gw_metrics: dict) -> str:
    counts = {k.split("{")[1].rstrip("}").split(",", 1)[1]: int(v) for k, v in gw_metrics.items()
              if k.startswith("pdgw_turns_total{") and v}           # the model label first, left out
    return ", ".join(f"{k.replace('plan=', '').replace('reason=', '').replace(chr(34), '')}: {v}"
                     for k, v in sorted(counts.items()))


# -- 4. placement: previous-P affinity vs least loaded, 2 P + 2 D, uniform and skewed load -------------------
def placement(env: Env, sizes: Sizes) -> dict:
    ps, ds = env.place_p, env.place_d
    engines = [*ps, *ds]
    gateways = {"previous-P affinity": env.place_gws[0], "least loaded": env.place_gws[1]}
    conversations, turns = sizes.gpu
    uniform = Workload(conversations=conversations * 2, turns=turns, new_tokens=100, history_tokens=1000, seed=11,
                       token_ids=True)
    out = {}
    for load_name, hot in (("uniform", None), ("skewed (one 8k-token conversation per 4, no think time)", 8000)):
        runs: dict[str, list] = {name: [] for name in gateways}
        # A B B A: a change in the machine's load during the phase hits both choices alike.
        for repeat, name in enumerate([*gateways, *reversed(gateways)]):
            gw = gateways[name]
            reset(*engines)
            if hot is None:
                run, _ = drive(OpenAITarget(gw.url), replace(uniform, seed=uniform.seed + repeat),
                               concurrency=uniform.conversations)
            else:
                run = _skewed(gw, replace(uniform, seed=uniform.seed + repeat), hot)
            for t in run.turns:
                t.conversation += 100_000 * repeat          # keep the repeats' conversations apart
            per_p = [p_stats([p]) for p in ps]
            runs[name].append((run, per_p))
        for name, pairs in runs.items():
            merged = RunResult([t for run, _ in pairs for t in run.turns], sum(run.wall_s for run, _ in pairs))
            per_p = [{k: sum(stats[i][k] for _, stats in pairs) for k in pairs[0][1][i]} for i in range(len(ps))]
            total = {k: sum(st[k] for st in per_p) for k in per_p[0]}
            figures = _reuse_figures(merged, total, {})
            figures["kv_blocks_read_by_p"] = total["kv_blocks_read"]
            computed = [st["prompt_tokens_computed"] for st in per_p]
            figures["p_spread"] = max(computed) / statistics.fmean(computed) if any(computed) else 0.0
            out[(load_name, name)] = figures
    return out


def _skewed(gw, w: Workload, hot_history: int) -> RunResult:
    """A quarter of the conversations carry long histories (hot); all run at once."""
    hot = replace(w, conversations=max(1, w.conversations // 4), history_tokens=hot_history, seed=w.seed + 1)
    cold = replace(w, conversations=w.conversations - hot.conversations)

    async def both() -> RunResult:
        began = time.perf_counter()
        run_id = uuid.uuid4().hex[:8]          # fresh sessions: the gateways share one Redis
        runs = await asyncio.gather(
            loadgen.run(OpenAITarget(gw.url), hot, concurrency=hot.conversations, run_id=f"{run_id}-hot"),
            loadgen.run(OpenAITarget(gw.url), cold, concurrency=cold.conversations, run_id=f"{run_id}-cold",
                        first=hot.conversations))
        return RunResult([t for r in runs for t in r.turns], time.perf_counter() - began)
    return loadgen.arun(both())


# -- the table -----------------------------------------------------------------------------------------------
def report(args, sizes: Sizes, zero: dict, stream: dict, history: dict, gpu: dict, reasoning: dict,
           place: dict | None, notes: list[str], wall_s: float) -> tuple[str, str]:
    rows: list[Row] = zero["rows"]
    by_name = {r.setup: r for r in rows}

    def added(r: Row, q: float) -> float:
        """The set-up's TTFT percentile minus its floor's (same engine work, no proxy)."""
        return (percentile(r.ttft, q) - percentile(by_name[BASELINE[r.setup]].ttft, q)) * 1e3
    w: Workload = zero["workload"]
    lines = [f"# Benchmark results: `{' '.join(['python', 'bench/compare.py', *args.argv])}`", "",
             f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; wall time {wall_s:.0f} s",
             f"- machine: {platform.machine()}, {os.cpu_count()} CPUs ({_cpu_model()}), Python "
             f"{platform.python_version()}, {platform.system()} {platform.release()}",
             f"- load on the machine before the run: {_load()}", ""]
    lines += ["## 1. Added latency and throughput, zero-timing simulated engines (1 P + 1 D)", "",
              f"Closed loop: {w.conversations} conversations, {sizes.concurrency} at once, {w.turns} turns each "
              f"(in {sizes.rounds} interleaved round(s) per set-up), "
              f"~{w.new_tokens} new user tokens per turn, answers 16–48 tokens, think time uniform in 0–{2 * w.think_s:g} s "
              "(chat users pausing between turns; the machine stays below saturation, so the figures are the "
              "proxy's own latency, not queueing). TTFT = request sent → first SSE event (floor: from P's leg). "
              "Floors: the load generator sends P's leg then D's itself, no proxy; `floor with reuse` also hands "
              "each conversation's last D handle to P, as the stateful proxies do, so the engines do the same work "
              "(P reads the history from D). Added = the set-up's percentile minus its floor's: pd-gateway and "
              "the naive proxy against `floor with reuse`, vllm-router (stateless) against `floor`. CPU = the "
              "proxy process's user+system CPU per turn. The engines render prompts in every set-up "
              "(`--no-prompt-token-ids`). Streamed D legs carry their handle (`--stream-kv-params`).",
              "", "| set-up | turns | errors | TTFT p50 ms | p90 | p99 | added p50 ms | added p99 ms | "
              "proxy CPU ms/turn | engines' CPU ms/turn | saturated turns/s | CPU ms/turn saturated | "
              "proxy capacity turns/CPU-s | gateway internal p50 ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    internal50 = gateway_quantile(zero["gateway_metrics"], "internal", 0.5)
    for r in rows:
        sat = zero["saturation"].get(r.setup, {})
        t50, t90, t99 = (percentile(r.ttft, q) * 1e3 for q in (50, 90, 99))
        cap = 1e3 / sat["cpu_ms_per_turn"] if sat.get("cpu_ms_per_turn") else None
        lines.append(f"| {r.setup} | {len(r.run.ok)} | {r.run.errors + sat.get('errors', 0)} | {t50:.2f} | "
                     f"{t90:.2f} | {t99:.2f} | "
                     f"{'—' if r.setup in FLOORS else f'{added(r, 50):+.2f}'} | "
                     f"{'—' if r.setup in FLOORS else f'{added(r, 99):+.2f}'} | "
                     f"{_fmt(r.cpu_ms_per_turn)} | {_fmt(r.extra.get('engines_cpu_ms'))} | "
                     f"{sat.get('turns_per_s', 0):.0f} | {_fmt(sat.get('cpu_ms_per_turn'))} | "
                     f"{_fmt(cap, 0)} | {_fmt(internal50, 3) if r.setup == 'pd-gateway' else '—'} |")
    gw, naive = by_name["pd-gateway"], by_name["naive proxy"]
    added50, added99, naive_added = added(gw, 50), added(gw, 99), added(naive, 50)
    naive_added_ratio = added50 / naive_added if naive_added > 0 else float("nan")
    gw_sat, naive_sat = zero["saturation"]["pd-gateway"], zero["saturation"]["naive proxy"]
    naive_throughput_ratio = naive_sat["cpu_ms_per_turn"] / gw_sat["cpu_ms_per_turn"] \
        if gw_sat.get("cpu_ms_per_turn") and naive_sat.get("cpu_ms_per_turn") else float("nan")
    measured_ratio = gw_sat["turns_per_s"] / naive_sat["turns_per_s"] if naive_sat["turns_per_s"] else float("nan")
    tokens = {src: sum(v for k, v in zero["gateway_metrics"].items()
                       if k.startswith("pdgw_prompt_tokens_total{") and f'source="{src}"' in k)
              for src in ("reused", "computed")}
    lines += ["", f"pd-gateway reuse in this phase (from its /metrics): {_plans(zero['gateway_metrics'])}; prompt "
              f"tokens reused {tokens['reused']:.0f}, computed {tokens['computed']:.0f}.", "",
              "pd-gateway's own phases, mean ms (its `pdgw_turn_seconds` and `pdgw_store_seconds`; intake = parse, "
              "check, render; plan = the Redis claim (what is left of it after intake where it is sent ahead: "
              "Python 3.12+); prefill = the P leg; decode_ttft = D's leg to its first event): "
              f"{_phase_means(zero['gateway_metrics'])}.", "",
              "pd-gateway's own time per turn, p50 ms (its `pdgw_gateway_seconds`, timestamps inside the gateway, "
              "engine waits taken out: to_prefill = request in → P's request out; prefill_to_decode = P's answer → "
              "D's request out; to_client = D's first byte → the client's first byte; internal = the turn's total "
              f"less every engine wait): {_gateway_spans(zero['gateway_metrics'])}. The added latency above also "
              "holds the two extra loopback hops, the ASGI server, Redis and the cores the gateway takes from the "
              "engines.", "",
              "Throughput: on this 2-core machine the engines, Redis and the load generator share the cores with the "
              "proxy, so saturated turns/s is bounded by the engines for every set-up; the proxy's own capacity is "
              "turns per CPU-second of the proxy process (1000 / CPU ms per turn at saturation). "
              f"`naive_throughput_ratio` = that capacity, pd-gateway over naive proxy ({naive_throughput_ratio:.2f}); "
              f"the measured saturated turns/s ratio is {measured_ratio:.2f}.", ""]
    stream_lines, stream_ratio = stream_table(stream, *sizes.stream)
    lines += stream_lines
    ratios = {kind: _ratio(history[kind]) for kind in HISTORY_ENGINES}
    cpu_ratio = ratios["pinned"]
    lines += ["## 2. Gateway CPU per turn vs history length", "",
              f"{sizes.history[0]} conversations at once, {sizes.history[1]} turns, a system prompt of 1k or 32k "
              "tokens; CPU of the gateway process over turns >= 2 (every conversation's first turn is measured "
              "apart: it has to tokenize the whole history once). Two kinds of engines: "
              + "; ".join(f"`{k}`: they {v}" for k, v in HISTORY_ENGINES.items()) + ".", "",
              "| engines | history | mean prompt tokens | CPU ms/turn (turns >= 2) | CPU ms, first turn |",
              "|---|---|---|---|---|",
              *(f"| {kind} | {n // 1000}k | {h['prompt_tokens']:.0f} | {h['cpu_ms_per_turn']:.2f} | "
                f"{h['first_turn_cpu_ms']:.2f} |" for kind in HISTORY_ENGINES for n, h in history[kind].items()),
              "", f"cpu_32k_vs_1k = {cpu_ratio:.2f} (engines `pinned`; `render`: {ratios['render']:.2f})", ""]
    lines += _gpu_table("## 3. GPU-like cost model: reuse vs full prefill", sizes, gpu)
    lines += _gpu_table("## 4. Reasoning template (`builtin:demo-reasoning`, sims `--reasoning`)", sizes, reasoning)
    if place:
        lines += [f"## 5. Placement: {PLACE_P} P + {PLACE_D} D, GPU-like cost model", "",
                  "Previous-P affinity (default; kept while within `--prefill-affinity-slack-tokens` 2048 of the "
                  "least loaded P) vs `--no-prefill-affinity` (least outstanding prompt tokens), run A B B A and "
                  "pooled. Same workload as section 3 with twice the conversations; skewed: a quarter of them carry "
                  "an 8k-token history.", "",
                  "| load | P choice | mean TTFT turns >= 2 ms | p50 ms | P computed | ideal | blocks P read from D | "
                  "busiest P / mean (computed tokens) | errors |", "|---|---|---|---|---|---|---|---|---|"]
        for (load_name, name), f in place.items():
            lines.append(f"| {load_name} | {name} | {f['ttft_mean_later_ms']:.1f} | {f['ttft_p50_later_ms']:.1f} | "
                         f"{f['p_computed']} | {f['ideal_computed']} | {f['kv_blocks_read_by_p']} | "
                         f"{f['p_spread']:.2f} | {f['errors']} |")
        lines.append("")
    reuse = gpu["reuse (sessions)"]
    full = gpu["full prefill (no session, no prefix-cache hit)"]
    ttft_gain = full["ttft_mean_later_ms"] / reuse["ttft_mean_later_ms"] if reuse["ttft_mean_later_ms"] else 0.0
    r_reuse = reasoning["reuse (sessions)"]
    spans = _gateway_spans(zero["gateway_metrics"], internal=False)      # where the gateway's own time went
    router_sat = zero["saturation"].get("vllm-router", {})
    router_cpu_ratio = gw_sat["cpu_ms_per_turn"] / router_sat["cpu_ms_per_turn"] \
        if gw_sat.get("cpu_ms_per_turn") and router_sat.get("cpu_ms_per_turn") else float("nan")
    sessionless = by_name.get(SESSIONLESS)
    extra = added(sessionless, 50) - added50 if sessionless else float("nan")
    lines += ["## Targets", "", "| target | reached | met |", "|---|---|---|",
              f"| added p50 <= 1 ms at {sizes.concurrency} concurrent conversations | {added50:+.2f} ms | "
              f"{_met(added50 <= 1)} |",
              f"| added p99 <= 5 ms | {added99:+.2f} ms | {_met(added99 <= 5)} |",
              f"| gateway internal p50 <= 0.5 ms | {_fmt(internal50, 3)} ms ({spans}) | "
              f"{_met(internal50 is not None and internal50 <= 0.5)} |",
              f"| <= 0.5x the naive proxy's added latency (p50) | {naive_added_ratio:.2f}x | "
              f"{_met(naive_added_ratio <= 0.5)} |",
              f"| >= 5x the naive proxy's turns/s (capacity per CPU-second) | {naive_throughput_ratio:.2f}x "
              f"(measured saturated turns/s: {measured_ratio:.2f}x) | {_met(naive_throughput_ratio >= 5)} |",
              f"| CPU per saturated turn <= 2x vllm-router's | {router_cpu_ratio:.2f}x "
              f"({_fmt(gw_sat.get('cpu_ms_per_turn'))} vs {_fmt(router_sat.get('cpu_ms_per_turn'))} ms) | "
              f"{_met(router_cpu_ratio <= 2)} |",
              f"| CPU per turn, 32k vs 1k history <= 1.3x (engines using pinned ids) | {cpu_ratio:.2f}x | "
              f"{_met(cpu_ratio <= 1.3)} |",
              f"| streamed CPU per output token <= 2x vllm-router's | {stream_ratio:.2f}x | "
              f"{_met(stream_ratio <= 2)} |",
              f"| the sessionless lookup adds <= 0.3 ms (added p50, sessionless less with session ids) | "
              f"{extra:+.2f} ms | {_met(extra <= 0.3)} |",
              f"| P computed on continuous turns <= new + one block ({BLOCK}) | {reuse['excess_per_later_turn']:+.1f} "
              f"tokens per turn over new | {_met(reuse['excess_per_later_turn'] <= BLOCK)} |",
              f"| reasoning: >= 90% of ideal reuse | {r_reuse['reuse_of_ideal'] * 100:.1f}% | "
              f"{_met(r_reuse['reuse_of_ideal'] >= 0.9)} |",
              f"| GPU cost: mean TTFT turns >= 2 at least 3x lower with reuse | {ttft_gain:.1f}x | "
              f"{_met(ttft_gain >= 3)} |", ""]
    if sessionless:
        lines += [f"pd-gateway without session ids (conversations found by their tokens, its own gateway process "
                  f"on the same engines): added p50 {added(sessionless, 50):+.2f} ms against {added50:+.2f} ms with "
                  f"session ids: the lookup adds {extra:+.2f} ms (target <= 0.3 ms: {_met(extra <= 0.3)}).", ""]
    router = by_name.get("vllm-router")
    if router:
        lines += [f"vllm-router (stateless PD, Rust): added p50 {added(router, 50):+.2f} ms, "
                  f"p99 {added(router, 99):+.2f} ms, {_fmt(router.cpu_ms_per_turn)} CPU ms per "
                  "turn; it keeps no conversation state, so every turn is a full prefill on P (less P's prefix-cache "
                  "hits).", ""]
    lines += [PRESSURE_LINK, ""]
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    final = (f"compare: added_p50_ms={added50:.3f} added_p99_ms={added99:.3f} "
             f"naive_added_ratio={naive_added_ratio:.3f} naive_throughput_ratio={naive_throughput_ratio:.3f} "
             f"cpu_32k_vs_1k={cpu_ratio:.3f} "
             f"internal_p50_ms={internal50 if internal50 is not None else float('nan'):.3f} "
             f"router_cpu_ratio={router_cpu_ratio:.3f} stream_cpu_ratio={stream_ratio:.3f} lookup_added_ms={extra:.3f}")
    lines += ["```", final, "```", ""]
    return "\n".join(lines), final


def _ratio(by_history: dict) -> float:
    h1, h32 = by_history[1000], by_history[32000]
    return h32["cpu_ms_per_turn"] / h1["cpu_ms_per_turn"] if h1["cpu_ms_per_turn"] else float("nan")


def _gpu_table(title: str, sizes: Sizes, arms: dict) -> list[str]:
    conversations, turns = sizes.gpu
    lines = [title, "", f"Sims `{' '.join(sizes.gpu_sim)}`; {conversations} conversations at once, {turns} turns, "
             "a 1k-token system prompt, ~100 new user tokens per turn. Ideal: each turn computes only what is not a "
             "common prefix of its prompt and the previous turn's held tokens (prompt + answer); P's figures are the "
             "simulator's oracle (`/sim/stats`).", "",
             "| arm | turns (errors) | mean TTFT turns >= 2 ms | p50 ms | P computed | ideal computed | "
             "excess per turn >= 2 | P reuse / ideal | corrupt KV | plans |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in arms.items():
        lines.append(f"| {name} | {f['turns']} ({f['errors']}) | {f['ttft_mean_later_ms']:.1f} | "
                     f"{f['ttft_p50_later_ms']:.1f} | {f['p_computed']} | "
                     f"{f['ideal_computed']} | {f['excess_per_later_turn']:+.1f} | {f['reuse_of_ideal'] * 100:.1f}% | "
                     f"{f['corrupt']} | {f['plans'] or '—'} |")
    errors = [f"{name}: {f['error_sample']}" for name, f in arms.items() if f["error_sample"]]
    if errors:
        lines += ["", "First error of each arm that had some: " + "; ".join(errors)]
    return [*lines, ""]


def _fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _load() -> str:
    try:
        text = "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        text = "unknown"
    others = _other_engines()
    return text + (f"; {others} other vLLM processes were running on the machine" if others else "")


def _other_engines() -> int:
    """vLLM processes not started by this run (another session's real engines share the cores)."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")) if Path("/proc").is_dir() else ():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (b"vllm.entrypoints" in cmd or b"VLLM::" in cmd or b".venv-vllm" in cmd) and b"vllm-router" not in cmd:
            count += 1
    return count


ENGINE_CPUS_MIN = 6     # --pin: CPUs kept for the load generator, the engines and Redis, at the least


def proxies(sizes: Sizes) -> int:
    """How many proxy processes a run starts: start_all's gateways, the naive proxy and vllm-router, the
    streaming phase's gateway and vllm-router."""
    return 6 + 2 + 2 + (2 if sizes.placement else 0)


def pin_cpus(notes: list[str], sizes: Sizes) -> ProxyCpus | None:
    """Each proxy under test a CPU of its own, from the last CPU down; this process (the load generator) and all
    it starts otherwise (engines, Redis) on the rest, at least ENGINE_CPUS_MIN of them (or half, on a small
    machine). With fewer CPUs than that the proxies share theirs round robin (on 2 CPUs: all on the last one).
    As deployed: a proxy does not share its core with the engines, nor with another proxy. Every set-up,
    floors included, runs under the same placement."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        notes.append("not pinned: fewer than 2 CPUs")
        return None
    keep = max(min(ENGINE_CPUS_MIN, len(cpus) // 2), len(cpus) - proxies(sizes))
    rest, mine = cpus[:keep], cpus[keep:]
    os.sched_setaffinity(0, set(rest))
    notes.append(f"pinned: proxies under test on CPU(s) {', '.join(map(str, mine))} "
                 f"({'one each' if len(mine) >= proxies(sizes) else 'shared round robin'}); load generator, "
                 f"engines and Redis on CPU(s) {', '.join(map(str, rest))}")
    return ProxyCpus(list(reversed(mine)))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes: under a minute")
    size.add_argument("--smoke", action="store_true", help="tiny sizes, for tests")
    ap.add_argument("--placement", action=argparse.BooleanOptionalAction, default=None,
                    help="run the placement phase (default: only at full size)")
    ap.add_argument("--pin", action="store_true",
                    help="give each proxy under test a CPU of its own (as far as there are CPUs: see pin_cpus), the "
                         "engines, Redis and the load generator the others (needs 2+ CPUs; off by default: on this "
                         "project's 2-vCPU VMs all proxies share one CPU, which raised their low-load CPU per turn "
                         "and did not lower their added latency; bench/host/run.sh uses it on the 16-core host)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "RESULTS.md"),
                    help="where to write the table ('-': nowhere)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    sizes = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.placement is not None:
        sizes = replace(sizes, placement=args.placement)
    began = time.perf_counter()
    notes: list[str] = []
    phases: dict[str, float] = {}

    def timed(name: str, fn, *a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            phases[name] = time.perf_counter() - t

    with Servers() as servers:
        servers.proxy_cpus = pin_cpus(notes, sizes) if args.pin else None
        env = timed("start-up", start_all, servers, sizes)
        zero = timed("zero timing", zero_timing, servers, env, sizes, notes)
        stream = timed("streaming", stream_cost, servers, env.stream_p, env.stream_d, env.stream_gw,
                       *sizes.stream, sizes.rounds * 2, notes)
        if servers.proxy_cpus is not None:
            notes.append("proxies' CPUs, in start order: " + servers.proxy_cpus.describe())
        history = timed("history", history_cost, env, sizes)
        gpu = timed("GPU cost", gpu_scenario, env, sizes, reasoning=False)
        reasoning = timed("reasoning", gpu_scenario, env, sizes, reasoning=True)
        place = timed("placement", placement, env, sizes) if sizes.placement else None
    notes.append("phase wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()))
    text, final = report(args, sizes, zero, stream, history, gpu, reasoning, place, notes,
                         time.perf_counter() - began)
    if args.out != "-":
        Path(args.out).write_text(text)
    print(text)
    print(final)
    return final


if __name__ == "__main__":
    main()
