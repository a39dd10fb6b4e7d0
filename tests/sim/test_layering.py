"""The simulator is an independent oracle: nothing under gateway/sim imports the rest of the gateway."""

from __future__ import annotations

import ast
from pathlib import Path

SIM_DIR = Path(__file__).resolve().parents[2] / "gateway" / "sim"


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def test_sim_imports_only_itself_from_the_gateway() -> None:
    files = sorted(SIM_DIR.glob("*.py"))
    assert files
    crossing = {f"{path.name}: {name}" for path in files for name in _imports(path)
                if (name == "gateway" or name.startswith("gateway.")) and not name.startswith("gateway.sim")
                or name.startswith("..")}
    assert not crossing
