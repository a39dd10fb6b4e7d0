"""bench/local.py on tiny sizes: every arm answers, the simulator's oracle finds no corrupt read, and the local
path's second turn beats P reading D's KV (a read costs 40 ms in its timing model) and stateless PD."""

from __future__ import annotations

import re

import pytest

from bench import local

pytestmark = pytest.mark.integration

SUMMARY = re.compile(r"^local: ttft_vs_one_engine_\S+=(\S+) stateless_vs_local_\S+=(\S+) p_reads_vs_local_\S+=(\S+) "
                     r"itl_p99_ratio=(\S+) itl_p50_ratio=(\S+) corrupt=(\d+)$")


def test_local_smoke():
    m = SUMMARY.match(local.main(["--smoke", "--out", "-"]))
    assert m, "summary line"
    assert m.group(6) == "0"
    assert float(m.group(2)) > 1 and float(m.group(3)) > 1
