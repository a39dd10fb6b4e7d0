"""scripts/bootstrap on a first run says what it is doing and lets pip show its progress (no silent minutes),
run for real with a stand-in python3 and venv python that record their arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STUB = """#!/bin/sh
echo "$0 $*" >> "{log}"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
fi
if [ "$1" = "-c" ] || [ "$1" = "-V" ]; then echo "Python 3.12.0"; fi
exit 0
"""


def test_first_run_announces_itself_and_shows_pips_progress(tmp_path):
    repo, bin_dir, log = tmp_path / "repo", tmp_path / "bin", tmp_path / "calls"
    (repo / "scripts").mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(ROOT / "scripts/bootstrap", repo / "scripts/bootstrap")
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    python3 = bin_dir / "python3"
    python3.write_text(STUB.format(log=log))
    python3.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    first = subprocess.run(["bash", "scripts/bootstrap"], cwd=repo, env=env, capture_output=True, text=True,
                           timeout=60)
    assert first.returncode == 0, first.stderr
    assert "creating .venv" in first.stderr and "installing pd-gateway" in first.stderr
    installs = [line for line in log.read_text().splitlines() if " install " in line]
    assert len(installs) == 2 and not any(" -q" in line for line in installs)
    assert all("--progress-bar on" in line for line in installs)
    again = subprocess.run(["bash", "scripts/bootstrap"], cwd=repo, env=env, capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and again.stderr == ""           # up to date: quiet
