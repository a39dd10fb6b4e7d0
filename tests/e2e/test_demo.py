import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_demo_prints_its_table_quickly():
    out = subprocess.run([sys.executable, "-m", "gateway", "demo"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[1:3] for r in rows] == [["full", "first_turn"]] + [["reuse", "continuous"]] * 5
    for row in rows[1:]:
        prompt, reused, computed = int(row[3]), int(row[4]), int(row[5])
        assert computed <= prompt - reused + 16       # only the new suffix (plus at most a block) on P
