"""The chaos run (bench/chaos.py --quick) as a test: its verdict line must show no corrupt KV, no read of a spent
handle (`stale_reads`: garbage on vLLM even while the blocks still hold the right KV), no hung request, no leaked
pins, no 5xx for bad input and no error outside OpenAI's shape."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
CHAOS = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"
VERDICT = ("corrupt", "stale_reads", "hung", "leaked_pins", "bad_input_5xx", "non_openai_errors")


@pytest.mark.parametrize("flags", [[], ["--kv-events"], ["--kv-events", "--models", "2"]],
                         ids=["leases", "kv_events", "two_models"])
def test_chaos_quick(flags):
    """With --kv-events the gateways plan from the engines' KV events, dropped, delayed and reordered on the
    way (bench/event_relay.py): still nothing corrupt. With --models 2, two models behind the gateways, each on
    its own P and D, some session ids used with both."""
    out = subprocess.run([sys.executable, str(CHAOS), "--quick", *flags], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    verdict = dict(re.findall(r"(\w+)=([\d.]+)", last))
    assert last.startswith("chaos: "), last
    for key in VERDICT:
        assert verdict[key] == "0", out.stdout[-3000:]
    assert int(verdict["turns"]) > 500 and float(verdict["reuse_rate"]) > 0.3


def test_chaos_redis_cluster():
    """On a Redis Cluster of three masters with a replica each (issue 40): a gateway replica killed mid-stream and
    restarted on its port, its cut turns sent again to another replica; the gateways' seed master crashed and its
    replica elected. Still nothing corrupt, nothing hung, no error outside OpenAI's shape; later turns reuse D's KV
    after each fault, also on the replicas that survived the kill; every D's pin-budget shares, one per replica,
    sum to D's budget once the restarted replica beats, and at the end. Small (80 clients): about 2 minutes."""
    out = subprocess.run([sys.executable, str(CHAOS), "--quick", "--redis", "cluster", "--clients", "80"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    *_, findings, last = out.stdout.strip().splitlines()
    verdict = dict(re.findall(r"(\w+)=([\w.]+)", last))
    assert last.startswith("chaos: "), last
    for key in VERDICT:
        assert verdict[key] == "0", out.stdout[-3000:]
    assert int(verdict["turns"]) > 300 and float(verdict["reuse_rate"]) > 0.3, last
    cluster = dict(re.findall(r"(\w+)=([\w.]+)", findings))
    assert findings.startswith("cluster: "), findings
    assert int(cluster["interrupted"]) > 0, findings          # the kill did cut turns in flight
    for key in ("replica_down_s", "failover_s", "shares_settled_s"):
        assert cluster[key] != "none", findings                # back, elected, settled
    for key in ("reuse_after_replica_kill", "survivors_reuse_after_replica_kill", "reuse_after_failover"):
        assert cluster[key] != "none" and float(cluster[key]) > 0.3, findings
    assert cluster["shares_end"] == "ok", findings + "\n" + out.stdout[-3000:]
