"""vLLM's multi-turn benchmark's conversations (see multi_turn_benchmark.py) through the gateway on simulated
engines, run once with conversation ids and once without: without them the gateway must find every
conversation by its tokens and reuse at least 95 % of what it reuses with them. Each run gets fresh engines
and gateway. `MULTI_TURN_FULL=1` runs the benchmark's own sizes (24 conversations); by default a smaller set."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.e2e.multi_turn_benchmark import Shape, run
from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

SMALL = Shape(conversations=6, messages=(8, 12), common_prefix=500, context_mean=300, context_max=1000)


def one_run(shape: Shape, *, with_ids: bool) -> tuple[float, float, object]:
    with stack(sim=["--output-tokens", "80:120"]) as pd:
        result = asyncio.run(run(pd.gateway.url, shape, with_ids=with_ids))
        reused = pd.metric("pdgw_prompt_tokens_total", source="reused")
        computed = pd.metric("pdgw_prompt_tokens_total", source="computed")
        # The plan phase holds the store work: a claim by id, or a lookup and a claim.
        plan_ms = 1e3 * pd.metric("pdgw_turn_seconds_sum", phase="plan") / pd.metric("pdgw_turn_seconds_count",
                                                                                    phase="plan")
        print(f"{'with' if with_ids else 'without'} ids: plan phase mean {plan_ms:.3f} ms")
        assert pd.total("kv_reads_corrupt") == 0 and pd.total("handles_double_read") == 0
    return reused, computed, result


def test_sessionless_reuse_matches_session_reuse():
    shape = Shape() if os.environ.get("MULTI_TURN_FULL") else SMALL
    with_ids = one_run(shape, with_ids=True)
    without = one_run(shape, with_ids=False)
    for name, (reused, computed, result) in (("with ids", with_ids), ("without ids", without)):
        print(f"{name}: turns={result.turns} failed={result.failed} reused={reused:.0f} computed={computed:.0f} "
              f"reused_share={reused / (reused + computed):.3f} plans={result.plans} how={result.how}")
    assert with_ids[2].failed == without[2].failed == 0
    assert with_ids[0] > 0
    print(f"multi_turn: sessionless_vs_session_reuse={without[0] / with_ids[0]:.3f}")
    assert without[0] >= 0.95 * with_ids[0]
