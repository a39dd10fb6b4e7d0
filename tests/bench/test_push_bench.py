"""bench/push.py on tiny sizes: both modes answer through the gateway, the push pairs really were written to
(the bench refuses otherwise), push's first token comes before pull's, and the summary line has its keys."""

from __future__ import annotations

import re

import pytest

from bench import push

pytestmark = pytest.mark.integration

SUMMARY = re.compile(r"^push: ttft_ratio_\S+=(\S+) ttft_ratio_\S+=(\S+) wire_ratio_\S+=(\S+) wire_ratio_\S+=(\S+) "
                     r"push_faster_everywhere=([01]) corrupt=(\d+)$")


def test_push_smoke():
    m = SUMMARY.match(push.main(["--smoke", "--out", "-"]))
    assert m, "summary line"
    assert m.group(6) == "0"
    assert float(m.group(1)) < 1 and m.group(5) == "1"   # D's leg overlaps P's prefill (0.91-0.96 here)


def test_report_ratios_are_push_over_pull():
    result = {(p, mode, size): t for p in push.PROFILES for size in (1024, 4096)
              for mode, t in (("pull", 0.2), ("push", 0.1 if p == "h200" else 0.3))}
    text, summary = push.report(result, 0, (1024, 4096), 1, 1.0)
    assert "| 1k | 200.0 | 100.0 | 0.50 | 200.0 | 300.0 | 1.50 |" in text
    assert summary.endswith("wire_ratio_4k=1.50 push_faster_everywhere=1 corrupt=0")    # judged on h200
    result[("h200", "push", 4096)] = 0.25
    assert push.report(result, 0, (1024, 4096), 1, 1.0)[1].endswith("push_faster_everywhere=0 corrupt=0")
