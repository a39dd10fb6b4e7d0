"""bench/scaleout.py runs small here (two workers on 2 cores measure nothing) and ends with its summary line,
whose figures are its table's. It checks no timing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.scaleout import summary

ROOT = Path(__file__).resolve().parent.parent.parent
FINAL = re.compile(r"^scaleout: tokens_per_s_1=(\d+) tokens_per_s_2=(\d+) tokens_per_s_4=na tokens_per_s_8=na "
                   r"router_tokens_per_s=na scaling_8=na$")


@pytest.mark.integration
def test_quick_run_streams_through_one_and_two_workers():
    proc = subprocess.run([sys.executable, "bench/scaleout.py", "--quick", "--no-router", "--duration-s", "3",
                           "--streams", "8", "--clients", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    match = FINAL.match(lines[-1])
    assert match, lines[-1]
    rows = [line for line in lines if line.startswith("| pd-gateway, ")]
    assert len(rows) == 2 and all(row.split("|")[6].strip() == "0" for row in rows)     # no errors
    assert [int(row.split("|")[2]) for row in rows] == [int(v) for v in match.groups()] != [0, 0]


def test_scaling_is_eight_workers_over_eight_times_one():
    line = summary({"workers_1": {"tokens_per_s": 1000}, "workers_8": {"tokens_per_s": 6400},
                    "router": {"tokens_per_s": 9000}})
    assert line == ("scaleout: tokens_per_s_1=1000 tokens_per_s_2=na tokens_per_s_4=na tokens_per_s_8=6400 "
                    "router_tokens_per_s=9000 scaling_8=0.80")
