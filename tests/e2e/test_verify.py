"""`pd-gateway verify` on the simulator: it passes a healthy stack, catches its negative controls, leaves nothing
pinned, and fails a stack whose baseline answers differently (here: an engine started with another chat
template, the misconfiguration a rollout gate is for)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.stack import Stack, stack
from tests.servers import start

pytestmark = pytest.mark.integration

ADMIN = "verify-admin"
TOOLS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]      # so the tool case is judged too
OTHER_TEMPLATE = str(Path(__file__).resolve().parents[1] / "data" / "demo_chat_thinking_prompt.jinja")


def verify(s: Stack, baseline: str, *flags: str) -> tuple[int, dict, str]:
    cmd = [sys.executable, "-m", "gateway", "verify", "--gateway", s.gateway.url, "--baseline", baseline,
           "--prefill", *[p.url for p in s.prefill], "--decode", *[d.url for d in s.decode], "--admin-key", ADMIN,
           *flags]
    table = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in table.stderr, table.stderr
    report = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=300)
    return report.returncode, json.loads(report.stdout), table.stdout


@pytest.mark.parametrize("policy", ["miss", "buffer"])
def test_a_healthy_stack_passes_and_nothing_stays_pinned(policy):
    """`buffer` re-streams a non-streamed D leg: its streamed answers lost their logprobs before issue 28."""
    decode = ["--stream-kv-params"] if policy == "miss" else []
    with stack(sim=TOOLS, decode=decode, gateway=["--admin-key", ADMIN, "--stream-handle-policy", policy]) as s:
        code, report, table = verify(s, s.baseline.url)
        assert code == 0, table
        assert table.splitlines()[-1].startswith("verify: PASS ") and "pinned_left=0" in table.splitlines()[-1]
        cases = [v for v in report["verdicts"] if not v["expect_wrong"]]
        controls = [v for v in report["verdicts"] if v["expect_wrong"]]
        assert cases and all(v["status"] == "pass" for v in cases), [v for v in cases if v["status"] != "pass"]
        assert {v["name"] for v in controls} == {"control handle_longer_than_prompt", "control other_conversation"}
        assert all(v["status"] == "flagged" and v["how"] in ("exact", "distance") for v in controls)
        assert report["later_turn_plans"].get("reuse", 0) >= 2           # the conversations really reused D's KV
        # two runs (table and JSON): their conversations deleted, the controls' handles spent or released
        s.wait_until(lambda: all(s.stats(d)["handles_pinned"] == 0 for d in s.decode))
        assert all(s.stats(d)["kv_reads_corrupt"] == 0 for d in s.decode)


def test_a_baseline_that_answers_differently_fails_the_run():
    with stack(gateway=["--admin-key", ADMIN]) as s:
        other = start(["sim", "--role", "colocated", "--engine-id", "other", "--chat-template", OTHER_TEMPLATE])
        try:
            code, report, table = verify(s, other.url, "--quick")
        finally:
            other.stop()
        assert code == 1, table
        assert table.splitlines()[-1].startswith("verify: FAIL ")
        flagged = [v for v in report["verdicts"] if not v["expect_wrong"] and v["status"] == "flagged"]
        # by other tokens; or, where a schema forces the same first tokens, by the first token's distribution
        assert flagged and all(v["how"] in ("exact", "distance") for v in flagged), flagged
        assert sum(v["how"] == "exact" for v in flagged) >= len(flagged) - 1
