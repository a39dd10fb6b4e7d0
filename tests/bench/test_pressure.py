"""bench/pressure.py's arithmetic: sizing, the measured working set, the gain at 2x and the summary line come
from the figures it measured (no engines are started here)."""

from __future__ import annotations

import argparse
import re

import pytest

from bench import pressure
from bench.loadgen import RunResult, TurnResult
from bench.pressure import ADAPTIVE, BUDGET, GATEWAY, NAIVE, NOBUDGET, STATELESS, IdleSetup

FINAL = re.compile(r"^pressure: budget_p99_ms=(\S+) nobudget_p99_ms=(\S+) stateless_p99_ms=(\S+) corrupt=(\d+) "
                   r"errors=(\d+) reuse_gain_at_2x=(\S+)$")


def test_history_estimate_and_blocks():
    assert pressure.history_tokens(100, 2, 10, (20, 40)) == 100 + 2 * (10 + 30 + 16) + 8
    assert [pressure.blocks(t) for t in (1, 16, 16.5, 17)] == [1, 1, 2, 2]


def test_measured_history_is_each_conversations_last_prompt_plus_a_mean_answer():
    turns = [TurnResult(0, 0, True, prompt_tokens=20), TurnResult(0, 1, True, prompt_tokens=40),
             TurnResult(1, 0, True, prompt_tokens=10), TurnResult(1, 1, False, prompt_tokens=999)]
    assert pressure._history_blocks(RunResult(turns, 1.0), (8, 8)) == pressure.blocks(48) + pressure.blocks(18)


def _arm(mean: float, errors: int = 0, corrupt: int = 0) -> dict:
    return {"mean_ms": mean, "p50_ms": mean, "p99_ms": 2 * mean, "turns": 10, "errors": errors, "error_sample": "",
            "p_computed_per_turn": 100.0, "p_waits": 0, "kv_failures": 0, "corrupt": corrupt, "history_blocks": 100, "phases": ""}


def _idle(p99: float, errors: int = 0) -> dict:
    return {"turns": 10, "errors": errors, "error_sample": "", "p50_ms": 1.0, "p99_ms": p99, "later": 5,
            "wall_s": 1.0, "d_waits": 0, "d_wait_s": 0.0, "d_wait_max_s": 0.0, "d_holds_skipped": 0, "d_preempted": 0,
            "reuse": 0.5, "reuse_later": None, "used_ratio": None, "budget_blocks": None,
            "p_computed": 1, "kv_failures": 0, "corrupt": 0, "plans": "", "history_blocks": 1000}


@pytest.mark.parametrize(("ratios", "expected"), [((0.1, 0.5, 2.0), 3.0), ((0.1, 0.4, 2.0), 3.0)])
def test_gain_is_read_at_the_point_nearest_a_working_set_twice_ps_cache(ratios, expected):
    sweep = {r: {"p_blocks": int(r * 100), GATEWAY: _arm(10.0), STATELESS: _arm(30.0 if r != 2.0 else 11.0),
                 NAIVE: _arm(12.0)} for r in ratios}
    assert pressure._gain(sweep) == expected


def _share_point(d_blocks: int, adaptive: float, stateless: float, reuse: float | None = 0.95) -> dict:
    point = {"d_blocks": d_blocks, ADAPTIVE: _idle(adaptive), BUDGET: _idle(3 * adaptive),
             NOBUDGET: _idle(900.0, errors=3), STATELESS: _idle(stateless)}
    point[ADAPTIVE]["reuse_later"] = reuse
    return point


def test_summary_line_counts_every_arm_and_reports_the_adaptive_arm_at_d_share():
    sweep = {0.5: {"p_blocks": 50, GATEWAY: _arm(10.0, errors=1), STATELESS: _arm(25.0, corrupt=2),
                   NAIVE: _arm(11.0)}}
    idle_out = {0.05: _share_point(50, 30.0, 20.0), 0.1: _share_point(100, 45.0, 40.0),
                2.0: _share_point(2000, 10.0, 40.0)}
    setup = IdleSetup(4.8, 1000, {0.05: 50, 0.1: 100, 2.0: 2000}, {})
    args = argparse.Namespace(argv=["--quick"], load="0.10 0.20 0.30")
    text, final = pressure.report(args, pressure.QUICK, setup, idle_out, sweep, ["a note"], 1.0, None)
    match = FINAL.match(final)
    assert match, final
    assert match.groups() == ("45.0", "900.0", "40.0", "2", "10", "2.50")   # 3 TTL-only arms x 3 errors + 1
    assert final in text and "a note" in text and "| pd-gateway, TTL only |" in text
    # the targets: worst p99 ratio over the points (0.05: 60/40), reuse where the budget holds the history
    assert "p99 1.50x" in text and "2: 95%" in text and "p50 1.00x" in text
    assert "| 2.00 (planned 2) | pd-gateway, adaptive pins (budget 0.5) |" in text
