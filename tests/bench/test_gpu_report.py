"""bench/gpu/report.py over the committed H200 results: the tables, the verdicts and the rates it derives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu.report import rates

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "gpu" / "results"


@pytest.mark.parametrize(("run", "p_read", "d_read"), [
    ("cuda_ipc-block16", 1.62, 2.62), ("cuda_ipc-block128", 10.8, 18.1), ("tcp-block16", 0.28, 0.28)])
def test_rates_come_from_vllms_own_counters(run, p_read, d_read):
    r = rates(json.loads((RESULTS / run / "ttft.json").read_text()))
    assert r["p_read_gbps"] == pytest.approx(p_read, rel=0.02)
    assert r["d_read_gbps"] == pytest.approx(d_read, rel=0.02)
    assert r["bytes_per_token"] == pytest.approx(36 * 1024, rel=0.02)


def test_the_report_shows_every_section_and_flags_only_the_wrong_kv(tmp_path):
    md = tmp_path / "R.md"
    proc = subprocess.run([sys.executable, "bench/gpu/report.py", "--results", str(RESULTS / "cuda_ipc-block16"),
                           "--compare", f"block 128={RESULTS / 'cuda_ipc-block128'}", "--md", str(md),
                           "--png", str(tmp_path / "r.png")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = md.read_text()
    for heading in ("## Transport", "## Correctness", "## TTFT by history length", "### block 128"):
        assert heading in text
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert " | 20 | 0 / 0 | " in rows["| through the gateway (PD, reuse on later turns)"]
    assert " | 3 | 3 / 3 | " in rows["| **negative** control: shorter prompt, whole handle (tail alignment)"]
    assert " | 3 | 3 / 3 | " in rows["| **negative** control: another conversation's handle"]
    assert "reading KV beats recomputing it above 2.3" in text
