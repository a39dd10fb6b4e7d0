"""bench/pin_ledger.py runs (few turns), writes its section and ends with its summary line. It checks no timing."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
FINAL = re.compile(r"^pin_ledger: ms_1k=(\S+) every_pin_ms_1k=(\S+) ratio_10k=(\S+)$")


def test_pin_ledger_bench_writes_its_section(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    out.write_text("# results\n\n## 1. something\n\nkept\n")
    proc = subprocess.run([sys.executable, "bench/pin_ledger.py", "--turns", "10", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = FINAL.match(last)
    assert match and all(math.isfinite(float(v)) for v in match.groups()), last
    text = out.read_text()
    assert "kept" in text and "## 8. Pin ledger work per turn" in text and last in text
    assert text.count("| room |") == 3 and text.count("| full |") == 3
