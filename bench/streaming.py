"""compare.py's streaming phase: the proxy's CPU per streamed output token, pd-gateway against vllm-router, on
zero-timing engines whose every answer is STREAM_TOKENS tokens long (one SSE chunk each).

A streamed answer costs a proxy a fixed part per turn (intake, legs, the store) and a part per chunk (reading
D's event, relaying it); with 1,000-token answers the latter dominates, which is what this phase isolates.
CPU = the proxy process's user+system time over the measured turns, divided by the output tokens D generated
in them (the simulator's own count), and that split into user and system (kernel: the socket reads and
writes) time. The set-ups take turns A B B A on freshly reset engines.
"""

from __future__ import annotations

from dataclasses import replace

from bench import loadgen
from bench.loadgen import CpuMeter, OpenAITarget, UserSystemMeter
from bench.servers import Servers, get_json, post
from bench.workload import Workload

STREAM_TOKENS = 1000
# Zero-timing engines that use the pinned ids (vLLM 0.32+) and always answer STREAM_TOKENS tokens.
STREAM_SIM = ["--stream-kv-params", "--num-blocks", "60000", "--decoder-kv-blocks-ttl", "90",
              "--max-model-len", "131072", "--output-tokens", f"{STREAM_TOKENS}:{STREAM_TOKENS}"]


def stream_cost(s: Servers, p, d, gw, conversations: int, turns: int, rounds: int, notes: list[str]) -> dict:
    """{set-up: {turns, errors, tokens, cpu_ms_per_turn, cpu_us_per_token}} for pd-gateway and vllm-router."""
    setups = {"pd-gateway": (OpenAITarget(gw.url), gw)}
    try:
        router = s.router([p], [d])
        setups["vllm-router"] = (OpenAITarget(router.url), router)
    except Exception as exc:  # not installable or not runnable here: say so and carry on
        notes.append(f"vllm-router could not be run for the streaming phase: {str(exc).splitlines()[0][:200]}")
    w = Workload(conversations=conversations, turns=turns, new_tokens=48, seed=5)
    totals = {name: {"turns": 0, "errors": 0, "tokens": 0, "cpu_ms": 0.0, "user_ms": 0.0, "system_ms": 0.0}
              for name in setups}
    for target, _ in setups.values():        # warm up: connections, lazy imports
        loadgen.arun(loadgen.run(target, replace(w, conversations=2, turns=1, seed=98), concurrency=2))
    for round_ in range(rounds):
        for name in list(setups) if round_ % 2 == 0 else reversed(setups):
            target, server = setups[name]
            post(p.url + "/sim/reset")
            post(d.url + "/sim/reset")
            before = generated(d)
            meter, split = CpuMeter(server.proc.pid), UserSystemMeter(server.proc.pid)
            run = loadgen.arun(loadgen.run(target, replace(w, seed=round_), concurrency=conversations))
            cpu_ms, (user_s, system_s) = meter.seconds() * 1e3, split.seconds()
            total = totals[name]
            total["turns"] += len(run.ok)
            total["errors"] += run.errors
            total["tokens"] += generated(d) - before
            total["cpu_ms"] += cpu_ms
            total["user_ms"] += user_s * 1e3
            total["system_ms"] += system_s * 1e3
    return {name: {**t, "cpu_ms_per_turn": t["cpu_ms"] / max(1, t["turns"]),
                   "cpu_us_per_token": t["cpu_ms"] * 1e3 / max(1, t["tokens"]),
                   "user_us_per_token": t["user_ms"] * 1e3 / max(1, t["tokens"]),
                   "system_us_per_token": t["system_ms"] * 1e3 / max(1, t["tokens"])} for name, t in totals.items()}


def generated(d) -> int:
    """Output tokens the simulator `d` has generated so far (its own count)."""
    return int(get_json(d.url + "/sim/stats").get("generation_tokens", 0))


def table(stream: dict, conversations: int, turns: int) -> tuple[list[str], float]:
    """RESULTS.md's lines for the phase, and stream_cpu_ratio (pd-gateway over vllm-router, per token)."""
    lines = ["## 1b. Streaming: proxy CPU per output token", "",
             f"{conversations} conversations at once, {turns} turns, answers of {STREAM_TOKENS} tokens streamed "
             "(one SSE chunk per token), zero-timing engines that use the pinned ids; CPU of the proxy process over "
             "the turns, per output token D generated (the simulator's count).", "",
             "| set-up | turns | errors | output tokens | proxy CPU ms/turn | proxy CPU µs/output token | of which user / "
             "system (kernel) µs |",
             "|---|---|---|---|---|---|---|"]
    for name, f in stream.items():
        lines.append(f"| {name} | {f['turns']} | {f['errors']} | {f['tokens']} | {f['cpu_ms_per_turn']:.2f} | "
                     f"{f['cpu_us_per_token']:.2f} | {f['user_us_per_token']:.1f} / {f['system_us_per_token']:.1f} |")
    gw, router = stream.get("pd-gateway"), stream.get("vllm-router")
    ratio = gw["cpu_us_per_token"] / router["cpu_us_per_token"] if gw and router and router["cpu_us_per_token"] \
        else float("nan")
    lines += ["", f"stream_cpu_ratio = {ratio:.2f} (pd-gateway over vllm-router, CPU per output token)", ""]
    return lines, ratio
