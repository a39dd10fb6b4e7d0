"""bench/intake.py runs (tiny sizes), writes its section and ends with its summary line. It checks no timing."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
FINAL = re.compile(r"^intake: cpu_32k_vs_1k=(\S+) whole_cpu_32k_vs_1k=(\S+) ms_32k=(\S+) whole_ms_32k=(\S+) "
                   r"many_vs_few=(\S+) whole_many_vs_few=(\S+) responses_cpu_32k_vs_1k=(\S+) responses_ms_32k=(\S+) "
                   r"responses_nogc_32k_vs_1k=(\S+)$")


def test_intake_bench_writes_its_section(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    out.write_text("# results\n\n## 1. something\n\nkept\n")
    proc = subprocess.run([sys.executable, "bench/intake.py", "--conversations", "1", "--turns", "2", "--rounds", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = FINAL.match(last)
    assert match and all(math.isfinite(float(v)) for v in match.groups()), last
    text = out.read_text()
    assert "kept" in text and "## 7. Intake CPU per turn by history" in text and last in text
    assert text.count("| continued |") == 4 and text.count("| whole |") == 4
    assert "Responses API turns continuing `previous_response_id`" in text and "| 32k, collector off |" in text
