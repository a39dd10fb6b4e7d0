"""The benchmark runs (tiny sizes) and its ratios come from what it measured. It checks no timing."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import compare
from bench.loadgen import RunResult, TurnResult, percentile

ROOT = Path(__file__).resolve().parent.parent.parent
FINAL = re.compile(r"^compare: added_p50_ms=(\S+) added_p99_ms=(\S+) naive_added_ratio=(\S+) "
                   r"naive_throughput_ratio=(\S+) cpu_32k_vs_1k=(\S+) internal_p50_ms=(\S+) "
                   r"router_cpu_ratio=(\S+) stream_cpu_ratio=(\S+) lookup_added_ms=(\S+)$")


@pytest.mark.integration
def test_compare_smoke_runs_every_setup_and_ends_with_the_summary_line(tmp_path):
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, "bench/compare.py", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = FINAL.match(last)
    assert match, last
    values = [float(v) for v in match.groups()]
    # The naive proxy's added latency over a smoke run's few turns can come out at or below zero on a loaded
    # machine; the ratio is then undefined (nan, as compare.py prints it). Every other figure must be a number.
    table = out.read_text()
    router_ran = "vllm-router could not be run" not in table        # else its ratios are nan
    assert all(math.isfinite(v) for i, v in enumerate(values) if i != 2 and (router_ran or i not in (6, 7))), last
    assert "## 1b. Streaming: proxy CPU per output token" in table
    for setup in ("| floor |", "| floor with reuse |", "| pd-gateway |", "| naive proxy |"):
        assert setup in table
    assert "vllm-router" in table              # a row, or a note saying why it could not run
    assert "| reuse (sessions) |" in table and "## Targets" in table
    assert last in table
    # The summary line is the table's own figures, not constants.
    added = re.search(r"\| added p50 <= 1 ms at \d+ concurrent conversations \| ([+-][\d.]+) ms", table)
    assert added and abs(float(added.group(1)) - values[0]) < 0.01
    internal = re.search(r"\| gateway internal p50 <= 0.5 ms \| ([\d.]+) ms", table)
    assert internal and abs(float(internal.group(1)) - values[5]) < 0.001 and values[5] > 0
    header = next(line for line in table.splitlines() if "| corrupt KV |" in line)
    column = [c.strip() for c in header.split("|")].index("corrupt KV")
    arms = [line for line in table.splitlines() if line.startswith(("| reuse", "| full prefill", "| stateless"))]
    assert arms and all([c.strip() for c in line.split("|")][column] == "0" for line in arms)   # no wrong KV used


def test_each_proxy_gets_its_own_cpu_while_there_are_enough():
    from bench.servers import ProxyCpus

    cpus = ProxyCpus([15, 14, 13])
    assert [cpus.take(n) for n in ("a", "b", "c", "d")] == [{15}, {14}, {13}, {15}]    # then round robin
    assert cpus.describe() == "a on CPU 15; b on CPU 14; c on CPU 13; d on CPU 15"
    assert ProxyCpus([7, 6, 5, 4], per_proxy=2).take("x") == {7, 6}


@pytest.mark.parametrize("ncpu, kept, proxy_cpus", [(16, 6, 10), (32, 22, 10), (8, 4, 4), (2, 1, 1)])
def test_pin_keeps_cpus_for_the_engines_and_gives_the_rest_to_the_proxies(monkeypatch, ncpu, kept, proxy_cpus):
    placed = {}
    monkeypatch.setattr(compare.os, "sched_getaffinity", lambda pid: set(range(ncpu)))
    monkeypatch.setattr(compare.os, "sched_setaffinity", lambda pid, cpus: placed.setdefault("rest", cpus))
    plan = compare.pin_cpus([], compare.QUICK)
    assert placed["rest"] == set(range(kept))
    assert sorted(plan.cpus) == list(range(kept, ncpu)) and len(plan.cpus) == proxy_cpus


def test_ratios_come_from_measured_turns():
    def run(ttfts: list[float]) -> RunResult:
        return RunResult([TurnResult(0, i, True, ttft_s=t) for i, t in enumerate(ttfts)], wall_s=1.0)

    floor, gateway = run([0.010, 0.011, 0.012]), run([0.0105, 0.0115, 0.0125])
    assert percentile(gateway.ttft(), 50) - percentile(floor.ttft(), 50) == pytest.approx(0.0005)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 99) == 0.0


def test_gateway_quantile_interpolates_within_the_bucket_as_prometheus_does():
    def bucket(le: str, count: float) -> tuple[str, float]:
        return f'pdgw_gateway_seconds_bucket{{span="internal",le="{le}"}}', count
    gw = dict([bucket("0.0002", 0), bucket("0.0004", 10), bucket("0.0008", 30), bucket("+Inf", 40),
               ('pdgw_gateway_seconds_bucket{span="to_client",le="+Inf"}', 5.0)])
    assert compare.gateway_quantile(gw, "internal", 0.5) == pytest.approx(0.6)    # 20th of 40: 0.4 + 0.4 * 10/20
    assert compare.gateway_quantile(gw, "internal", 0.25) == pytest.approx(0.4)
    assert compare.gateway_quantile(gw, "to_prefill", 0.5) is None


def test_ideal_reuse_is_the_common_prefix_with_the_previous_held_tokens():
    first = TurnResult(0, 0, True, ttft_s=0.1, prompt_ids=[1, 2, 3, 4], output_ids=[5, 6, 7])
    # turn 2 extends prompt + answer (S minus its last token is what D holds) with 2 new tokens
    second = TurnResult(0, 1, True, ttft_s=0.05, prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9], output_ids=[10])
    stats = {"prompt_tokens_computed": 4 + 3, "prompt_tokens_loaded": 6, "prompt_tokens_cached": 0,
             "kv_reads_corrupt": 0}
    figures = compare._reuse_figures(RunResult([first, second], 1.0), stats, {})
    assert figures["ideal_computed"] == 4 + 3          # turn 1 all; turn 2: 9 - common prefix 6
    assert figures["excess_per_later_turn"] == 0 and figures["reuse_of_ideal"] == 1.0
    assert figures["ttft_mean_later_ms"] == pytest.approx(50.0)


@pytest.mark.integration
def test_floor_with_reuse_makes_p_read_the_history_from_d():
    """The floor the stateful proxies are measured against does the engines' work they cause: from the second
    turn on, P reads the conversation's KV from D (the simulator's own count), and none of it is wrong. Answers
    long enough that P's own prefix cache does not already hold most of the next prompt."""
    from bench.compare import ZERO_SIM
    from bench.loadgen import FloorTarget, arun, run as drive
    from bench.servers import Servers, get_json
    from bench.workload import Workload

    with Servers() as servers:
        sim = [*ZERO_SIM, "--output-tokens", "80:96"]
        p, d = servers.sims([("prefill", "fp", sim), ("decode", "fd", sim)])
        plain = arun(drive(FloorTarget([p.url], [d.url]), Workload(conversations=2, turns=3), concurrency=2))
        assert plain.errors == 0 and get_json(p.url + "/sim/stats")["prompt_tokens_loaded"] == 0
        reuse = arun(drive(FloorTarget([p.url], [d.url], reuse=True), Workload(conversations=2, turns=3, seed=1),
                           concurrency=2))
        stats = get_json(p.url + "/sim/stats")
    assert reuse.errors == 0
    assert stats["prompt_tokens_loaded"] > 0 and stats["kv_reads_corrupt"] == 0
