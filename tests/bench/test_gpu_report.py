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


def _row(ms: float, plans: dict | None = None) -> dict:
    return {"n": 1, "ttft_ms": ms, "prompt_tokens": 32000, "plans": plans or {}}


def test_the_cost_plan_is_judged_against_stateless_and_reading_always():
    from bench.gpu.report import cost_plan_md
    table = {"reuse_coldP": {"32000": _row(1700)}, "full_coldP": {"32000": _row(1300)},
             "cost_coldP": {"32000": _row(1320, {"full/recompute_faster": 2})},
             "reuse_warmP": {"32000": _row(100)}, "full_warmP": {"32000": _row(120)},
             "cost_warmP": {"32000": _row(200, {"reuse/continuous": 2})}}
    lines = cost_plan_md(table)
    cold = next(line for line in lines if line.startswith("| 32000") and "recompute_faster" in line)
    warm = next(line for line in lines if line.startswith("| 32000") and "reuse/continuous" in line)
    assert cold.endswith("| yes |") and " 1.02 " in cold          # 1320 / min(1700, 1300)
    assert warm.endswith("| **no** |") and " 2.00 " in warm       # 200 ms against 120 stateless: a miss shows
