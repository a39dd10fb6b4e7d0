"""The chaos run (bench/chaos.py --quick) as a test: its verdict line must show no corrupt KV, no hung
request, no leaked pins, no 5xx for bad input and no error outside OpenAI's shape."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
CHAOS = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"


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
    for key in ("corrupt", "hung", "leaked_pins", "bad_input_5xx", "non_openai_errors"):
        assert verdict[key] == "0", out.stdout[-3000:]
    assert int(verdict["turns"]) > 500 and float(verdict["reuse_rate"]) > 0.3
